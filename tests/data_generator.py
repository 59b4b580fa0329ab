"""A seeded generator of data files, valid and broken, each with what it must read to: the readers' test oracle.

Every file is built from the records it is meant to hold, written the way the format says (CoNLL columns, RFC 4180
quoting for CSV / TSV, ``json.dumps`` or a number's own text for JSON lines, words for plain text), with the hard
characters drawn in on purpose: Unicode separators that ``str.split`` / ``str.splitlines`` break on (U+2028, U+2029,
``\\x85``, ``\\x1c``-``\\x1f``, no-break and other Unicode spaces), quotes, commas, tabs, numbers as labels (``1.0``,
``1e30``, 5,000-digit integers), fields longer than csv's default limit, and every line end (``\\n``, ``\\r\\n``,
``\\r``, mixed, with or without a byte-order mark or a last line end). A broken file has one defect put in at a known
line (a row with an extra field, a token holding a space, ``NaN``, a duplicate key, a lone surrogate, a byte that is
not UTF-8, ...), and must be refused there with a :class:`~nlp_tricks.data.DataError`.

The truth comes from how the file was built, never from the readers' code: the line of a record is counted from the
line ends written before it. A new reader (or format) is checked the same way by adding its writer here.

    cases = generate_cases(seed=0, count=300)
    problems = [problem for case in cases if (problem := check_case(case, tmp_path))]
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from nlp_tricks.data import (
    DataError,
    read_conll,
    read_conll_tokens,
    read_ner_file,
    read_table_file,
    read_text_sentences,
)
from nlp_tricks.data.schemes import SCHEMES, resolve_scheme, scan_examples, tags_to_spans

# Characters Python's str.split() or str.splitlines() break at that are not ASCII whitespace: inside a token.
SEPARATORS = "\u2028\u2029\x85\x1c\x1d\x1e\x1f\xa0\u3000\u2009\u202f\u1680\u205f"
HARD = SEPARATORS + "\"',;|\\/#-–—…éßøæ中文字😀\u0301\u200b\ufeff%$€ſİ"
LOWER = "abcdefghijklmnopqrstuvwxyz"
TAGS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-NUM")
# Labels as the text they are written with: numbers Python's float would change, ids of any length. All are JSON
# numbers; CSV labels add the zero-padded "01".
NUMBER_TEXTS = (
    "0", "-0", "1", "1.0", "1.50", "1e30", "1E+2", "-3.25e-7", "12345678901234567890",
    "12345678901234567891.0", "1e400", "1e1000000000000000000", "7" * 4400,
)  # fmt: skip
WORD_LABELS = ("pos", "neg", "n/a", "class10", "class2", "Ünïcode", "a,b", 'say "hi"')
LINE_ENDS = ("\n", "\r\n", "\r")
MAX_CSV_FIELD = 131_072  # csv's default field size limit: longer fields must still read
BAD_BYTE_MARK = "\ue000"  # replaced by a byte that is not UTF-8 after encoding


@dataclass
class Case:
    """One generated file: its bytes, how to read it, and either its records or the line it is refused at."""

    name: str
    suffix: str
    data: bytes
    reader: str  # "conll", "conll_tokens", "ner", "table", "text", "entities"
    kwargs: dict = field(default_factory=dict)
    expected: list[dict] | None = None  # the records, when the file is valid
    refused_line: int | None = None  # the line of the DataError, when it is not (None: the whole file)


def _read_entities(path, **kwargs):
    return read_entities(path, **kwargs)


READERS = {
    "conll": read_conll,
    "conll_tokens": read_conll_tokens,
    "ner": read_ner_file,
    "table": read_table_file,
    "text": read_text_sentences,
    "entities": _read_entities,
}


# ---- Text and line ends -----------------------------------------------------------------------------------------


def token(rng: random.Random, hard: float = 0.5) -> str:
    """A word without ASCII whitespace or line ends, with at least one letter, often holding a hard character."""
    letters = "".join(rng.choice(LOWER) for _ in range(rng.randint(1, 6)))
    if rng.random() >= hard:
        return letters
    chars = list(letters)
    for _ in range(rng.randint(1, 3)):
        chars.insert(rng.randint(0, len(chars)), rng.choice(HARD))
    word = "".join(chars)
    if word.startswith("#") or word.startswith("-DOCSTART-"):  # comment and document lines of CoNLL
        word = "x" + word
    return word


def number_token(rng: random.Random) -> str:
    """A number grouped with a no-break or thin space, as typeset text writes them (``10 000``)."""
    return f"{rng.randint(1, 999)}{rng.choice(chr(0xA0) + chr(0x202F) + chr(0x2009))}{rng.randint(0, 999):03d}"


def free_text(rng: random.Random, long: bool = False) -> str:
    """A text value for CSV / TSV / JSON: words, spaces, tabs, commas, quotes and line breaks of every kind."""
    if long:
        piece = " ".join(token(rng) for _ in range(100)) + rng.choice([" ", "\n", ", "])
        return piece * (MAX_CSV_FIELD // len(piece) + 1) + token(rng)
    parts = []
    for _ in range(rng.randint(1, 12)):
        parts.append(rng.choice([token(rng), number_token(rng), rng.choice(NUMBER_TEXTS[:8])]))
        parts.append(rng.choice([" ", " ", " ", ", ", "\t", '"', "\n", "\r\n", "\r", "  "]))
    text = "".join(parts).strip(" ")
    return text or "x"


def line_breaks(text: str) -> int:
    """How many line ends ``text`` holds: ``\\r\\n``, ``\\r`` and ``\\n`` each end one line."""
    return len(re.findall(r"\r\n|\r|\n", text))


class FileWriter:
    """A file written record by record, each record's first and last line counted from the line ends before it."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.style = rng.choice(["\n", "\r\n", "\r", "mixed", "mixed"])
        self.parts: list[str] = ["\ufeff"] if rng.random() < 0.15 else []
        self.line = 1  # the line the next record starts on
        self.previous_end = ""

    def end(self, text: str) -> str:
        end = self.rng.choice(LINE_ENDS) if self.style == "mixed" else self.style
        # A "\r" just before a "\n" end would read as one "\r\n": choose another end there.
        before = text[-1:] if text else self.previous_end[-1:]
        if before == "\r" and end == "\n":
            end = "\r"
        return end

    def add(self, text: str) -> tuple[int, int]:
        """Append a record (it may hold line breaks inside quotes); ``(first line, last line)`` of it."""
        first = self.line
        end = self.end(text)
        self.parts.append(text + end)
        self.previous_end = end
        last = first + line_breaks(text)
        self.line = last + 1
        return first, last

    def data(self, drop_last_end: bool | None = None) -> bytes:
        """The file's bytes, sometimes without its last line end (``drop_last_end`` None: at random)."""
        text = "".join(self.parts)
        if self.rng.random() < 0.2 if drop_last_end is None else drop_last_end:
            text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith(("\r", "\n")) else text
        data = text.encode("utf-8")
        return data.replace(BAD_BYTE_MARK.encode("utf-8"), b"\xff")


# ---- CoNLL --------------------------------------------------------------------------------------------------------

# The prefixes each tag scheme writes an entity's words with: (begin, inside, end, single); IOB1 writes I- for the
# first word unless the entity directly follows one of its type (then B-).
SCHEME_WRITING = {
    "iob1": ("I", "I", "I", "I"),
    "iob2": ("B", "I", "I", "B"),
    "bioes": ("B", "I", "E", "S"),
    "bmes": ("B", "M", "E", "S"),
    "bilou": ("B", "I", "L", "U"),
}
TYPES = ("PER", "LOC", "ORG")
CJK = "中国人民银行北京上海东京大学日本語漢字"


def draw_spans(rng: random.Random, length: int, first_entity: bool = False) -> list[tuple[str, int, int]]:
    """Non-overlapping entities ``(type, start, end exclusive)`` over ``length`` words, in order; some adjacent."""
    spans, i = [], 0
    while i < length:
        if (first_entity and i == 0) or rng.random() < 0.4:
            end = min(length, i + rng.choice([1, 1, 2, 3, 4]))
            spans.append((rng.choice(TYPES), i, end))
            i = end
        else:
            i += 1
    return spans


def write_scheme_tags(spans: list[tuple[str, int, int]], length: int, scheme: str) -> list[str]:
    """The tags of ``length`` words holding ``spans`` in ``scheme``, written out here from the schemes' definitions
    (never by the library's writer)."""
    begin, inside, end_prefix, single = SCHEME_WRITING[scheme]
    tags, ended = ["O"] * length, {}
    for kind, start, end in spans:
        if scheme == "iob1":
            first = "B" if ended.get(start) == kind else "I"
        else:
            first = single if end - start == 1 else begin
        tags[start] = f"{first}-{kind}"
        for i in range(start + 1, end):
            tags[i] = f"{end_prefix if i == end - 1 else inside}-{kind}"
        ended[end] = kind
    return tags


def expected_scheme(scheme: str, all_tags: list[str]) -> str:
    """The scheme a file written in ``scheme`` reads as: IOB2 without entities; BIOES for BMES with no M- tag (the
    two agree on every other prefix)."""
    if all(tag == "O" for tag in all_tags):
        return "iob2"
    if scheme == "bmes" and not any(tag.startswith("M-") for tag in all_tags):
        return "bioes"
    return scheme


def comment_line(rng: random.Random, width: int, n: int) -> str:
    """A comment line above a sentence: CoNLL-U's ``# sent_id = s3`` (as many words as a 4-column file has),
    ``# text = ...`` or MultiCoNER's ``# id ...<TAB>domain=en``; its last word is never a tag."""
    return rng.choice(
        [
            f"# sent_id = s{n}",
            "# text = " + " ".join("".join(rng.choice(LOWER) for _ in range(3)) for _ in range(max(1, width - 3))),
            f"# id {rng.randrange(16**8):08x}\tdomain=en",
        ]
    )


def conll_case(rng: random.Random, name: str, kind: str, broken: str | None, scheme: str | None = None) -> Case:
    """CoNLL NER (``kind``: ``"2col"``, ``"4col"``, ``"tab"``, ``"tab4"``) or one word per line (``"1col"``, read as
    tokens), comment lines above some sentences; with ``scheme`` the tags are entities written in that scheme (and
    sometimes read as entities), with ``cjk`` in the name one CJK character per line."""
    w = FileWriter(rng)
    tagged = kind != "1col"
    width = {"1col": 1, "2col": 2, "4col": 4, "tab": 2, "tab4": 4}[kind]
    sep = "\t" if kind.startswith("tab") else None
    cjk = "cjk" in name
    sentences = []
    n_sentences = rng.randint(1, 6)
    if broken in ("space_in_token", "one_line_extra_column") and n_sentences < 2:
        n_sentences = 2
    bad_line = None
    if kind == "4col" and rng.random() < 0.3:
        w.add("-DOCSTART- -X- -X- O")
        w.add("")
    # The sentence the defect goes into (a sentence of one line for one_line_extra_column, else of several).
    target = rng.randrange(n_sentences)
    for s in range(n_sentences):
        length = 1 if (broken == "one_line_extra_column" and s == target) else rng.randint(1, 6)
        if broken in ("space_in_token", "no_tag", "word_tag", "bad_byte") and s == target and length < 2:
            length = 2
        if broken == "one_line_extra_column" and s != target and length < 2:
            length = 2  # the file's sentences of several lines show its column count
        if rng.random() < 0.3:
            w.add(comment_line(rng, width, s))
        sentence_tags, spans = None, []
        if scheme is not None:
            spans = draw_spans(rng, length, s == 0)
            sentence_tags = write_scheme_tags(spans, length, scheme)
        tokens, tags, lines = [], [], []
        for k in range(length):
            tok = rng.choice(CJK) if cjk else number_token(rng) if rng.random() < 0.1 else token(rng)
            tag = sentence_tags[k] if sentence_tags else rng.choice(TAGS)
            if s == 0 and k == 0:
                tok = "".join(rng.choice(LOWER) for _ in range(3))  # a word, so the file is not tag-first
                tag = tag if sentence_tags else "B-PER"  # a prefixed tag, so that a word as a tag is refused
            columns = [tok] + [token(rng, 0.2) for _ in range(width - 2)] + ([tag] if tagged else [])
            defect = s == target and k == length - 1  # the last line of its sentence: never the sentence's first
            if defect and broken == "space_in_token":
                columns[0] = tok = f"{tok} {token(rng, 0.0)}"
            elif defect and broken == "one_line_extra_column":
                columns.insert(1, token(rng, 0.0))
            elif defect and broken == "no_tag" and tagged:
                columns = [tok]
            elif defect and broken == "word_tag" and tagged:
                columns[-1] = tag = "".join(rng.choice(LOWER) for _ in range(4))
            elif defect and broken == "bad_byte":
                columns[0] = tok + BAD_BYTE_MARK
            if sep:
                text = sep.join(columns)
            else:
                text = "".join(column + rng.choice([" ", " ", "  "]) for column in columns).rstrip(" ")
            if rng.random() < 0.1 and not sep:
                text = rng.choice([" ", "  "]) + text + rng.choice(["", " "])
            line, _ = w.add(text)
            if defect and broken:
                bad_line = line
            tokens.append(tok)
            tags.append(tag)
            lines.append(line)
        sentences.append((tokens, tags, lines, spans))
        for _ in range(rng.choice([1, 1, 1, 2])):
            w.add(
                rng.choice(["", "", "", " ", "\t", "\xa0", "\u3000"])
                if s < n_sentences - 1 or rng.random() < 0.5
                else ""
            )
    if broken == "no_tag" and not tagged:
        broken = None  # a tokens file has no tags to miss
    if not tagged:
        expected = [{"tokens": t, "line": ln[0]} for t, _, ln, _ in sentences]
        return Case(name, ".conll", w.data(), "conll_tokens", {}, None if broken else expected, bad_line)
    expected = [{"tokens": t, "ner_tags": g, "line": ln[0], "tag_lines": ln} for t, g, ln, _ in sentences]
    if scheme is not None and rng.random() < 0.5:
        return entities_case(name, w.data(), scheme, sentences, expected, broken, bad_line, rng)
    reader = rng.choice(["ner", "conll", "conll_tokens"])
    if reader == "conll_tokens":
        if broken in ("no_tag", "word_tag"):  # the tokens reader ignores the tags
            reader = "conll"
        expected = [{"tokens": ex["tokens"], "line": ex["line"]} for ex in expected]
    return Case(name, ".conll", w.data(), reader, {}, None if broken else expected, bad_line if broken else None)


def entities_case(name, data, scheme, sentences, expected, broken, bad_line, rng) -> Case:
    """A CoNLL file of ``scheme`` tags read as entities (:func:`read_entities`): the spans each sentence was
    written from and the scheme it was written in; or, named as another scheme, refused at its first tag that
    scheme does not have."""
    all_tags = [tag for _, tags, _, _ in sentences for tag in tags]
    records = [
        {**ex, "spans": spans, "scheme": expected_scheme(scheme, all_tags)}
        for ex, (_, _, _, spans) in zip(expected, sentences)
    ]
    if not broken and scheme in ("bioes", "bmes", "bilou") and rng.random() < 0.3:
        # Named as a scheme of B- and I- alone: refused at its first tag of another prefix.
        lines = [line for _, tags, lines, _ in sentences for tag, line in zip(tags, lines) if tag[0] not in "BIO"]
        if lines:
            return Case(name, ".conll", data, "entities", {"tag_scheme": "iob2"}, None, lines[0])
    return Case(name, ".conll", data, "entities", {}, None if broken else records, bad_line if broken else None)


def too_wide_case(rng: random.Random, name: str) -> Case:
    """A file of one line of text (a paragraph named .conll): refused at that line as too wide to be CoNLL."""
    w = FileWriter(rng)
    line, _ = w.add(" ".join(token(rng, 0.0) for _ in range(rng.randint(17, 400))))
    return Case(name, ".conll", w.data(), rng.choice(["conll", "conll_tokens", "ner"]), {}, None, line)


def read_entities(path, tag_scheme: str = "auto") -> list[dict]:
    """:func:`read_ner_file` with each sentence's entities (``spans``) and the file's scheme under ``tag_scheme``
    (``scheme``): the NER recipe's reading of a file's tags."""
    examples = read_ner_file(path)
    scheme, _ = resolve_scheme(scan_examples(examples), tag_scheme, path)
    return [{**ex, "spans": tags_to_spans(ex["ner_tags"]), "scheme": scheme} for ex in examples]


# ---- JSON lines ---------------------------------------------------------------------------------------------------


def json_string(rng: random.Random, value: str) -> str:
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


def json_record(rng: random.Random, pairs: list[tuple[str, str]]) -> str:
    """A JSON object from already-encoded values, keys in the given order, with random spacing."""
    colon, comma = rng.choice([(": ", ", "), (":", ","), (" : ", " ,  ")])
    return "{" + comma.join(f"{json.dumps(key)}{colon}{value}" for key, value in pairs) + "}"


JSON_DEFECTS = ("nan", "infinity", "duplicate_key", "lone_surrogate", "deep", "missing_field", "bad_byte", "not_json")


def json_table_case(rng: random.Random, name: str, broken: str | None) -> Case:
    """JSON lines for classification / summarization: a text and a label (a string, a number's text, or a list)."""
    w = FileWriter(rng)
    multi = rng.random() < 0.2
    expected, bad_line = [], None
    n = rng.randint(1, 8)
    target = rng.randrange(n)
    for i in range(n):
        text = free_text(rng, long=rng.random() < 0.02)
        if rng.random() < 0.5:
            label_text = rng.choice(NUMBER_TEXTS)
            label_json, label = label_text, label_text
        else:
            label = rng.choice(WORD_LABELS)
            label_json = json_string(rng, label)
        if multi and rng.random() < 0.6:
            items = [rng.choice(NUMBER_TEXTS[:10]) for _ in range(rng.randint(0, 3))]
            label_json, label = "[" + ", ".join(items) + "]", items
        pairs = [("text", json_string(rng, text)), ("label", label_json)]
        if rng.random() < 0.3:
            pairs.append(("id", str(rng.randint(0, 10**30))))
        rng.shuffle(pairs)
        defect = broken if i == target else None
        if defect == "nan":
            pairs = [(k, "NaN" if k == "label" else v) for k, v in pairs]
        elif defect == "infinity":
            pairs = [(k, rng.choice(["Infinity", "-Infinity"]) if k == "label" else v) for k, v in pairs]
        elif defect == "duplicate_key":
            pairs.append(("label", json_string(rng, "other")))
        elif defect == "lone_surrogate":
            pairs = [(k, '"bad \\ud800 half"' if k == "text" else v) for k, v in pairs]
        elif defect == "deep":
            pairs.append(("meta", "[" * 1000 + "]" * 1000))
        elif defect == "missing_field":
            pairs = [(k, v) for k, v in pairs if k != "label"]
        elif defect == "bad_byte":
            bad = json.dumps(text + BAD_BYTE_MARK, ensure_ascii=False)
            pairs = [(k, bad if k == "text" else v) for k, v in pairs]
        record = json_record(rng, pairs)
        if defect == "not_json":
            record = record[:-1]
        line, _ = w.add(record)
        if defect:
            bad_line = line
        expected.append({"text": text, "label": label, "line": line})
        if rng.random() < 0.15:
            w.add(rng.choice(["", " "]))
    kwargs = {"fields": ["text", "label"], "list_fields": ["label"] if multi else []}
    return Case(name, ".jsonl", w.data(), "table", kwargs, None if broken else expected, bad_line)


def json_ner_case(rng: random.Random, name: str, broken: str | None) -> Case:
    """JSON lines for NER: tokens (any text, spaces included) and tags (strings, spaces around them, or ids)."""
    w = FileWriter(rng)
    ids = rng.random() < 0.25
    expected, bad_line = [], None
    n = rng.randint(1, 6)
    target = rng.randrange(n)
    for i in range(n):
        length = rng.randint(1, 6)
        tokens = [rng.choice([token(rng), free_text(rng), "New York", number_token(rng)]) for _ in range(length)]
        if i == 0:
            tokens[0] = "".join(rng.choice(LOWER) for _ in range(3))
        tags = [rng.choice(TAGS) for _ in range(length)]
        if ids:
            tags_json = "[" + ", ".join(str(TAGS.index(t)) for t in tags) + "]"
        else:
            spaced = [rng.choice(["", " ", "\t"]) + t + rng.choice(["", " "]) for t in tags]
            tags_json = "[" + ", ".join(json_string(rng, t) for t in spaced) + "]"
        pairs = [("tokens", "[" + ", ".join(json_string(rng, t) for t in tokens) + "]"), ("ner_tags", tags_json)]
        defect = broken if i == target else None
        if defect == "nan":
            pairs = [("tokens", pairs[0][1]), ("ner_tags", "[NaN]" if length == 1 else tags_json)]
            if length != 1:
                pairs.append(("score", "NaN"))  # not a field: JSON is still refused
        elif defect == "duplicate_key":
            pairs.append(("tokens", pairs[0][1]))
        elif defect == "lone_surrogate":
            pairs[0] = ("tokens", '["a\\udfff"' + ', "x"' * (length - 1) + "]")
        elif defect == "length_mismatch":
            pairs[1] = ("ner_tags", "[" + ", ".join(json.dumps("O") for _ in range(length + 1)) + "]")
        elif defect == "huge_id" and ids:
            pairs[1] = ("ner_tags", "[" + ", ".join(["9" * 5000] * length) + "]")
        elif defect == "huge_id":
            defect = broken = None
        record = json_record(rng, pairs)
        line, _ = w.add(record)
        if defect:
            bad_line = line
        expected.append({"tokens": tokens, "ner_tags": tags, "line": line, "tag_lines": [line] * length})
    kwargs = {"tag_names": list(TAGS)} if ids else {}
    return Case(name, ".jsonl", w.data(), "ner", kwargs, None if broken else expected, bad_line if broken else None)


# ---- CSV / TSV ----------------------------------------------------------------------------------------------------


def csv_field(rng: random.Random, value: str, sep: str) -> str:
    """``value`` as RFC 4180 writes it: quoted (quotes doubled) when it holds the delimiter, a quote or a line
    break, and sometimes when it does not."""
    if any(c in value for c in (sep, '"', "\r", "\n")) or rng.random() < 0.15:
        return '"' + value.replace('"', '""') + '"'
    return value


CSV_DEFECTS = (
    "extra_field", "missing_field", "duplicate_header", "blank_first_line", "open_quote", "empty_label", "bad_byte",
    "quote_then_text",
)  # fmt: skip


def csv_case(rng: random.Random, name: str, sep: str, broken: str | None) -> Case:
    """A CSV (``sep=","``) or TSV (``"\\t"``) file with a header, text and label columns and sometimes others."""
    w = FileWriter(rng)
    suffix = ".csv" if sep == "," else ".tsv"
    header = ["text", "label"] + (["id"] if rng.random() < 0.3 else [])
    rng.shuffle(header)
    if broken == "duplicate_header":
        header.append(rng.choice(header))
    bad_line = None
    if broken == "blank_first_line":
        w.add("")
        bad_line = 1
    first, _ = w.add(sep.join(csv_field(rng, name_, sep) for name_ in header))
    if broken == "duplicate_header":
        bad_line = first
    expected = []
    n = rng.randint(1, 8)
    target = n - 1 if broken == "open_quote" else rng.randrange(n)  # an open quote reads to the file's end
    for i in range(n):
        label = rng.choice(NUMBER_TEXTS[:11] + WORD_LABELS + ("01",))
        values = {"text": free_text(rng, long=rng.random() < 0.03), "label": label}
        values["id"] = str(rng.randint(0, 999))
        if rng.random() < 0.1:
            values["label"] = " " + values["label"] + " "  # kept as written: the recipes strip labels
        fields = [csv_field(rng, values[name_], sep) for name_ in header[: len(set(header))]]
        defect = broken if i == target and broken not in ("duplicate_header", "blank_first_line") else None
        if defect == "extra_field":
            fields.insert(rng.randrange(len(fields) + 1), token(rng, 0.0))
        elif defect == "missing_field":
            fields = fields[:-1]
        elif defect == "open_quote":
            fields[-1] = '"' + values[header[-1]].replace('"', '""')  # never closed: refused at the file's end
        elif defect == "empty_label":
            fields[header.index("label")] = rng.choice(["", " ", '""'])
        elif defect == "bad_byte":
            k = header.index("text")
            values["text"] = "plain" + BAD_BYTE_MARK
            fields[k] = values["text"]
        elif defect == "quote_then_text":
            k = header.index("text")
            fields[k] = '"Hi' + sep + '" she said'
        if broken == "duplicate_header":
            fields.append(fields[-1])
        record = sep.join(fields)
        line, last = w.add(record)
        if defect == "bad_byte":
            bad_line = line
        elif defect and defect != "open_quote":
            bad_line = last
        expected.append({"text": values["text"], "label": values["label"], "line": last})
        if rng.random() < 0.1 and not (defect == "open_quote"):
            w.add("")  # a blank line between rows is skipped
    if broken == "open_quote":
        bad_line = w.line - 1  # every line to the file's end is inside the open quote
        data = w.data(drop_last_end=False)
    else:
        data = w.data()
    kwargs = {"fields": ["text", "label"], "nonempty": ["label"]}
    return Case(name, suffix, data, "table", kwargs, None if broken else expected, bad_line)


# ---- Plain text ---------------------------------------------------------------------------------------------------


# The spaces that separate the words of plain text besides ASCII whitespace (category Zs, not a no-break space).
TEXT_SPACES = "\u3000\u2009\u1680\u205f\u2002\u2003"


def text_word(rng: random.Random) -> str:
    """A plain-text word: a token without the spaces that separate words (no-break spaces and line separators stay),
    or a CJK word, or a number grouped with a no-break space."""
    pick = rng.random()
    if pick < 0.15:
        return "".join(rng.choice(CJK) for _ in range(rng.randint(1, 3)))
    if pick < 0.25:
        return f"{rng.randint(1, 999)}{rng.choice(chr(0xA0) + chr(0x202F))}{rng.randint(0, 999):03d}"
    return "".join(c for c in token(rng) if c not in TEXT_SPACES) or "x"


def text_case(rng: random.Random, name: str, broken: str | None) -> Case:
    """Plain text, one sentence per line, words split at runs of ASCII whitespace and the Unicode spaces of
    :data:`TEXT_SPACES` (CJK text's ideographic space U+3000 among them)."""
    w = FileWriter(rng)
    expected = []
    n = rng.randint(2, 6)
    spaces = [" ", "  ", "\t", " \t"] + (
        ["\u3000", "\u3000\u3000", rng.choice(TEXT_SPACES)] * 2 if "cjk" in name else []
    )
    for i in range(n):
        if broken == "one_word_lines":
            words = [text_word(rng)]
        elif broken == "tagged_lines":
            words = [text_word(rng), rng.choice(TAGS)]
        else:
            words = [text_word(rng) for _ in range(rng.randint(1, 7))]
            if i == 0:  # two plain words (no byte-order mark to mistake): neither one word per line nor tagged
                words = ["".join(rng.choice(LOWER) for _ in range(3)) for _ in range(2)]
        text = "".join(word + rng.choice(spaces) for word in words).rstrip(" \t")
        if rng.random() < 0.2:
            text = rng.choice([" ", "\t", "\u3000"]) + text
        line, _ = w.add(text)
        expected.append({"tokens": words, "line": line})
        if rng.random() < 0.2:
            w.add(rng.choice(["", " ", "\xa0", "\u3000"]))  # whitespace alone is a blank line
    refused = {"one_word_lines": None, "tagged_lines": expected[0]["line"]}
    return Case(name, ".txt", w.data(), "text", {}, None if broken else expected, refused.get(broken))


# ---- The cases and their check ------------------------------------------------------------------------------------


def generate_cases(seed: int, count: int, broken_share: float = 0.4) -> list[Case]:
    """``count`` cases drawn with ``seed``: every format, about ``broken_share`` of them broken."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        kind = rng.choice(["conll", "conll", "json", "json_ner", "csv", "tsv", "text"])
        broken = rng.random() < broken_share
        name = f"seed{seed}-{i}-{kind}"
        if kind == "conll":
            layout = rng.choice(["1col", "2col", "4col", "tab", "tab4"])
            defects = ["space_in_token", "one_line_extra_column", "no_tag", "word_tag", "bad_byte", "too_wide"]
            if layout.startswith("tab"):
                defects.remove("one_line_extra_column")  # tabs allow any count of columns between
            defect = rng.choice(defects) if broken else None
            if layout == "1col" and defect in ("no_tag", "word_tag"):
                defect = "space_in_token"
            scheme = rng.choice([None, *SCHEMES]) if layout != "1col" else None
            cjk = "-cjk" if rng.random() < 0.2 else ""
            case_name = f"{name}-{layout}-{scheme}{cjk}-{defect}"
            if defect == "too_wide":
                cases.append(too_wide_case(rng, case_name))
            else:
                cases.append(conll_case(rng, case_name, layout, defect, scheme))
        elif kind == "json":
            defect = rng.choice(JSON_DEFECTS) if broken else None
            cases.append(json_table_case(rng, f"{name}-{defect}", defect))
        elif kind == "json_ner":
            defects = ["nan", "duplicate_key", "lone_surrogate", "length_mismatch", "huge_id"]
            defect = rng.choice(defects) if broken else None
            cases.append(json_ner_case(rng, f"{name}-{defect}", defect))
        elif kind in ("csv", "tsv"):
            defect = rng.choice(CSV_DEFECTS) if broken else None
            cases.append(csv_case(rng, f"{name}-{defect}", "," if kind == "csv" else "\t", defect))
        else:
            defect = rng.choice(["one_word_lines", "tagged_lines"]) if broken else None
            cjk = "-cjk" if rng.random() < 0.4 else ""
            cases.append(text_case(rng, f"{name}{cjk}-{defect}", defect))
    return cases


def read_case(case: Case, folder: Path) -> tuple[Path, list[dict]]:
    """Write the case's file in ``folder`` and read it with its reader (a DataError propagates)."""
    path = folder / f"{case.name}{case.suffix}"
    path.write_bytes(case.data)
    return path, READERS[case.reader](path, **case.kwargs)


def check_case(case: Case, folder: Path) -> str | None:
    """None when the reader reads the case's records (or refuses it at its line); else what went wrong."""
    try:
        path, records = read_case(case, folder)
    except DataError as err:
        if case.expected is not None:
            return f"{case.name}: refused a valid file: {err}"
        if err.line != case.refused_line:
            return f"{case.name}: refused at line {err.line}, expected line {case.refused_line}: {err}"
        if err.path is not None and Path(err.path).name != f"{case.name}{case.suffix}":
            return f"{case.name}: the error names {err.path}"
        if "\n" in str(err):
            return f"{case.name}: the error is more than one line: {err!r}"
        return None
    except Exception as err:  # a traceback for a data mistake is a failure of the reader
        return f"{case.name}: {type(err).__name__}: {err}"
    if case.expected is None:
        return f"{case.name}: read a broken file (expected a refusal at line {case.refused_line})"
    if records != case.expected:
        for k, (got, want) in enumerate(zip(records, case.expected)):
            if got != want:
                return f"{case.name}: record {k}: read {_short(got)}, expected {_short(want)}"
        return f"{case.name}: {len(records)} records, expected {len(case.expected)}"
    return None


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
