"""NER tag schemes (nlp_tricks/data/schemes.py): each scheme's entities against a brute-force reading written here and
against seqeval's default mode, writing back and converting between schemes, the lenient rule on ill-formed tags,
detection from a file's prefixes and refusals of tags a scheme does not have."""

from __future__ import annotations

import random

import pytest
from data_generator import SCHEME_WRITING, draw_spans, write_scheme_tags
from seqeval.metrics import accuracy_score, classification_report
from seqeval.metrics.sequence_labeling import get_entities

from nlp_tricks.data import DataError
from nlp_tricks.data.schemes import (
    SCHEMES,
    convert_tags,
    resolve_scheme,
    scan_examples,
    spans_to_tags,
    tags_to_spans,
)
from nlp_tricks.metrics.spans import tag_f1

# Each prefix's role, as the schemes define it: begin, inside, end, single.
ROLE = {"B": "begin", "I": "inside", "M": "inside", "E": "end", "L": "end", "S": "single", "U": "single"}


def brute_force_spans(tags: list[str]) -> set[tuple[str, int, int]]:
    """Every ``(type, i, j)`` that is an entity under the lenient rule, tried one by one: word i opens it (a begin or
    single tag, or any tag whose word before is O, of another type, or an end / single tag), every word up to j
    continues it (same type, not opening), and it stops at j (the end of the sentence, an O, a word that opens one,
    or an end / single tag at j - 1)."""

    def parts(k):
        return ("O", None) if tags[k] == "O" else (ROLE[tags[k][0]], tags[k][2:])

    def opens(k):
        role, kind = parts(k)
        if role == "O":
            return False
        if role in ("begin", "single") or k == 0:
            return True
        before, before_kind = parts(k - 1)
        return before in ("O", "end", "single") or before_kind != kind

    found = set()
    n = len(tags)
    for i in range(n):
        for j in range(i + 1, n + 1):
            kind = parts(i)[1]
            inside = all(parts(k)[1] == kind and not opens(k) for k in range(i + 1, j))
            stops = j == n or parts(j)[0] == "O" or opens(j) or parts(j - 1)[0] in ("end", "single")
            closed_early = any(parts(k)[0] in ("end", "single") for k in range(i, j - 1))
            if opens(i) and inside and stops and not closed_early:
                found.add((kind, i, j))
    return found


def random_tags(rng: random.Random, n: int, prefixes: str) -> list[str]:
    return [rng.choice(["O"] + [f"{p}-{t}" for p in prefixes for t in ("PER", "LOC")]) for _ in range(n)]


@pytest.mark.parametrize("prefixes", ["BI", "BIES", "BMES", "BILU", "BIMESLU"])
def test_every_tag_sequence_reads_as_the_brute_force_reading(prefixes):
    rng = random.Random(len(prefixes))
    for _ in range(3000):
        tags = random_tags(rng, rng.randint(0, 7), prefixes)
        spans = tags_to_spans(tags)
        assert len(spans) == len(set(spans)) and set(spans) == brute_force_spans(tags), tags
        assert spans == sorted(spans, key=lambda s: s[1])


# seqeval's default mode reads B, I, E, S and O; BMES's M- and BILOU's L- / U- are its I-, E- and S-.
TO_SEQEVAL = {"M": "I", "L": "E", "U": "S"}


@pytest.mark.parametrize("prefixes", ["BI", "BIES", "BMES", "BILU"])
def test_every_tag_sequence_reads_as_seqeval_reads_it(prefixes):
    rng = random.Random(7)
    for _ in range(3000):
        tags = random_tags(rng, rng.randint(1, 7), prefixes)
        seqeval_tags = [t if t == "O" else TO_SEQEVAL.get(t[0], t[0]) + t[1:] for t in tags]
        want = [(kind, start, end + 1) for kind, start, end in get_entities(seqeval_tags)]
        assert tags_to_spans(tags) == want, tags


@pytest.mark.parametrize("scheme", SCHEMES)
def test_written_entities_read_back_in_every_scheme(scheme):
    rng = random.Random(3)
    for _ in range(2000):
        n = rng.randint(0, 8)
        spans = draw_spans(rng, n)
        tags = spans_to_tags(spans, n, scheme)
        # The library's writer against the one written out in tests/data_generator.py from the definitions.
        assert tags == write_scheme_tags(spans, n, scheme)
        assert tags_to_spans(tags) == spans
        assert {t[0] for t in tags} <= set(SCHEME_WRITING[scheme]) | {"O", "B"}  # IOB1's B- between two entities
        for other in SCHEMES:
            converted = convert_tags(tags, other)
            assert tags_to_spans(converted) == spans
            assert convert_tags(converted, scheme) == tags


def test_the_lenient_rule_on_ill_formed_tags():
    cases = {
        ("E-LOC",): [("LOC", 0, 1)],  # an end with no opening: one word
        ("O", "M-ORG", "E-ORG"): [("ORG", 1, 3)],  # M- after O opens
        ("O", "I-PER", "I-PER"): [("PER", 1, 3)],  # IOB2's I- after O opens (IOB1's way)
        ("B-PER", "O"): [("PER", 0, 1)],  # BIOES: a B- never closed ends before O
        ("B-PER", "I-LOC", "E-LOC"): [("PER", 0, 1), ("LOC", 1, 3)],  # a change of type closes and opens
        ("S-PER", "I-PER"): [("PER", 0, 1), ("PER", 1, 2)],  # after a single, an inside tag opens another
        ("B-PER", "E-PER", "E-PER"): [("PER", 0, 2), ("PER", 2, 3)],
        ("U-PER", "L-PER"): [("PER", 0, 1), ("PER", 1, 2)],
        ("B-PER", "M-PER"): [("PER", 0, 2)],  # no end: ends with the sentence
    }
    for tags, spans in cases.items():
        assert tags_to_spans(list(tags)) == spans, tags
    with pytest.raises(ValueError, match="neither 'O' nor a prefixed tag"):
        tags_to_spans(["PER"])


def test_tag_f1_is_seqeval_bit_for_bit_and_scheme_free():
    rng = random.Random(11)
    for prefixes in ("BI", "BIES"):
        gold = [random_tags(rng, rng.randint(1, 9), prefixes) for _ in range(60)]
        pred = [random_tags(rng, len(g), prefixes) for g in gold]
        report = classification_report(gold, pred, output_dict=True, zero_division=0)
        got = tag_f1(pred, gold)
        assert got["accuracy"] == accuracy_score(gold, pred)
        for kind, values in [("micro avg", got), *((k, got[k]) for k in ("PER", "LOC"))]:
            want = report[kind]
            assert (values["precision"], values["recall"], values["f1"]) == (
                want["precision"], want["recall"], want["f1-score"],
            )  # fmt: skip
    # The same entities in any scheme score the same F1 (accuracy counts the tags as written).
    gold_spans = [draw_spans(rng, 8) for _ in range(40)]
    pred_spans = [draw_spans(rng, 8) for _ in range(40)]
    f1 = {
        scheme: tag_f1(
            [spans_to_tags(p, 8, scheme) for p in pred_spans], [spans_to_tags(g, 8, scheme) for g in gold_spans]
        )
        for scheme in SCHEMES
    }
    assert len({(s["f1"], s["precision"], s["recall"]) for s in f1.values()}) == 1


def scan(*sentences):
    """A scan of sentences given as tag lists, each tag on its own line, a blank line between sentences."""
    examples, line = [], 1
    for tags in sentences:
        examples.append({"ner_tags": list(tags), "tag_lines": list(range(line, line + len(tags)))})
        line += len(tags) + 1
    return scan_examples(examples)


def test_the_scheme_is_detected_from_the_prefixes():
    assert resolve_scheme(scan(["B-ORG", "M-ORG", "E-ORG", "S-PER", "O"]), "auto", "a")[0] == "bmes"
    assert resolve_scheme(scan(["B-ORG", "I-ORG", "E-ORG"], ["S-PER"]), "auto", "a")[0] == "bioes"
    assert resolve_scheme(scan(["U-PER", "O", "B-X", "L-X"]), "auto", "a")[0] == "bilou"
    assert resolve_scheme(scan(["B-PER", "I-PER", "O", "B-LOC"]), "auto", "a")[0] == "iob2"
    # CoNLL-2003's original IOB1: I- opens, B- only right after an entity of its type.
    iob1 = scan(["I-PER", "I-PER", "O", "I-LOC", "B-LOC"], ["I-ORG"])
    scheme, why = resolve_scheme(iob1, "auto", "a")
    assert scheme == "iob1" and "'I-PER' (line 1)" in why
    # Both ways of opening: ill-formed IOB2, read by the lenient rule.
    scheme, why = resolve_scheme(scan(["B-PER", "O", "I-LOC"]), "auto", "a")
    assert scheme == "iob2" and "'I-LOC' (line 3), is read as B-" in why
    assert resolve_scheme(scan(["O", "O"]), "auto", "a") == ("iob2", "IOB2 (no entity tags)")


def test_tags_of_no_one_scheme_are_refused_at_their_line():
    with pytest.raises(DataError) as info:
        resolve_scheme(scan(["B-ORG", "M-ORG", "E-ORG"], ["O", "I-PER"]), "auto", "train.conll")
    assert str(info.value) == (
        "train.conll:6: --tag_scheme auto: tag 'I-PER' is not a BMES tag, the scheme of the file's 'M-ORG' (line 2): "
        "one file holds one scheme"
    )
    with pytest.raises(DataError) as info:
        resolve_scheme(scan(["B-PER", "O"], ["PER"]), "auto", "train.conll")
    assert str(info.value).startswith("train.conll:4: --tag_scheme auto: tag 'PER' is neither 'O' nor a prefix")


def test_a_named_scheme_refuses_a_tag_it_does_not_have():
    assert resolve_scheme(scan(["B-X", "I-X"]), "bioes", "a")[0] == "bioes"  # IOB2 tags are BIOES tags too
    with pytest.raises(DataError) as info:
        resolve_scheme(scan(["B-X", "I-X"], ["O", "S-X"]), "iob2", "train.conll")
    assert str(info.value) == (
        "train.conll:5: tag 'S-X' is not an IOB2 tag (--tag_scheme iob2: 'O' and B-, I- and a type); the file's tags "
        "read as BIOES: name it with --tag_scheme bioes, or leave --tag_scheme auto"
    )
    with pytest.raises(DataError, match=r"test.conll:1: tag 'M-X' is not a BIOES tag \(detected in train.conll"):
        resolve_scheme(scan(["M-X"]), "bioes", "test.conll", detected_from="train.conll")
