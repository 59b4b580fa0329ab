"""Scoring integrity: the numbers in all_results.json are the numbers of the written predictions against the data as
given (every word, every full reference), and an output folder never mixes two runs.

Each test runs a recipe in process on a tiny model and purpose-made files (long sentences, words that tokenize to
nothing, summaries longer than --max_target_length, numeric labels), then recomputes the metrics from the
predictions file and the gold file with the metric libraries themselves (seqeval, scikit-learn, rouge_score).
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

import pytest

from recipe_helpers import run_in_process, tiny_args

ZERO_WIDTH = "\u200b"  # a zero-width space: BERT's normalizer removes it, so the word has no sub-token
VARIATION_SELECTOR = "\ufe0f"  # emoji presentation selector: removed with the accents (Mn)


@pytest.fixture(scope="module")
def bert_normalizer_model(tiny_model, tmp_path_factory) -> str:
    """The tiny BERT with BERT's own normalizer (clean text, lowercase, strip accents), as the demo's MiniLM has."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_bert_normalizer")
    for file in Path(tiny_model).iterdir():
        shutil.copy(file, path / file.name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.save_pretrained(path)
    return str(path)


def conll(sentences: list[list[tuple[str, str]]]) -> str:
    return "\n\n".join("\n".join(f"{word}\t{tag}" for word, tag in sentence) for sentence in sentences) + "\n"


def read_gold_conll(path: Path) -> list[list[tuple[str, str]]]:
    """The test file as a person reads it: tab-separated word and tag, a blank line between sentences."""
    blocks = path.read_text(encoding="utf-8").strip("\n").split("\n\n")
    return [[tuple(line.split("\t")) for line in block.split("\n")] for block in blocks]


NER_TRAIN = [
    [("john", "B-PER"), ("works", "O"), ("at", "O"), ("acme", "B-ORG"), ("in", "O"), ("paris", "B-LOC")],
    [("mary", "B-PER"), ("ran", "O"), ("in", "O"), ("london", "B-LOC"), (".", "O")],
    [("the", "O"), ("dog", "O"), ("sat", "O"), ("on", "O"), ("the", "O"), ("mat", "O")],
    [("google", "B-ORG"), ("in", "O"), ("new", "B-LOC"), ("york", "I-LOC")],
]
LONG = "john works at acme in paris . the cat sat on the mat in london . mary ran in new york".split()
LONG_TAGS = ["B-PER", "O", "O", "B-ORG", "O", "B-LOC"] + ["O"] * 8 + ["B-LOC", "O", "B-PER", "O", "O", "B-LOC"]
NER_TEST = [
    list(zip(LONG, LONG_TAGS + ["I-LOC"])),  # 21 words: with --max_seq_length 16, words 15-21 are cut
    [
        ("john", "B-PER"),
        (ZERO_WIDTH, "O"),
        ("works", "O"),
        ("at", "O"),
        (VARIATION_SELECTOR, "O"),
        ("google", "B-ORG"),
    ],
    [("mary", "B-PER"), ("in", "O"), ("london", "B-LOC")],
]


def reference_word_tags(out: Path, sentences: list[list[str]], max_length: int) -> list[list[str]]:
    """The saved model's tag for every word, written out plainly: the argmax at the word's first sub-token, 'O' for a
    word it cannot see (cut by max_length, or no sub-token)."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    tags = []
    for words in sentences:
        enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_length, return_tensors="pt")
        with torch.no_grad():
            predicted = model(**enc).logits[0].argmax(-1).tolist()
        first = {}
        for position, word in enumerate(enc.word_ids()):
            if word is not None and word not in first:
                first[word] = position
        tags.append([model.config.id2label[predicted[first[w]]] if w in first else "O" for w in range(len(words))])
    return tags


def well_formed_iob2(tags: list[str]) -> list[str]:
    """The entities seqeval reads in ``tags`` written as IOB2: B- on each entity's first word, I- on the rest."""
    from seqeval.metrics.sequence_labeling import get_entities

    out = ["O"] * len(tags)
    for kind, first, last in get_entities(tags):
        out[first : last + 1] = [f"B-{kind}"] + [f"I-{kind}"] * (last - first)
    return out


def test_ner_metrics_are_those_of_the_predictions_file(bert_normalizer_model, tmp_path, monkeypatch, caplog):
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    (tmp_path / "train.conll").write_text(conll(NER_TRAIN), encoding="utf-8")
    (tmp_path / "test.conll").write_text(conll(NER_TEST), encoding="utf-8")
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    args = tiny_args(bert_normalizer_model, out, *files, "--max_seq_length", "16", "--max_steps", "1")
    with caplog.at_level(logging.WARNING, logger="nlp_tricks.recipes"):
        assert run_in_process("ner", [*args, "--learning_rate", "1e-5"], monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())

    # The predictions file holds every word of every sentence, with the gold tag as given.
    gold = read_gold_conll(tmp_path / "test.conll")
    blocks = (out / "test_predictions.txt").read_text(encoding="utf-8").strip("\n").split("\n\n")
    rows = [[line.split("\t") for line in block.split("\n")] for block in blocks]
    assert [[(r[0], r[1]) for r in sentence] for sentence in rows] == gold
    predicted = [[r[2] for r in sentence] for sentence in rows]

    # Each word carries the model's prediction for that word: no shift after the words without sub-tokens, and the
    # 7 words beyond 16 sub-tokens ([CLS] + 14 words + [SEP]) are 'O'. The file writes the entities of the argmax
    # tags (seqeval's reading: an I- after O opens one) as well-formed IOB2, the file's scheme.
    reference = reference_word_tags(out, [[w for w, _ in s] for s in gold], max_length=16)
    assert predicted == [well_formed_iob2(tags) for tags in reference]
    shifted = [t for w, t in zip(gold[1], reference[1]) if w[0] not in (ZERO_WIDTH, VARIATION_SELECTOR)]
    shifted += ["O"] * (len(gold[1]) - len(shifted))  # what a by-position file would hold
    assert shifted != reference[1], "the model predicts the same tag everywhere: the test could not see a shift"
    assert predicted[0][14:] == ["O"] * 7

    # all_results.json holds the scores of that file against the gold file, over all 30 words.
    gold_tags = [[t for _, t in s] for s in gold]
    assert results["test_precision"] == precision_score(gold_tags, predicted)
    assert results["test_recall"] == recall_score(gold_tags, predicted)
    assert results["test_f1"] == f1_score(gold_tags, predicted)
    assert results["test_accuracy"] == accuracy_score(gold_tags, predicted)
    assert results["test_truncated_words"] == 7 and results["test_words_without_tokens"] == 2
    assert results["data_files"]["test"] == str(tmp_path / "test.conll")
    assert results["label_list"] == ["B-LOC", "B-ORG", "B-PER", "I-LOC", "O"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "nlp_tricks.recipes"]
    assert "test: 7 of 30 words are beyond --max_seq_length 16 sub-tokens" in " ".join(warnings)
    assert "test: 2 of 30 words have no sub-token" in " ".join(warnings)


def test_classification_metrics_are_those_of_the_predictions_file(tiny_model, tmp_path, monkeypatch):
    from sklearn.metrics import accuracy_score, f1_score

    words = "the a cat dog sat ran on mat in paris london".split()
    # Integer labels 0..10: label i must be class i (as strings "10" would sort before "2").
    train = [(" ".join(words[: 2 + i % 5]), str(i)) for i in range(11)] * 2
    test = [("the cat sat on the mat in paris london the dog ran", "1"), ("a dog", "10"), ("the cat ran", "2")]
    for name, rows in (("train.csv", train), ("test.csv", test)):
        with (tmp_path / name).open("w", newline="") as f:
            csv.writer(f).writerows([("text", "label"), *rows])
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]
    assert (
        run_in_process("classification", tiny_args(tiny_model, out, *files, "--max_seq_length", "8"), monkeypatch) == 0
    )
    results = json.loads((out / "all_results.json").read_text())
    assert json.loads((out / "config.json").read_text())["id2label"] == {str(i): str(i) for i in range(11)}
    assert results["label_list"] == [str(i) for i in range(11)]

    with (tmp_path / "test.csv").open(newline="") as f:
        gold = [float(row["label"]) for row in csv.DictReader(f)]
    with (out / "test_predictions.csv").open(newline="") as f:
        written = list(csv.DictReader(f))
    assert [float(row["label"]) for row in written] == gold
    predicted = [float(row["predicted"]) for row in written]
    assert results["test_accuracy"] == pytest.approx(accuracy_score(gold, predicted), abs=1e-12)
    macro = f1_score(gold, predicted, average="macro", labels=[float(i) for i in range(11)], zero_division=0)
    assert results["test_f1"] == pytest.approx(macro, abs=1e-12)
    # The first test text has 12 words: 14 tokens with [CLS] and [SEP], cut to 8.
    assert results["test_truncated_examples"] == 1


def test_empty_label_is_refused(tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "train.csv").write_text("text,label\nthe cat,animal\nparis,\nthe dog,animal\n")
    out = tmp_path / "out"
    assert (
        run_in_process(
            "classification", tiny_args(tiny_model, out, "--train_file", str(tmp_path / "train.csv")), monkeypatch
        )
        == 1
    )
    assert capsys.readouterr().err == f"{tmp_path / 'train.csv'}:3: empty value in column 'label'\n"


def test_summarization_rouge_is_against_the_full_references(tiny_model, tmp_path, monkeypatch):
    from rouge_score import rouge_scorer
    from transformers import AutoTokenizer

    cities = ("paris", "london", "new york", "paris", "london", "acme", "google", "paris")
    train = [{"text": f"john works at acme in {c} .", "summary": f"john in {c}"} for c in cities]
    test = [
        {"text": "mary works at google in london .", "summary": "mary works at google in london , the cat sat ."},
        {"text": "john ran in paris .", "summary": "john ran in paris and then in london and new york ."},
    ]
    for name, records in (("train.jsonl", train), ("test.jsonl", test)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.jsonl"), "--test_file", str(tmp_path / "test.jsonl")]
    files += ["--validation_file", str(tmp_path / "test.jsonl")]
    extra = ["--max_target_length", "5", "--generation_max_length", "8", "--learning_rate", "1e-2"]
    assert run_in_process("summarization", tiny_args(tiny_model, out, *files, *extra), monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())

    gold = [json.loads(line)["summary"] for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    written = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    assert [w["reference"] for w in written] == gold
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)

    def mean_rouge(references):
        scores = [scorer.score(ref, w["prediction"]) for ref, w in zip(references, written)]
        return {key: sum(s[key].fmeasure for s in scores) / len(scores) for key in scores[0]}

    full = mean_rouge(gold)
    for key, value in full.items():
        assert results[f"test_{key}"] == pytest.approx(value, abs=1e-12), key
        assert results[f"eval_{key}"] == pytest.approx(value, abs=1e-12), key  # validation is the same file
    # The references cut to --max_target_length would score differently: the test can tell the two apart.
    tokenizer = AutoTokenizer.from_pretrained(out)
    cut = [
        tokenizer.decode(
            tokenizer(text_target=g, max_length=5, truncation=True)["input_ids"], skip_special_tokens=True
        )
        for g in gold
    ]
    assert mean_rouge(cut)["rouge1"] != full["rouge1"], "the predictions score the same against cut references"
    # [CLS] john in paris [SEP] fits 5 tokens; "john in new york" and both test summaries do not.
    assert results["test_truncated_summaries"] == 2 and results["train_truncated_summaries"] == 1


def test_output_dir_holding_results_is_refused_unless_overwritten(tiny_model, tmp_path, monkeypatch, capsys):
    names = ["O", "B-PER", "B-LOC", "I-LOC"]  # the Hub's ClassLabel names: tag id i is names[i]
    records = [
        {"tokens": ["john", "works", "in", "new", "york"], "ner_tags": [1, 0, 0, 2, 3]},
        {"tokens": ["mary", "ran", "in", "paris"], "ner_tags": [1, 0, 0, 2]},
        {"tokens": ["the", "cat", "sat"], "ner_tags": [0, 0, 0]},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    train = ["--train_file", str(tmp_path / "train.jsonl"), "--tag_names", ",".join(names)]
    first = tiny_args(tiny_model, out, *train, "--test_file", str(tmp_path / "train.jsonl"))
    assert run_in_process("ner", first, monkeypatch) == 0
    assert json.loads((out / "config.json").read_text())["id2label"] == {str(i): n for i, n in enumerate(names)}
    assert (out / "test_predictions.txt").is_file()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()

    # A second run into the same folder (now without a test file) stops before anything: one line, exit 1, the
    # first run's files intact.
    second = tiny_args(tiny_model, out, *train, "--validation_file", str(tmp_path / "train.jsonl"))
    assert run_in_process("ner", second, monkeypatch) == 1
    err = capsys.readouterr().err
    assert err == (
        f"{out}: holds the results of an earlier run (all_results.json, model.safetensors, test_predictions.txt, "
        "...); give --overwrite_output_dir to replace them, or another --output_dir\n"
    )
    assert "test_f1" in json.loads((out / "all_results.json").read_text())

    # --overwrite_output_dir: the earlier run's files go (no stale test_predictions.txt), the user's stay.
    assert run_in_process("ner", [*second, "--overwrite_output_dir", "true"], monkeypatch) == 0
    assert not (out / "test_predictions.txt").exists()
    assert "test_f1" not in json.loads((out / "all_results.json").read_text())
    assert (out / "notes.txt").read_text() == "mine"

    # Evaluating the saved model into its own folder would remove the model before loading it: refused even with
    # --overwrite_output_dir.
    again = tiny_args(str(out), out, *train, "--do_train", "false", "--overwrite_output_dir", "true")
    capsys.readouterr()
    assert run_in_process("ner", again, monkeypatch) == 1
    assert capsys.readouterr().err == (
        f"{out}: holds the model this run loads ({out}) and an earlier run's results; write this run to another "
        "--output_dir\n"
    )
    assert (out / "model.safetensors").is_file()
