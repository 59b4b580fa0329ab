"""Subset accuracy, macro-F1 and micro-F1 of multi-label predictions (0/1 per label), computed by scikit-learn."""

import datasets
import evaluate
import numpy as np
from sklearn.metrics import accuracy_score, f1_score

from nlp_tricks.metrics.scripts import SCIKIT_LEARN_CITATION, shipped_metric

_DESCRIPTION = """
Scores of multi-label classification, where every example has a set of labels given as a 0/1 indicator row (one
column per label): subset accuracy (the fraction of examples whose predicted set equals the true set exactly),
macro-F1 (the unweighted mean of the per-label F1 scores, so rare labels count as much as frequent ones) and micro-F1
(F1 of all (example, label) decisions pooled, dominated by frequent labels).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of predicted 0/1 rows (list of list of int), one column per label.
    references: list of true 0/1 rows of the same shape.
Returns:
    accuracy (subset accuracy), f1 (macro over every column), micro_f1.
Example:
    >>> metric = evaluate.load("nlp_tricks/metrics/multi_label_f1")
    >>> metric.compute(predictions=[[1, 0], [1, 1]], references=[[1, 0], [0, 1]])["accuracy"]
    0.5
"""


@shipped_metric(
    _DESCRIPTION,
    _KWARGS_DESCRIPTION,
    SCIKIT_LEARN_CITATION,
    datasets.Sequence(datasets.Value("int64")),
    ["https://scikit-learn.org/stable/modules/model_evaluation.html#multilabel-ranking-metrics"],
)
class MultiLabelF1(evaluate.Metric):
    def _compute(self, predictions, references):
        y_pred, y_true = np.asarray(predictions, dtype=np.int64), np.asarray(references, dtype=np.int64)
        return {
            "accuracy": float(accuracy_score(y_true, y_pred)),
            "f1": float(f1_score(y_true, y_pred, average="macro", zero_division=0)),
            "micro_f1": float(f1_score(y_true, y_pred, average="micro", zero_division=0)),
        }
