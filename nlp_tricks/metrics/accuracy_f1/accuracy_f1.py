"""Accuracy and macro-averaged F1 of class predictions, computed by scikit-learn."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score, f1_score

from nlp_tricks.metrics.scripts import SCIKIT_LEARN_CITATION, shipped_metric

_DESCRIPTION = """
Accuracy (fraction of correct predictions) and macro-F1 (the unweighted mean of the per-class F1 scores, so rare
classes count as much as frequent ones) of single-label classification.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of predicted class ids (int).
    references: list of true class ids (int).
    labels: the class ids the macro average runs over (default: those in predictions or references).
Returns:
    accuracy, f1 (macro).
Example:
    >>> metric = evaluate.load("nlp_tricks/metrics/accuracy_f1")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])["accuracy"]
    0.6666666666666666
"""


@shipped_metric(
    _DESCRIPTION,
    _KWARGS_DESCRIPTION,
    SCIKIT_LEARN_CITATION,
    datasets.Value("int64"),
    ["https://scikit-learn.org/stable/modules/model_evaluation.html"],
)
class AccuracyF1(evaluate.Metric):
    def _compute(self, predictions, references, labels=None):
        return {
            "accuracy": float(accuracy_score(references, predictions)),
            "f1": float(f1_score(references, predictions, labels=labels, average="macro", zero_division=0)),
        }
