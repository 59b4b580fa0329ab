"""Scores from the recipes' test-prediction files, per example, and paired bootstrap intervals between two systems.

Each task's predictions file is read back into one row of counts per example (a sentence, a text, a document), so
that a corpus metric is a function of summed rows: entity F1 from (true positives, predicted, gold) per sentence;
accuracy and macro-F1 from per-class counts per text; ROUGE-L as the mean of per-document F-measures. A paired
bootstrap resamples examples (the same resample for both systems) and recomputes the metric difference.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

PREDICTION_FILES = {
    "ner": "test_predictions.txt",
    "classification": "test_predictions.csv",
    "summarization": "test_predictions.jsonl",
}


# ---- Per-example rows -----------------------------------------------------------------------------------------------


def read_ner_predictions(path: str | Path) -> list[tuple[list[str], list[str]]]:
    """``[(gold tags, predicted tags)]`` per sentence of a ``token<TAB>gold<TAB>predicted`` file."""
    sentences, gold, pred = [], [], []
    for line in Path(path).read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            if gold:
                sentences.append((gold, pred))
            gold, pred = [], []
            continue
        fields = line.split("\t")
        gold.append(fields[-2])
        pred.append(fields[-1])
    if gold:
        sentences.append((gold, pred))
    return sentences


def ner_rows(path: str | Path) -> np.ndarray:
    """Per sentence: (entities right, entities predicted, gold entities, words right, words), seqeval's entities
    (the default mode: an I- tag after O opens an entity, as conlleval)."""
    from seqeval.metrics.sequence_labeling import get_entities

    rows = []
    for gold, pred in read_ner_predictions(path):
        gold_entities, pred_entities = set(get_entities(gold)), set(get_entities(pred))
        right_words = sum(g == p for g, p in zip(gold, pred))
        rows.append(
            (len(gold_entities & pred_entities), len(pred_entities), len(gold_entities), right_words, len(gold))
        )
    return np.array(rows, dtype=np.float64).reshape(-1, 5)


def classification_rows(path: str | Path, labels: list[str] | None = None) -> tuple[np.ndarray, list[str]]:
    """Per text: 1 if right, then per class (predicted as it and right, predicted as it, gold is it)."""
    with Path(path).open(encoding="utf-8", newline="") as f:
        records = [(r["label"], r["predicted"]) for r in csv.DictReader(f)]
    labels = labels or sorted({g for g, _ in records} | {p for _, p in records})
    index = {label: i for i, label in enumerate(labels)}
    rows = np.zeros((len(records), 1 + 3 * len(labels)))
    for n, (gold, pred) in enumerate(records):
        rows[n, 0] = gold == pred
        rows[n, 1 + 3 * index[pred]] += gold == pred
        rows[n, 2 + 3 * index[pred]] += 1
        rows[n, 3 + 3 * index[gold]] += 1
    return rows, labels


def summarization_rows(path: str | Path) -> np.ndarray:
    """Per document: ROUGE-1, ROUGE-2 and ROUGE-L F-measures (rouge_score with stemming, as the recipe's metric)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            scores = scorer.score(record["reference"], record["prediction"])
            rows.append([scores[k].fmeasure for k in ("rouge1", "rouge2", "rougeL")])
    return np.array(rows, dtype=np.float64).reshape(-1, 3)


def example_rows(task: str, run_dir: str | Path, labels: list[str] | None = None) -> np.ndarray:
    """The per-example rows of the predictions file a recipe (or a baseline) wrote in ``run_dir``."""
    path = Path(run_dir) / PREDICTION_FILES[task]
    if task == "ner":
        return ner_rows(path)
    if task == "classification":
        return classification_rows(path, labels)[0]
    return summarization_rows(path)


# ---- Corpus metrics from summed rows --------------------------------------------------------------------------------


def metric(task: str, name: str, totals: np.ndarray, count: int) -> float:
    """The corpus metric ``name`` from rows summed over ``count`` examples (see the row layouts above)."""
    if task == "ner":
        right, predicted, gold, right_words, words = totals
        if name == "f1":
            return 2 * right / (predicted + gold) if predicted + gold else 0.0
        if name == "precision":
            return right / predicted if predicted else 0.0
        if name == "recall":
            return right / gold if gold else 0.0
        if name == "accuracy":
            return right_words / words if words else 0.0
    elif task == "classification":
        if name == "accuracy":
            return totals[0] / count if count else 0.0
        if name == "f1":  # macro over the classes
            per_class = totals[1:].reshape(-1, 3)
            right, predicted, gold = per_class[:, 0], per_class[:, 1], per_class[:, 2]
            denominator = predicted + gold
            f1 = np.divide(2 * right, denominator, out=np.zeros_like(right), where=denominator > 0)
            return float(f1.mean())
    elif task == "summarization":
        columns = {"rouge1": 0, "rouge2": 1, "rougeL": 2}
        if name in columns:
            return totals[columns[name]] / count if count else 0.0
    raise ValueError(f"metric {name!r} is not defined for task {task!r}")


def corpus_metric(task: str, name: str, rows: np.ndarray) -> float:
    return float(metric(task, name, rows.sum(axis=0), len(rows)))


def paired_bootstrap(
    task: str, name: str, rows_a: np.ndarray, rows_b: np.ndarray, resamples: int = 1000, seed: int = 0
) -> tuple[float, float, float]:
    """``(difference, low, high)``: metric(b) - metric(a) on all examples, and the 2.5% / 97.5% percentiles of that
    difference over ``resamples`` resamples of the examples with replacement, the same resample for both systems
    (Koehn 2004; Efron & Tibshirani 1993). ``rows_a[i]`` and ``rows_b[i]`` must describe the same example."""
    if rows_a.shape[0] != rows_b.shape[0]:
        raise ValueError(f"paired rows differ in length: {rows_a.shape[0]} vs {rows_b.shape[0]} examples")
    n = rows_a.shape[0]
    difference = corpus_metric(task, name, rows_b) - corpus_metric(task, name, rows_a)
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    for r in range(resamples):
        counts = np.bincount(rng.integers(0, n, n), minlength=n)  # how often each example is drawn
        diffs[r] = metric(task, name, counts @ rows_b, n) - metric(task, name, counts @ rows_a, n)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return difference, float(low), float(high)
