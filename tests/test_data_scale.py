"""The recipes' data at scale: Arrow datasets cached by file content, truncation counted in one pass, streaming.

References are written out here: the truncation counts and word coverage are those of tokenizing every text whole
(what the recipes did before they tokenized in batches), the cached dataset is compared with the reader's list.
"""

from __future__ import annotations

import random

import pytest

from nlp_tricks.data import DataError, arrow_dataset, file_signature, iter_csv, read_csv
from recipe_helpers import WORDS, make_tiny_model, run_in_process


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A datasets cache of this test's own (arrow_dataset writes to HF_DATASETS_CACHE/nlp_tricks_data)."""
    import datasets

    folder = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def csv_features():
    from datasets import Features, Value

    return Features({"text": Value("string"), "label": Value("string"), "line": Value("int64")})


def test_arrow_dataset_is_the_readers_examples_and_a_rerun_reads_the_cache(tmp_path, cache):
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "".join(f"row {i},{i % 3}\n" for i in range(2500)), encoding="utf-8")
    calls = []

    def generate():
        calls.append(1)
        yield from iter_csv(path, ["text", "label"])

    first = arrow_dataset(generate, csv_features(), [file_signature(path)])
    assert first.to_list() == read_csv(path, ["text", "label"])  # batches of 1000: the last one is partial
    again = arrow_dataset(generate, csv_features(), [file_signature(path)])
    assert len(calls) == 1 and again.to_list() == first.to_list() and again._fingerprint == first._fingerprint
    # Another content (size and modification time change): read again.
    path.write_text("text,label\nonly,1\n", encoding="utf-8")
    changed = arrow_dataset(generate, csv_features(), [file_signature(path)])
    assert len(calls) == 2 and changed.to_list() == [{"text": "only", "label": "1", "line": 2}]


def test_a_bad_line_is_the_readers_error_and_leaves_no_cache(tmp_path, cache):
    path = tmp_path / "bad.csv"
    path.write_text("text,label\n" + "".join(f"row {i},x\n" for i in range(1500)) + "last,\n", encoding="utf-8")
    for _ in range(2):  # the second time too: nothing half-written was kept
        with pytest.raises(DataError, match=r"bad\.csv:1502: empty value in column 'label'"):
            arrow_dataset(lambda: iter_csv(path, ["text", "label"], nonempty=["label"]), csv_features(), ["k"])
    assert list((cache / "nlp_tricks_data").iterdir()) == []


def test_splits_of_a_file_are_the_lists_splits_in_files_of_their_own(tmp_path, cache):
    from nlp_tricks.data import kfold_examples, split_examples

    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "".join(f"row {i},{i % 3}\n" for i in range(3000)), encoding="utf-8")
    dataset = arrow_dataset(lambda: iter_csv(path, ["text", "label"]), csv_features(), [file_signature(path)])
    rows = read_csv(path, ["text", "label"])
    for seed in (0, 1):
        parts = split_examples(dataset, seed=seed)
        # The same rows in the same order as the list's split (and as select() of the same indices would give).
        assert [part.to_list() for part in parts] == [list(part) for part in split_examples(rows, seed=seed)]
        # Read front to back: no indices mapping, whose rows datasets gathers one at a time.
        assert all(part._indices is None for part in parts)
    folds = kfold_examples(dataset, 3, 1, seed=5)
    assert [part.to_list() for part in folds] == [list(part) for part in kfold_examples(rows, 3, 1, seed=5)]
    # A rerun reads the copies back (same fingerprints: the tokenizations of them find their cache).
    again = split_examples(dataset, seed=0)
    assert [part._fingerprint for part in again] == [part._fingerprint for part in split_examples(dataset, seed=0)]
    assert len(list((cache / "nlp_tricks_data").glob("*.arrow"))) == 1 + 3 * 2 + 3


def test_take_rows_is_select_written_in_batches(tmp_path, cache):
    from datasets import Dataset

    from nlp_tricks.data.arrow import take_rows

    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "".join(f"row {i},{i % 3}\n" for i in range(250)), encoding="utf-8")
    dataset = arrow_dataset(lambda: iter_csv(path, ["text", "label"]), csv_features(), [file_signature(path)])
    indices = random.Random(3).sample(range(250), 200) + [7, 7, 0, 249]  # out of order, repeated, both ends
    # batch_size 16 does not divide 204: several writes and a partial last one. The reference is datasets' own select.
    rows = take_rows(dataset, indices, batch_size=16)
    assert rows.to_list() == dataset.select(indices).to_list()
    assert rows._indices is None and rows.features == dataset.features
    assert take_rows(dataset, indices, batch_size=16)._fingerprint == rows._fingerprint
    assert take_rows(dataset, indices[:-1], batch_size=16)._fingerprint != rows._fingerprint
    assert len(list((cache / "nlp_tricks_data").glob("*.arrow"))) == 1 + 2  # no temporary file left
    assert not list((cache / "nlp_tricks_data").glob(".*.tmp"))
    # Where there is no file to copy from, or nothing to gain, the rows are select()'s.
    in_memory = Dataset.from_list(read_csv(path, ["text", "label"]))
    mapped = dataset.select(indices)
    for source, picks in ((in_memory, indices), (dataset, list(range(40, 90))), (mapped, [5, 1, 3])):
        assert take_rows(source, picks).to_list() == source.select(picks).to_list()
    assert take_rows(mapped, [5, 1, 3]).to_list() == [dataset[indices[j]] for j in (5, 1, 3)]


def test_classification_truncation_count_equals_tokenizing_every_text_whole(tokenizer, cache):
    import classification

    rng = random.Random(0)
    examples = [
        {"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14))), "label": rng.choice("ab")}
        for _ in range(300)
    ]
    pairs = [{**ex, "text_pair": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9)))} for ex in examples]
    label2id = {"a": 0, "b": 1}
    for rows in (examples, pairs):
        for max_length in (4, 8, 12, 30):
            dataset, count = classification.tokenize_and_count(rows, tokenizer, label2id, max_length)
            texts = [ex["text"] for ex in rows]
            second = [ex["text_pair"] for ex in rows] if "text_pair" in rows[0] else None
            whole = tokenizer(texts, second, truncation=False)["input_ids"]
            assert count == sum(len(ids) > max_length for ids in whole)
            assert (
                dataset["input_ids"][:]
                == tokenizer(texts, second, truncation=True, max_length=max_length)["input_ids"]
            )
            assert dataset["labels"][:] == [label2id[ex["label"]] for ex in rows]
            assert set(dataset.column_names) == {"input_ids", "token_type_ids", "attention_mask", "labels"}


def test_ner_word_coverage_equals_tokenizing_every_sentence_whole(tokenizer, cache):
    import ner

    rng = random.Random(1)
    words = [*WORDS, "new-york"]  # 3 sub-tokens of one word: the whitespace pre-tokenizer splits at "-"
    examples = [
        {"tokens": [rng.choice(words) for _ in range(rng.randint(1, 12))], "ner_tags": None} for _ in range(200)
    ]
    for ex in examples:
        ex["ner_tags"] = ["O"] * len(ex["tokens"])
    for max_length in (5, 9, 40):
        eval_set = ner.ner_eval_set(examples, tokenizer, {"O": 0}, max_length)
        seen_all, cut_all, empty_all = [], 0, 0
        for ex in examples:
            cut = tokenizer(ex["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
            full = tokenizer(ex["tokens"], is_split_into_words=True, truncation=False)
            seen, previous = [], None
            for word in cut.word_ids():
                if word is not None and word != previous:
                    seen.append(word)
                previous = word
            tokenized = {word for word in full.word_ids() if word is not None}
            seen_all.append(seen)
            cut_all += len(tokenized) - len(seen)
            empty_all += len(ex["tokens"]) - len(tokenized)
        assert eval_set.seen_words == seen_all
        assert (eval_set.cut_words, eval_set.empty_words) == (cut_all, empty_all)
        assert eval_set.num_words == sum(len(ex["tokens"]) for ex in examples)
        assert cut_all > 0 or max_length == 40


def test_summarization_long_text_flags_equal_whole_lengths(tokenizer):
    from summarization import long_text_flags

    rng = random.Random(2)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 20))) for _ in range(200)]
    for max_length in (3, 10, 25):
        for target in (False, True):
            inputs = {"text_target": texts} if target else {"text": texts}
            cut = tokenizer(**inputs, truncation=True, max_length=max_length)["input_ids"]
            whole = tokenizer(**inputs, truncation=False)["input_ids"]
            flags = long_text_flags(tokenizer, texts, cut, max_length, target=target)
            assert flags == [len(ids) > max_length for ids in whole]


def test_streamed_packing_is_the_list_packing(tokenizer):
    from nlp_tricks.data import iter_pack_documents, pack_documents

    rng = random.Random(3)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40))) for _ in range(120)]
    assert list(iter_pack_documents(iter(texts), tokenizer, 16, batch_size=7)) == pack_documents(texts, tokenizer, 16)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], "--streaming needs --max_steps N"),
        (["--max_steps", "2", "--train_file", "BAD"], "bad.txt:2: not valid UTF-8"),
    ],
)
def test_streaming_pretraining_refusals_are_one_line(tmp_path, cache, monkeypatch, capsys, extra, expected):
    (tmp_path / "bad.txt").write_bytes(b"one document\n\xff\n")
    (tmp_path / "good.txt").write_text("one document\nanother one\n", encoding="utf-8")
    args = ["--train_file", str(tmp_path / "good.txt"), "--validation_file", str(tmp_path / "good.txt")]
    args += [str(tmp_path / "bad.txt") if arg == "BAD" else arg for arg in extra]
    out = tmp_path / "out"
    status = run_in_process("pretraining", [*args, "--streaming", "true", "--output_dir", str(out)], monkeypatch)
    stderr = capsys.readouterr().err
    assert status == 1, stderr[-2000:]
    assert [line for line in stderr.splitlines() if expected in line], stderr[-2000:]
    assert not out.exists() or not any(out.iterdir())
