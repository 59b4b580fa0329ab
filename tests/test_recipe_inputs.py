"""The inputs users have: TSV files, sentence pairs, multi-label classification, per-entity NER scores.

Each recipe runs in process on the tiny BERT (`tiny_model`); the numbers in all_results.json are recomputed from the
written predictions with scikit-learn / seqeval, and the model's behaviour (pairs, sigmoid + BCE) from the saved model.
"""

import csv
import json

import pytest
import torch
import transformers

from recipe_helpers import TEST_CONLL, TRAIN_CONLL, run_in_process, tiny_args

PAIRS = [
    ("john works at acme", "john works", "yes"),
    ("the cat sat on the mat", "a dog ran", "no"),
    ("mary works at google", "mary works", "yes"),
    ("the dog ran in paris", "john sat", "no"),
    ("a cat sat", "a cat sat", "yes"),
    ("john ran in london", "the mat", "no"),
]


def write_tsv(path, header, rows):
    """A TSV written the way `csv.writer(dialect="excel-tab")` (and pandas) write it: quoted only where needed."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, dialect="excel-tab")
        writer.writerow(header)
        writer.writerows(rows)


def read_predictions(path):
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def last_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


# ---- TSV ----------------------------------------------------------------------------------------------------------


def test_classification_reads_tsv(tiny_model, tmp_path, monkeypatch):
    rows = [
        ("the cat sat on the mat", "animal"),
        ("john works at google", "work"),
        ('the dog said "ran"', "animal"),  # a quote inside a value is a character
        ("mary works at acme,\tin paris", "work"),  # a tab inside a value is quoted by the writer
        ("a cat ran in london", "animal"),
        ("john works", "work"),
    ]
    write_tsv(tmp_path / "train.tsv", ["text", "label"], rows)
    write_tsv(tmp_path / "test.tsv", ["text", "label"], rows[2:4])
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.tsv"), "--test_file", str(tmp_path / "test.tsv")]
    assert run_in_process("classification", tiny_args(tiny_model, out, *files), monkeypatch) == 0
    written = read_predictions(out / "test_predictions.csv")
    assert [(r["text"], r["label"]) for r in written] == rows[2:4]
    assert "test_f1" in json.loads((out / "all_results.json").read_text())


def test_summarization_reads_tsv(tiny_model, tmp_path, monkeypatch):
    rows = [(f"john works at acme in {c} .", f"john in {c}") for c in ["paris", "london"] * 4]
    write_tsv(tmp_path / "train.tsv", ["document", "abstract"], rows)
    write_tsv(tmp_path / "test.tsv", ["document", "abstract"], rows[:2])
    out = tmp_path / "out"
    args = tiny_args(
        tiny_model, out, "--train_file", str(tmp_path / "train.tsv"), "--test_file", str(tmp_path / "test.tsv"),
        "--text_column", "document", "--summary_column", "abstract", "--generation_max_length", "4",
    )  # fmt: skip
    assert run_in_process("summarization", args, monkeypatch) == 0
    lines = (out / "test_predictions.jsonl").read_text().splitlines()
    assert [json.loads(line)["reference"] for line in lines] == [summary for _, summary in rows[:2]]


@pytest.mark.parametrize(
    "body, line, message",
    [
        ('"Hi," she said\tanimal\n', 3, "not valid TSV"),  # a quote opening a value must close it
        ("a cat\n", 3, "row has no value for column 'label'"),
    ],
)
def test_bad_tsv_is_one_line_naming_file_and_line(tiny_model, tmp_path, monkeypatch, capsys, body, line, message):
    path = tmp_path / "train.tsv"
    path.write_text("text\tlabel\nthe cat sat\tanimal\n" + body + "john works\twork\n", encoding="utf-8")
    out = tmp_path / "out"
    assert run_in_process("classification", tiny_args(tiny_model, out, "--train_file", str(path)), monkeypatch) == 1
    assert last_line(capsys).startswith(f"{path}:{line}: {message}")
    assert not (out / "all_results.json").exists()


# ---- Sentence pairs -----------------------------------------------------------------------------------------------


def test_sentence_pairs_train_as_pairs(tiny_model, tmp_path, monkeypatch):
    with (tmp_path / "train.csv").open("w", newline="") as f:
        csv.writer(f).writerows([("premise", "hypothesis", "label"), *PAIRS])
    batches = []
    collate = transformers.DataCollatorWithPadding.__call__

    def recording(self, features):
        batches.extend(features)
        return collate(self, features)

    monkeypatch.setattr(transformers.DataCollatorWithPadding, "__call__", recording)
    out = tmp_path / "out"
    args = tiny_args(
        tiny_model, out, "--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "train.csv"),
        "--text_column", "premise",
        "--text_pair_column", "hypothesis", "--max_steps", "3", "--per_device_train_batch_size", "2",
    )  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 0

    # The encoding of a pair written out: [CLS] premise [SEP] hypothesis [SEP], segment 1 from the hypothesis on.
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    expected = {}
    for premise, hypothesis, _ in PAIRS:
        a, b = [vocab[w] for w in premise.split()], [vocab[w] for w in hypothesis.split()]
        ids = (vocab["[CLS]"], *a, vocab["[SEP]"], *b, vocab["[SEP]"])
        expected[ids] = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    seen = [f for f in batches if tuple(f["input_ids"]) in expected]
    assert len(seen) == len(batches) > 0, "a batch example is not one of the pairs, encoded as a pair"
    for feature in seen:
        assert feature["token_type_ids"] == expected[tuple(feature["input_ids"])]
    # The predictions keep both texts.
    written = read_predictions(out / "test_predictions.csv")
    assert [(r["text"], r["text_pair"], r["label"]) for r in written] == PAIRS


# ---- Multi-label --------------------------------------------------------------------------------------------------

MULTI = [
    ("the cat sat on the mat", ["animal", "home"]),
    ("john works at google", ["work"]),
    ("the dog ran in paris", ["animal", "travel"]),
    ("mary works at acme in london", ["travel", "work"]),
    ("a cat ran", ["animal"]),
    ("john sat on the mat", ["home"]),
    ("the dog works", []),
    ("mary ran in new york", ["travel"]),
]


# Unseen combinations of the training texts' words: after 20 steps the model gets some labels right, not all.
MULTI_TEST = [
    ("a dog sat on the mat", ["animal", "home"]),
    ("mary works at google", ["work"]),
    ("john ran in london", ["travel"]),
    ("the cat works in paris", ["animal", "travel", "work"]),
]


def write_multi(tmp_path, fmt: str, delimiter: str) -> list[str]:
    """Train and test files (the four test texts are one eval batch) as JSON lines (lists) or CSV (delimited)."""
    paths = []
    for name, rows in (("train", MULTI), ("test", MULTI_TEST)):
        if fmt == "jsonl":
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(json.dumps({"text": t, "label": labels}) + "\n" for t, labels in rows))
        else:
            path = tmp_path / f"{name}.csv"
            with path.open("w", newline="") as f:
                csv.writer(f).writerows([("text", "label"), *((t, delimiter.join(ls)) for t, ls in rows)])
        paths.append(str(path))
    return ["--train_file", paths[0], "--test_file", paths[1]]


@pytest.mark.parametrize("fmt, delimiter", [("jsonl", ";"), ("csv", "|")])
def test_multi_label_metrics_are_sklearns_on_the_written_predictions(
    tiny_model, tmp_path, monkeypatch, fmt, delimiter
):
    from sklearn.metrics import accuracy_score, f1_score
    from sklearn.preprocessing import MultiLabelBinarizer
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "out"
    args = tiny_args(
        tiny_model, out, *write_multi(tmp_path, fmt, delimiter), "--multi_label", "true",
        "--label_delimiter", delimiter, "--threshold", "0.5", "--max_steps", "20", "--learning_rate", "1e-2",
        "--per_device_train_batch_size", "8",
    )  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    written = read_predictions(out / "test_predictions.csv")
    labels = ["animal", "home", "travel", "work"]  # every training label, sorted

    def sets(column):
        return [[label for label in row[column].split(delimiter) if label] for row in written]

    assert sets("label") == [ls for _, ls in MULTI_TEST]
    assert any(sets("predicted")), "no label predicted: the comparison below would be vacuous"
    binarize = MultiLabelBinarizer(classes=labels)
    gold, predicted = binarize.fit_transform(sets("label")), binarize.transform(sets("predicted"))
    assert results["test_f1"] == pytest.approx(f1_score(gold, predicted, average="macro", zero_division=0))
    assert results["test_micro_f1"] == pytest.approx(f1_score(gold, predicted, average="micro", zero_division=0))
    assert results["test_accuracy"] == pytest.approx(accuracy_score(gold, predicted))

    # The saved model scores each label with a sigmoid: the written sets are its probabilities above 0.5, and the
    # test loss is binary cross-entropy on them (the four test texts are one eval batch).
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.problem_type == "multi_label_classification"
    assert [model.config.id2label[i] for i in range(4)] == labels
    tokenizer = AutoTokenizer.from_pretrained(out)
    texts = [t for t, _ in MULTI_TEST]
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    assert (binarize.transform(sets("predicted")) == (torch.sigmoid(logits) > 0.5).numpy()).all()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(gold, dtype=torch.float32))
    # Tolerance: the Trainer pads the batch to a multiple of 8 and averages in float32.
    assert results["test_loss"] == pytest.approx(bce.item(), rel=1e-4)


def test_multi_label_delimiter_inside_a_listed_label_is_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    path = tmp_path / "train.jsonl"
    records = [{"text": "a cat", "label": ["animal"]}, {"text": "john", "label": ["work;home"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = tiny_args(tiny_model, tmp_path / "out", "--train_file", str(path), "--multi_label", "true")
    assert run_in_process("classification", args, monkeypatch) == 1
    assert last_line(capsys).startswith(f"{path}:2: label 'work;home' holds the --label_delimiter ';'")


# ---- NER: per entity type -----------------------------------------------------------------------------------------


def test_ner_per_entity_scores_are_seqevals_on_the_written_predictions(tiny_model, tmp_path, monkeypatch):
    from seqeval.metrics import classification_report

    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    (tmp_path / "test.conll").write_text(TRAIN_CONLL + "\n" + TEST_CONLL)
    out = tmp_path / "out"
    args = tiny_args(
        tiny_model, out, "--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll"),
        "--max_steps", "30", "--learning_rate", "1e-2", "--per_device_eval_batch_size", "8",
    )  # fmt: skip
    assert run_in_process("ner", args, monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    gold, predicted = [[]], [[]]
    for line in (out / "test_predictions.txt").read_text().splitlines():
        if not line.strip():
            gold.append([]), predicted.append([])
            continue
        _, g, p = line.split("\t")
        gold[-1].append(g), predicted[-1].append(p)
    gold, predicted = [s for s in gold if s], [s for s in predicted if s]
    report = classification_report(gold, predicted, output_dict=True, zero_division=0)
    types = sorted(k for k in report if not k.endswith(" avg"))
    assert {"PER", "LOC", "ORG"} <= set(types)
    for entity in types:
        assert results[f"test_{entity}_precision"] == pytest.approx(report[entity]["precision"])
        assert results[f"test_{entity}_recall"] == pytest.approx(report[entity]["recall"])
        assert results[f"test_{entity}_f1"] == pytest.approx(report[entity]["f1-score"])
        assert results[f"test_{entity}_number"] == report[entity]["support"]
    assert any(results[f"test_{entity}_f1"] > 0 for entity in types), "nothing learned: the check would be vacuous"
    assert results["test_f1"] == pytest.approx(report["micro avg"]["f1-score"])


# ---- --help -------------------------------------------------------------------------------------------------------


def test_help_documents_the_new_inputs(monkeypatch, capsys):
    assert run_in_process("classification", ["--help"], monkeypatch) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--text_pair_column", "--multi_label", "--label_delimiter", "--threshold"):
        assert flag in text
    assert "TSV (.tsv" in text and "tokenizer(text, text_pair)" in text
    assert run_in_process("summarization", ["--help"], monkeypatch) == 0
    assert "TSV (.tsv" in capsys.readouterr().out


def test_self_training_refuses_pairs_and_multi_label(capsys):
    from nlp_tricks import TricksArguments

    from common import parse_recipe_args
    from self_training import SelfTrainingArguments, SelfTrainingDataArguments, SelfTrainingModelArguments

    types = (SelfTrainingDataArguments, SelfTrainingArguments, SelfTrainingModelArguments, TricksArguments)
    for flags in (["--multi_label", "true"], ["--text_pair_column", "hypothesis"]):
        argv = ["--task", "classification", "--unlabeled_fraction", "0.5", *flags]
        with pytest.raises(SystemExit) as info:
            parse_recipe_args(types, "self_training", argv=argv)
        assert info.value.code == 2
        assert "are not supported by self-training" in capsys.readouterr().err
