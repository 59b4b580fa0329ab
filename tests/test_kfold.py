"""`recipes/kfold.py` on tiny models: the files it writes and every number in them rescored from those files, the
out-of-fold coverage, the ensembling rules on the fold models' own outputs, the ensemble folder predicting through
the recipes, the pseudo-label leak rule, the student, resume and bad input.

The fast tests run each fold's recipe in this process (``run_here``: the recipe's own ``main``, as a subprocess job
would run it); the ``slow`` ones run ``python recipes/kfold.py`` with its subprocess jobs."""

import csv
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from recipe_helpers import ROOT, TEST_CONLL, TRAIN_CONLL, env, run_in_process, write_csv
from tiny import needs_crf_loading

import kfold
import sweep
from ablation import finished_record

CLS_TRAIN = [
    ("the cat sat on the mat", "animal"),
    ("john works at google", "work"),
    ("the dog ran", "animal"),
    ("mary works at acme in paris", "work"),
    ("a cat ran in london", "animal"),
    ("john works", "work"),
    ("a dog sat", "animal"),
    ("mary works at google", "work"),
    ("the cat ran on the mat", "animal"),
    ("john works in paris", "work"),
    ("the dog sat in new york", "animal"),
]
CLS_TEST = [("the dog sat on the mat", "animal"), ("mary works at acme", "work"), ("a cat", "animal")]
NER_TRAIN = TRAIN_CONLL + "\nMary B-PER\nsat O\n\nthe O\ndog O\nran O\n\nJohn B-PER\nran O\nin O\nLondon B-LOC\n"
RAW_TEXT = "the cat sat\njohn works at google\nmary ran in paris\n"

RAN: list[Path] = []


def run_here(job: kfold.FoldJob) -> dict:
    """A fold job run by the recipe's own ``main`` in this process; the record ``ablation.run_one`` writes (so a
    rerun skips a finished fold as the subprocess runner does)."""
    record = finished_record(job.run_dir, job.flags)
    if record is not None:
        return record
    job.run_dir.mkdir(parents=True, exist_ok=True)
    command = [job.script, "--output_dir", str(job.run_dir), "--overwrite_output_dir", "true", *job.flags]
    argv, sys.argv = sys.argv, command
    try:
        runpy.run_path(job.script, run_name="__main__")
    except SystemExit as exit_:
        assert not exit_.code, f"{job.run_dir}: exit {exit_.code}"
    finally:
        sys.argv = argv
    RAN.append(job.run_dir)
    results = json.loads((job.run_dir / "all_results.json").read_text())
    record = {"flags": job.flags, "run_dir": str(job.run_dir), "results": results, "wall_seconds": 0.0}
    (job.run_dir / "ablation_run.json").write_text(json.dumps(record))
    return record


def tiny_flags(model: str, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", model, "--max_steps", "2", "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--learning_rate", "1e-3", "--disable_tqdm", "true", "--seed", "0",
        "--save_strategy", "no", *extra,
    ]  # fmt: skip


def read_csv_rows(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def read_ids(path) -> list:
    return [json.loads(line)["id"] for line in Path(path).read_text().splitlines() if line.strip()]


def sklearn_scores(rows: list[dict], labels: list[str]) -> dict:
    from sklearn.metrics import accuracy_score, f1_score

    gold, pred = [r["label"] for r in rows], [r["predicted"] for r in rows]
    return {
        "accuracy": accuracy_score(gold, pred),
        "f1": f1_score(gold, pred, labels=labels, average="macro", zero_division=0),
    }


def seqeval_scores(path: Path) -> dict:
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    gold, pred, g, p = [], [], [], []
    for line in path.read_text().split("\n") + [""]:
        if not line.strip():
            if g:
                gold.append(g)
                pred.append(p)
            g, p = [], []
            continue
        _, tag, predicted = line.split("\t")
        g.append(tag)
        p.append(predicted)
    return {
        "f1": f1_score(gold, pred),
        "precision": precision_score(gold, pred),
        "recall": recall_score(gold, pred),
        "accuracy": accuracy_score(gold, pred),
    }


def check_oof_coverage(out: Path, folds: int) -> list[int]:
    """Every training example held out once, and never in the training file of the fold model that predicted it
    (the file that model's own run recorded as its training data)."""
    ids = read_ids(out / "data" / "train.jsonl")
    fold_of = json.loads((out / "folds.json").read_text())["fold_of_example"]
    assert set(fold_of) == set(range(folds)) and len(fold_of) == len(ids)
    held = {}
    for k in range(folds):
        heldout = read_ids(out / "data" / f"fold{k}_heldout.jsonl")
        assert heldout == [i for i in ids if fold_of[i] == k]
        trained_on = json.loads((out / f"fold{k}" / "all_results.json").read_text())["data_files"]["train"]
        assert not set(heldout) & set(read_ids(trained_on)), f"fold {k} trained on its held-out examples"
        held.update({i: k for i in heldout})
    assert sorted(held) == ids  # each example in exactly one held-out part
    return fold_of


def test_kfold_classification_files_numbers_and_ensemble_folder(tiny_model, tmp_path, monkeypatch):
    write_csv(tmp_path / "train.csv", CLS_TRAIN)
    write_csv(tmp_path / "test.csv", CLS_TEST)
    out = tmp_path / "kf"
    data = ["--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]
    argv = [
        "--recipe",
        "classification",
        "--folds",
        "2",
        "--output_dir",
        str(out),
        "--",
        *tiny_flags(tiny_model),
        *data,
    ]
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    fold_of = check_oof_coverage(out, 2)
    labels = [json.loads((out / "fold0" / "config.json").read_text())["id2label"][str(i)] for i in range(2)]
    assert labels == ["animal", "work"] == results["label_list"]

    # Stratified: each class spread over the folds to within one example.
    gold = [y for _, y in CLS_TRAIN]
    for label in labels:
        counts = [sum(1 for f, y in zip(fold_of, gold) if f == k and y == label) for k in range(2)]
        assert max(counts) - min(counts) <= 1

    # OOF: in training order, each row what the fold model that did not see it predicts for it alone (the recipe
    # predicting that fold's held-out file with that model).
    oof = read_csv_rows(out / "oof_predictions.csv")
    assert [(r["text"], r["label"]) for r in oof] == CLS_TRAIN
    for k in range(2):
        single = tmp_path / f"single{k}"
        heldout = out / "data" / f"fold{k}_heldout.jsonl"
        args = ["--model_name_or_path", str(out / f"fold{k}"), "--do_train", "false", "--output_dir", str(single),
                "--train_file", str(tmp_path / "train.csv"), "--test_file", str(heldout),
                "--per_device_eval_batch_size", "2"]  # fmt: skip
        assert run_in_process("classification", args, monkeypatch) == 0
        alone = [r["predicted"] for r in read_csv_rows(single / "test_predictions.csv")]
        assert alone == [r["predicted"] for r, f in zip(oof, fold_of) if f == k]

    # test_probabilities.npy: float32, a row per test example, columns in id2label order; the ensemble's is the
    # mean of the folds' and its argmax is the ensemble's predictions; each fold's argmax is its own predictions.
    folds = [np.load(out / f"fold{k}" / "test_probabilities.npy") for k in range(2)]
    ensemble = np.load(out / "test_probabilities.npy")
    assert ensemble.dtype == np.float32 and ensemble.shape == (3, 2)  # 3 test texts, 2 labels
    np.testing.assert_allclose(ensemble, (folds[0] + folds[1]) / 2, rtol=1e-6)  # float32 round-off
    test_rows = read_csv_rows(out / "test_predictions.csv")
    assert [r["predicted"] for r in test_rows] == [labels[j] for j in ensemble.argmax(axis=1)]
    assert [(r["text"], r["label"]) for r in test_rows] == CLS_TEST
    for k in range(2):
        fold_rows = read_csv_rows(out / f"fold{k}" / "test_predictions.csv")
        assert [r["predicted"] for r in fold_rows] == [labels[j] for j in folds[k].argmax(axis=1)]

    # Every number equals rescoring the written files (sklearn, not the recipe's metric).
    for key, value in sklearn_scores(oof, labels).items():
        assert results[f"oof_{key}"] == pytest.approx(value, abs=1e-12)
    for key, value in sklearn_scores(test_rows, labels).items():
        assert results[f"test_{key}"] == pytest.approx(value, abs=1e-12)
    per_fold = [sklearn_scores(read_csv_rows(out / f"fold{k}" / "test_predictions.csv"), labels) for k in range(2)]
    for key in ("accuracy", "f1"):
        assert results[f"fold_test_{key}"] == pytest.approx([s[key] for s in per_fold], abs=1e-12)
        assert results[f"fold_test_{key}_mean"] == pytest.approx(np.mean([s[key] for s in per_fold]), abs=1e-12)
        # and the fold runs' own numbers
        own = [json.loads((out / f"fold{k}" / "all_results.json").read_text())[f"test_{key}"] for k in range(2)]
        assert results[f"fold_test_{key}"] == pytest.approx(own, abs=1e-12)
    oof_probabilities = np.load(out / "oof_probabilities.npy")
    assert [r["predicted"] for r in oof] == [labels[j] for j in oof_probabilities.argmax(axis=1)]

    # The folder predicts like a model: the same predictions and probabilities through the recipe.
    predicted = tmp_path / "predicted"
    args = ["--model_name_or_path", str(out), "--do_train", "false", "--test_file", str(tmp_path / "test.csv"),
            "--output_dir", str(predicted), "--per_device_eval_batch_size", "2"]  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 0
    assert read_csv_rows(predicted / "test_predictions.csv") == test_rows
    np.testing.assert_array_equal(np.load(predicted / "test_probabilities.npy"), ensemble)
    again = json.loads((predicted / "all_results.json").read_text())
    assert again["test_f1"] == results["test_f1"] and again["ensemble"]["members"] == ["fold0", "fold1"]

    # Resume: a fold whose record is gone (an interrupted run) is the only one trained again.
    RAN.clear()
    (out / "fold1" / "ablation_run.json").unlink()
    assert kfold.main(argv, run=run_here) == 0
    assert RAN == [out / "fold1"]


def word_emissions(model_dir: Path, sentences: list[list[str]], crf: bool = True):
    """Each sentence's word emissions (first sub-token logits) and (``crf``) the CRF's scores of a saved fold model,
    computed here one sentence at a time with the model's own tokenizer."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from nlp_tricks.functional.crf import load_crf_model

    loader = load_crf_model if crf else AutoModelForTokenClassification.from_pretrained
    model = loader(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = []
    for words in sentences:
        encoding = tokenizer(words, is_split_into_words=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(**encoding).logits[0].numpy()
        first = {}
        for position, word in enumerate(encoding.word_ids()):
            if word is not None and word not in first:
                first[word] = position
        rows.append(np.stack([logits[first[w]] for w in range(len(words))]).astype(np.float64))
    if not crf:
        return rows, None
    start, transitions, end = (p.detach().double().numpy() for p in model.crf.potentials())
    return rows, (start, transitions, end)


def best_path(emissions, start, transitions, end) -> list[int]:
    """The highest-scoring tag path by enumerating all of them."""
    import itertools

    def score(path):
        s = start[path[0]] + end[path[-1]] + sum(emissions[t, y] for t, y in enumerate(path))
        return s + sum(transitions[a, b] for a, b in zip(path, path[1:]))

    return list(max(itertools.product(range(emissions.shape[1]), repeat=len(emissions)), key=score))


def ner_columns(path: Path) -> list[list[tuple[str, str, str]]]:
    sentences, current = [], []
    for line in path.read_text().split("\n") + [""]:
        if not line.strip():
            if current:
                sentences.append(current)
            current = []
        else:
            current.append(tuple(line.split("\t")))
    return sentences


@needs_crf_loading
def test_kfold_ner_crf_rule_vote_and_ensemble_folder(tiny_model, tmp_path, monkeypatch):
    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    out = tmp_path / "kf"
    data = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    argv = ["--recipe", "ner", "--folds", "3", "--output_dir", str(out), "--", *tiny_flags(tiny_model), *data]
    assert kfold.main(argv, run=run_here) == 0  # the recipe's default: a CRF
    results = json.loads((out / "all_results.json").read_text())
    check_oof_coverage(out, 3)
    assert json.loads((out / "fold0" / "config.json").read_text())["crf"] is True
    assert results["ensemble_rule"].startswith("CRF")
    labels = results["label_list"]

    # The ensemble's tags are the best path under the mean emissions and mean scores of the fold models, found by
    # enumerating every path (the fold models run here, one sentence at a time).
    test = ner_columns(out / "test_predictions.txt")
    sentences = [[word for word, _, _ in sentence] for sentence in test]
    members = [word_emissions(out / f"fold{k}", sentences) for k in range(3)]
    for i, sentence in enumerate(test):
        emissions = sum(m[0][i] for m in members) / 3
        start, transitions, end = (sum(m[1][j] for m in members) / 3 for j in range(3))
        assert [tag for _, _, tag in sentence] == [labels[y] for y in best_path(emissions, start, transitions, end)]

    # Every number equals rescoring the written files (seqeval itself).
    for prefix, path in (("oof", out / "oof_predictions.txt"), ("test", out / "test_predictions.txt")):
        for key, value in seqeval_scores(path).items():
            assert results[f"{prefix}_{key}"] == pytest.approx(value, abs=1e-12), (prefix, key)
    per_fold = [seqeval_scores(out / f"fold{k}" / "test_predictions.txt") for k in range(3)]
    assert results["fold_test_f1"] == pytest.approx([s["f1"] for s in per_fold], abs=1e-12)
    assert results["fold_test_f1_mean"] == pytest.approx(np.mean([s["f1"] for s in per_fold]), abs=1e-12)

    # The folder predicts like a model: ner.py with it writes the ensemble's predictions and scores.
    predicted = tmp_path / "predicted"
    args = ["--model_name_or_path", str(out), "--do_train", "false", "--test_file", str(tmp_path / "test.conll"),
            "--output_dir", str(predicted), "--per_device_eval_batch_size", "2"]  # fmt: skip
    assert run_in_process("ner", args, monkeypatch) == 0
    assert (predicted / "test_predictions.txt").read_text() == (out / "test_predictions.txt").read_text()
    assert json.loads((predicted / "all_results.json").read_text())["test_f1"] == results["test_f1"]

    # --ensemble_vote 0.6: the same folds (nothing retrained); an entity is kept when 2 of the 3 folds predict it.
    RAN.clear()
    vote_argv = [*argv[: argv.index("--")], "--ensemble_vote", "0.6", *argv[argv.index("--") :]]
    assert kfold.main(vote_argv, run=run_here) == 0
    assert RAN == []
    from seqeval.metrics.sequence_labeling import get_entities

    folds = [ner_columns(out / f"fold{k}" / "test_predictions.txt") for k in range(3)]
    for i, sentence in enumerate(ner_columns(out / "test_predictions.txt")):
        counts = {}
        for fold in folds:
            for span in set(get_entities([tag for _, _, tag in fold[i]])):
                counts[span] = counts.get(span, 0) + 1
        # (On these short sentences no two kept entities overlap; tests/test_ensemble.py covers overlaps.)
        assert get_entities([tag for _, _, tag in sentence]) == sorted(
            (s for s, c in counts.items() if c >= 2), key=lambda s: s[1]
        )
    assert json.loads((out / "all_results.json").read_text())["ensemble_rule"].startswith("entity vote")


# A BIOES file (E- / S- tags, as Chinese and Japanese corpora ship them), hand-written.
BIOES_TRAIN = "".join(
    "\n".join(f"{w}\t{t}" for w, t in zip(words.split(), tags.split())) + "\n\n"
    for words, tags in [
        ("John works at Acme .", "S-PER O O S-ORG O"),
        ("Mary ran in New York", "S-PER O O B-LOC E-LOC"),
        ("the cat sat on Paris", "O O O O S-LOC"),
        ("John Mary works at Google", "B-PER E-PER O O S-ORG"),
        ("a dog ran in London", "O O O O S-LOC"),
        ("Mary works at New York Acme", "S-PER O O B-ORG I-ORG E-ORG"),
    ]
)
BIOES_TEST = "Mary\tS-PER\nworks\tO\nat\tO\nNew\tB-ORG\nYork\tI-ORG\nAcme\tE-ORG\n\nthe\tO\ndog\tO\n"


@needs_crf_loading
def test_kfold_ner_on_a_bioes_file_writes_and_scores_its_scheme(tiny_model, tmp_path, monkeypatch):
    from nlp_tricks.data.schemes import convert_tags
    from nlp_tricks.metrics.spans import tag_f1

    (tmp_path / "train.conll").write_text(BIOES_TRAIN)
    (tmp_path / "test.conll").write_text(BIOES_TEST)
    out = tmp_path / "kf"
    data = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    argv = ["--recipe", "ner", "--folds", "2", "--output_dir", str(out), "--", *tiny_flags(tiny_model), *data]
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    check_oof_coverage(out, 2)
    assert results["label_list"] == ["B-LOC", "B-ORG", "B-PER", "I-LOC", "I-ORG", "I-PER", "O"]
    train_tags = [
        [t for _, t in (line.split("\t") for line in block.splitlines())]
        for block in BIOES_TRAIN.split("\n\n")
        if block
    ]
    test_tags = [["S-PER", "O", "O", "B-ORG", "I-ORG", "E-ORG"], ["O", "O"]]
    files = {
        "oof": (out / "oof_predictions.txt", train_tags),
        "test": (out / "test_predictions.txt", test_tags),
        **{f"fold{k}": (out / f"fold{k}" / "test_predictions.txt", test_tags) for k in range(2)},
    }
    for name, (path, gold) in files.items():
        rows = ner_columns(path)
        # Gold as the file has it, predictions written as BIOES (the folds read the runner's files as BIOES too).
        assert [[g for _, g, _ in sentence] for sentence in rows] == gold, name
        predicted = [[p for _, _, p in sentence] for sentence in rows]
        assert all(convert_tags(tags, "bioes") == tags for tags in predicted), (name, predicted)
        scores = tag_f1(predicted, gold)
        key = {"oof": "oof_f1", "test": "test_f1"}.get(name)
        if key:
            assert results[key] == pytest.approx(scores["f1"], abs=1e-12)
            assert results[key.replace("f1", "accuracy")] == pytest.approx(scores["accuracy"], abs=1e-12)
    assert results["fold_test_accuracy"] == [
        tag_f1(*_pred_gold(out / f"fold{k}" / "test_predictions.txt"))["accuracy"] for k in range(2)
    ]

    # The ensemble folder predicts a BIOES file as the runner did.
    predicted = tmp_path / "predicted"
    args = ["--model_name_or_path", str(out), "--do_train", "false", "--test_file", str(tmp_path / "test.conll"),
            "--output_dir", str(predicted), "--per_device_eval_batch_size", "2"]  # fmt: skip
    assert run_in_process("ner", args, monkeypatch) == 0
    assert (predicted / "test_predictions.txt").read_text() == (out / "test_predictions.txt").read_text()
    ensemble = json.loads((predicted / "all_results.json").read_text())
    assert {k: ensemble[k] for k in ("test_f1", "test_accuracy")} == {
        k: results[k] for k in ("test_f1", "test_accuracy")
    }


def _pred_gold(path: Path) -> tuple[list, list]:
    rows = ner_columns(path)
    return [[p for _, _, p in s] for s in rows], [[g for _, g, _ in s] for s in rows]


def test_kfold_ner_without_crf_averages_word_probabilities(tiny_model, tmp_path):
    """--crf false: per word, the mean of the fold models' softmax probabilities of its first sub-token (computed
    here from each saved model), argmax; the numbers rescored with seqeval."""
    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    out = tmp_path / "kf"
    flags = tiny_flags(tiny_model, "--crf", "false")
    argv = ["--recipe", "ner", "--folds", "2", "--output_dir", str(out), "--", *flags,
            "--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]  # fmt: skip
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert results["ensemble_rule"].startswith("mean of the folds' word probabilities")
    check_oof_coverage(out, 2)
    labels = results["label_list"]
    test = ner_columns(out / "test_predictions.txt")
    sentences = [[word for word, _, _ in sentence] for sentence in test]
    members = [word_emissions(out / f"fold{k}", sentences, crf=False)[0] for k in range(2)]
    for i, sentence in enumerate(test):
        probabilities = sum(np.exp(m[i]) / np.exp(m[i]).sum(axis=1, keepdims=True) for m in members) / 2
        assert [tag for _, _, tag in sentence] == [labels[j] for j in probabilities.argmax(axis=1)]
    for prefix, path in (("oof", out / "oof_predictions.txt"), ("test", out / "test_predictions.txt")):
        for key, value in seqeval_scores(path).items():
            assert results[f"{prefix}_{key}"] == pytest.approx(value, abs=1e-12), (prefix, key)


@needs_crf_loading
def test_kfold_pseudo_labels_leak_rule_and_student(tiny_model, tmp_path):
    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    (tmp_path / "raw.txt").write_text(RAW_TEXT)
    out = tmp_path / "kf"
    data = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    argv = ["--recipe", "ner", "--folds", "2", "--output_dir", str(out), "--unlabeled_file", str(tmp_path / "raw.txt"),
            "--distill", "true", "--", *tiny_flags(tiny_model), *data]  # fmt: skip
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert (out / "round0" / "kfold_ensemble.json").is_file() and results["rounds"][0]["round"] == 0
    check_oof_coverage(out, 2)
    unlabeled = [line.split() for line in RAW_TEXT.splitlines()]
    labels = results["label_list"]
    for k in range(2):
        heldout = set(read_ids(out / "data" / f"fold{k}_heldout.jsonl"))
        # Fold k of round 1 trained on its own training part plus pseudo-labels ...
        fold_run = json.loads((out / f"fold{k}" / "all_results.json").read_text())
        records = [json.loads(line) for line in Path(fold_run["data_files"]["train"]).read_text().splitlines()]
        assert not heldout & {r["id"] for r in records}
        pseudo = [r for r in records if str(r["id"]).startswith("unlabeled")]
        assert len(pseudo) == len(unlabeled)  # --confidence_threshold 0 keeps all
        # ... made by fold model k of round 0, which never saw fold k's held-out part: the teacher named in the
        # provenance file, its own run's training data, and its own CRF's Viterbi paths on the unlabelled text.
        provenance = json.loads((out / "data" / f"round1_fold{k}_pseudo_labels.json").read_text())
        teacher = out / provenance["teacher"]
        assert teacher == out / "round0" / f"fold{k}"
        teacher_train = json.loads((teacher / "all_results.json").read_text())["data_files"]["train"]
        assert not heldout & set(read_ids(teacher_train))
        emissions, scores = word_emissions(teacher, unlabeled)
        for record, rows in zip(pseudo, emissions):
            assert record["ner_tags"] == [labels[y] for y in best_path(rows, *scores)]
    # The student: one model on all the training data and the unlabelled text, without a CRF, scored on test.
    student = out / "student"
    assert (student / "model.safetensors").is_file()
    assert not json.loads((student / "config.json").read_text()).get("crf")
    student_results = json.loads((student / "all_results.json").read_text())
    assert student_results["train_samples"] == 6 + len(unlabeled)
    for key, value in seqeval_scores(student / "test_predictions.txt").items():
        assert results[f"student_test_{key}"] == pytest.approx(value, abs=1e-12)
    assert results["student_test_f1"] == student_results["test_f1"]


@pytest.mark.parametrize(
    "folds, message",
    [
        ("12", "11 examples for 12 folds; every fold needs at least one example"),
        ("6", "class 'work' has 5 examples, fewer than the 6 folds"),
    ],
)
def test_kfold_bad_input_is_one_line(tiny_model, tmp_path, capsys, folds, message):
    write_csv(tmp_path / "train.csv", CLS_TRAIN)
    write_csv(tmp_path / "test.csv", CLS_TEST)
    out = tmp_path / "kf"
    argv = ["--recipe", "classification", "--folds", folds, "--output_dir", str(out), "--", *tiny_flags(tiny_model),
            "--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]  # fmt: skip
    assert kfold.main(argv, run=run_here) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kfold:")]
    assert len(lines) == 1 and message in lines[0] and "train.csv" in lines[0] and f"--folds {folds}" in lines[0]
    assert not (out / "all_results.json").exists() and not (out / "fold0").exists()


def test_kfold_evidence_refuses_a_labelled_share_the_folds_cannot_cut_before_training(tiny_model, tmp_path, capsys):
    """The k-fold run's own refusal (a class with fewer examples than folds), said before the single model trains."""
    import kfold_evidence

    write_csv(tmp_path / "train.csv", CLS_TRAIN)
    write_csv(tmp_path / "test.csv", CLS_TEST)
    out = tmp_path / "ev"
    argv = ["--recipe", "classification", "--seeds", "1", "--folds", "5", "--unlabeled_fraction", "0.5",
            "--output_dir", str(out), "--", *tiny_flags(tiny_model), "--train_file", str(tmp_path / "train.csv"),
            "--test_file", str(tmp_path / "test.csv")]  # fmt: skip
    assert kfold_evidence.main(argv) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kfold_evidence:")]
    assert len(lines) == 1 and "train.csv" in lines[0] and "--folds 5" in lines[0], lines
    assert "fewer than the 5 folds" in lines[0] and "--unlabeled_fraction 0.5" in lines[0]
    assert not (out / "seed1").exists()


def test_kfold_refuses_flags_that_contradict_it(tmp_path, capsys):
    for recipe_flags, message in (
        (["--num_folds", "5"], "--num_folds after --"),
        (["--multi_label", "true"], "--multi_label"),
        (["--do_train", "false"], "every fold trains"),
    ):
        argv = ["--recipe", "classification", "--folds", "2", "--output_dir", str(tmp_path), "--", *recipe_flags]
        with pytest.raises(SystemExit) as exit_:
            kfold.main(argv, run=run_here)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_strip_flags_removes_the_runners_flags_and_their_values():
    flags = ["--train_file", "a.csv", "--max_steps", "2", "--tag_names", "O", "B-X", "--output_dir=o", "--seed", "3",
             "--overwrite_output_dir", "--learning_rate", "-1e-3"]  # fmt: skip
    kept = ["--max_steps", "2", "--seed", "3", "--learning_rate", "-1e-3"]
    assert kfold.strip_flags(flags, kfold.RUNNER_FLAGS) == kept


def test_fold_jobs_run_by_the_sweep_executor_each_on_its_own_gpu(tmp_path):
    """The k-fold runner's jobs through the executor it shares with the ablation (recipes/sweep.py), with its
    ``run`` hook (how tests run folds in this process): two GPUs, two folds at a time, never two on one GPU."""
    seen, running = [], set()

    def fake_run(job):
        gpu = job.env["CUDA_VISIBLE_DEVICES"]
        assert gpu not in running, "two jobs on one GPU at once"
        running.add(gpu)
        time.sleep(0.05)
        seen.append(gpu)
        running.discard(gpu)
        return {"wall_seconds": 0.0}

    jobs = [kfold.FoldJob(0, k, "x.py", tmp_path / f"f{k}", []) for k in range(6)]
    executor = sweep.LocalExecutor(gpus=["0", "1"], default_threads=kfold.share_of_cores, run=fake_run)
    assert executor.jobs == 2
    assert all(outcome.record for outcome in executor.run(jobs, tmp_path))
    assert sorted(set(seen)) == ["0", "1"]
    assert all(job.env is None for job in jobs)  # the plan itself is left as it was


@pytest.mark.slow
def test_kfold_subprocess_jobs_resume_after_a_kill(tiny_model, tmp_path):
    """The real runner: subprocess jobs. Killed after its first fold finished, a rerun trains only the other fold;
    the killed run left no results that look finished."""
    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    out = tmp_path / "kf"
    command = [sys.executable, str(ROOT / "recipes" / "kfold.py"), "--recipe", "ner", "--folds", "2", "--output_dir",
               str(out), "--", *tiny_flags(tiny_model, "--crf", "false"), "--train_file",
               str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    deadline = time.time() + 300
    while not (out / "fold0" / "ablation_run.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first fold finished"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "all_results.json").exists() and not (out / "kfold_ensemble.json").exists()
    first_fold = (out / "fold0" / "ablation_log.txt").stat().st_mtime_ns
    again = subprocess.run([*command[:2], "--jobs", "2", *command[2:]], cwd=ROOT, env=env(), capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    started = [line for line in again.stdout.splitlines() if line.startswith("[kfold] ") and "--output_dir" in line]
    assert len(started) == 1 and str(out / "fold1") in started[0]
    assert (out / "fold0" / "ablation_log.txt").stat().st_mtime_ns == first_fold
    results = json.loads((out / "all_results.json").read_text())
    for key, value in seqeval_scores(out / "oof_predictions.txt").items():
        assert results[f"oof_{key}"] == pytest.approx(value, abs=1e-12)
    assert len(results["fold_test_f1"]) == 2 and results["fold_train_seconds"][1] > 0


@pytest.mark.slow
def test_kfold_evidence_tiny_end_to_end(tiny_model, tmp_path):
    """`recipes/kfold_evidence.py`: every system per seed, each row's metric the mean of its test predictions
    rescored, the single model's difference from itself 0, the ensembles' members' means read back; a rerun trains
    nothing."""
    (tmp_path / "train.conll").write_text(NER_TRAIN + "\nMary B-PER\nworks O\nat O\nAcme B-ORG\n")
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    out = tmp_path / "ev"
    teacher = _token_classifier(tmp_path / "teacher", ["B-LOC", "B-ORG", "B-PER", "O"], chars=True)
    command = [sys.executable, str(ROOT / "recipes" / "kfold_evidence.py"), "--recipe", "ner", "--seeds", "1",
               "--folds", "2", "--full_fit_seeds", "2", "--teacher", str(teacher), "--jobs", "2", "--resamples", "200",
               "--output_dir", str(out), "--", *tiny_flags(tiny_model, "--crf", "false"), "--train_file",
               str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "kfold_evidence.json").read_text())
    systems = ["single", "ensemble", "full-fit seeds", "soup", "ensemble + rules", "student", "teacher's student"]
    assert [row["system"] for row in report["rows"]] == systems
    assert report["data"]["train"] == 7
    for row in report["rows"]:
        folders = [seed["folders"][row["system"]] for seed in report["seeds"]]
        f1s = [seqeval_scores(Path(folder) / "test_predictions.txt")["f1"] for folder in folders]
        assert row["metric"] == pytest.approx(np.mean(f1s), abs=1e-12)
        assert row["train_seconds"] > 0 and row["test_predict_seconds"] > 0, row["system"]
    assert report["rows"][0]["difference"]["value"] == 0.0
    kfold_results = json.loads((out / "seed1" / "kfold" / "all_results.json").read_text())
    ensemble = report["rows"][1]
    assert ensemble["minus_mean_member"] == pytest.approx(ensemble["metric"] - kfold_results["fold_test_f1_mean"])
    assert report["baseline"]["system"] == "trivial baseline: gazetteer"
    assert "| ensemble + rules |" in (out / "kfold_evidence.md").read_text()
    again = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0 and "[ablation] " not in again.stdout and "[kfold_evidence] " not in again.stdout


def _token_classifier(path: Path, labels: list[str], chars: bool) -> Path:
    """An untrained tiny BERT token classifier over ``labels`` with a WordLevel tokenizer of whole words or, with
    ``chars``, of single characters (every word splits into several sub-tokens)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForTokenClassification, PreTrainedTokenizerFast

    from recipe_helpers import WORDS

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = sorted({c for w in WORDS for c in w}) if chars else WORDS
    vocab = {tok: i for i, tok in enumerate(specials + pieces)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    split = [pre_tokenizers.Split(Regex("."), behavior="isolated")] if chars else []
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), *split])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(path)  # fmt: skip
    torch.manual_seed(1 if chars else 2)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={k: i for i, k in enumerate(labels)},
    )  # fmt: skip
    BertForTokenClassification(config).save_pretrained(path)
    return path


def test_ensemble_folder_of_models_with_different_tokenizers(tmp_path, monkeypatch):
    """NER members that cut words into different sub-tokens are averaged word by word (each word's first sub-token
    under each member's own tokenizer), through ner.py and a manifest naming them."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from ensemble_folder import write_manifest

    labels = ["B-LOC", "B-ORG", "B-PER", "O"]
    folder = tmp_path / "ensemble"
    _token_classifier(folder / "words", labels, chars=False)
    _token_classifier(folder / "chars", labels, chars=True)
    write_manifest(folder, "ner", ["words", "chars"], labels, None)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    out = tmp_path / "predicted"
    args = ["--model_name_or_path", str(folder), "--do_train", "false", "--test_file", str(tmp_path / "test.conll"),
            "--output_dir", str(out), "--per_device_eval_batch_size", "2"]  # fmt: skip
    assert run_in_process("ner", args, monkeypatch) == 0
    predicted = ner_columns(out / "test_predictions.txt")
    firsts = []
    probabilities = [0.0] * len(predicted)
    for member in ("words", "chars"):
        model = AutoModelForTokenClassification.from_pretrained(folder / member).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder / member)
        for i, sentence in enumerate(predicted):
            encoding = tokenizer([w for w, _, _ in sentence], is_split_into_words=True, return_tensors="pt")
            with torch.no_grad():
                logits = model(**encoding).logits[0].double()
            word_ids = encoding.word_ids()
            first = [word_ids.index(w) for w in range(len(sentence))]
            firsts.append(first)
            probabilities[i] = probabilities[i] + torch.softmax(logits[first], dim=-1).numpy() / 2
    assert firsts[0] != firsts[len(predicted)]  # the two tokenizers put the words' first sub-tokens elsewhere
    for sentence, p in zip(predicted, probabilities):
        assert [tag for _, _, tag in sentence] == [labels[j] for j in p.argmax(axis=1)]
    results = json.loads((out / "all_results.json").read_text())
    assert results["test_f1"] == pytest.approx(seqeval_scores(out / "test_predictions.txt")["f1"], abs=1e-12)
