"""Decision rules fitted on out-of-fold predictions, in plain numpy: the step between a model's scores and its
predictions, tuned for the metric the task is scored with (the PII-detection 1st place's per-label thresholds; the
essay-scoring 2.0 1st place's thresholds fitted on out-of-fold predictions).

- :func:`fit_class_bias` / :func:`apply_class_bias`: a per-class additive bias on the log-probabilities, fitted for
  macro-F-beta; the prediction is ``argmax(log p + b)`` (a per-class threshold in the single-label case).
- :func:`fit_temperature` / :func:`apply_temperature`: temperature scaling (Guo et al. 2017), one ``T > 0`` fitted
  for the log loss: ``softmax(log p / T)``; the argmax is unchanged.
- :func:`coordinate_ascent`: the fit of any vector of per-class / per-type parameters over a grid (one coordinate at
  a time, the best value of each, until a pass changes nothing), for rules scored by the caller (NER entity
  F-beta of decoded tags or spans).
- Scores: :func:`macro_fbeta`, :func:`fbeta_from_counts`, :func:`negative_log_likelihood`,
  :func:`expected_calibration_error`.

Every fit takes arrays and gold labels only: what is fitted is what those arrays say, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = [
    "BIAS_GRID",
    "macro_fbeta",
    "fbeta_from_counts",
    "coordinate_ascent",
    "fit_class_bias",
    "apply_class_bias",
    "fit_temperature",
    "apply_temperature",
    "negative_log_likelihood",
    "expected_calibration_error",
]

# Values tried for each bias / threshold, in log-probability (or raw score) units.
BIAS_GRID = np.round(np.arange(-3.0, 3.0001, 0.25), 2)


def fbeta_from_counts(tp: float, fp: float, fn: float, beta: float = 1.0) -> float:
    """``(1 + b^2) tp / ((1 + b^2) tp + b^2 fn + fp)``; 0 when the denominator is 0."""
    b2 = beta * beta
    denominator = (1 + b2) * tp + b2 * fn + fp
    return float((1 + b2) * tp / denominator) if denominator > 0 else 0.0


def macro_fbeta(gold: np.ndarray, predicted: np.ndarray, num_classes: int, beta: float = 1.0) -> float:
    """The mean over all ``num_classes`` classes of each class's F-beta (a class never predicted nor gold: 0, as the
    recipes' macro-F1 over every training label)."""
    gold, predicted = np.asarray(gold), np.asarray(predicted)
    scores = []
    for c in range(num_classes):
        tp = float(np.sum((predicted == c) & (gold == c)))
        fp = float(np.sum((predicted == c) & (gold != c)))
        fn = float(np.sum((predicted != c) & (gold == c)))
        scores.append(fbeta_from_counts(tp, fp, fn, beta))
    return float(np.mean(scores))


def coordinate_ascent(
    score: Callable[[np.ndarray], float], size: int, grid: np.ndarray = BIAS_GRID, passes: int = 3
) -> tuple[np.ndarray, float]:
    """The parameter vector (``size`` values from ``grid``, starting at 0) that ``score`` rates highest, one
    coordinate at a time: each takes its best grid value with the others fixed; a tie keeps the current value,
    else takes the value nearest 0. Stops after a pass that changes nothing, or after ``passes``. Deterministic.

    Returns ``(parameters, score)``.
    """
    params = np.zeros(size, dtype=np.float64)
    best = float(score(params))
    for _ in range(passes):
        changed = False
        for j in range(size):
            current = params[j]
            for value in sorted(grid, key=lambda v: (abs(v), v)):
                if value == current:
                    continue
                trial = params.copy()
                trial[j] = value
                value_score = float(score(trial))
                if value_score > best:
                    best, params, changed = value_score, trial, True
        if not changed:
            break
    return params, best


def apply_class_bias(log_probs: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The class ids ``argmax(log_probs + bias)`` per row."""
    return np.argmax(np.asarray(log_probs, dtype=np.float64) + np.asarray(bias, dtype=np.float64), axis=-1)


def fit_class_bias(
    log_probs: np.ndarray, gold: np.ndarray, beta: float = 1.0, grid: np.ndarray = BIAS_GRID, passes: int = 3
) -> np.ndarray:
    """The per-class bias ``b`` (``(C,)``) that makes ``argmax(log_probs + b)`` score the highest macro-F-beta on
    these rows (:func:`coordinate_ascent` over ``grid``)."""
    log_probs = np.asarray(log_probs, dtype=np.float64)
    gold = np.asarray(gold)
    classes = log_probs.shape[-1]
    bias, _ = coordinate_ascent(
        lambda b: macro_fbeta(gold, apply_class_bias(log_probs, b), classes, beta), classes, grid, passes
    )
    return bias


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def apply_temperature(log_probs: np.ndarray, temperature: float) -> np.ndarray:
    """``softmax(log_probs / temperature)`` in float64."""
    return np.exp(_log_softmax(np.asarray(log_probs, dtype=np.float64) / float(temperature)))


def negative_log_likelihood(probs: np.ndarray, gold: np.ndarray) -> float:
    """The mean of ``-log p[gold]`` (probabilities clipped at 1e-15, as scikit-learn's ``log_loss``)."""
    probs = np.asarray(probs, dtype=np.float64)
    picked = probs[np.arange(len(probs)), np.asarray(gold)]
    return float(-np.mean(np.log(np.clip(picked, 1e-15, 1.0))))


def expected_calibration_error(probs: np.ndarray, gold: np.ndarray, bins: int = 15) -> float:
    """ECE with ``bins`` equal-width bins of the top probability: ``sum_b |accuracy_b - confidence_b| n_b / N``."""
    probs = np.asarray(probs, dtype=np.float64)
    confidence, predicted = probs.max(axis=-1), probs.argmax(axis=-1)
    right = (predicted == np.asarray(gold)).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(confidence, edges[1:-1], right=True), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            total += abs(right[mask].mean() - confidence[mask].mean()) * mask.sum()
    return float(total / max(len(probs), 1))


def fit_temperature(log_probs: np.ndarray, gold: np.ndarray, low: float = 0.05, high: float = 20.0) -> float:
    """The temperature ``T`` in ``[low, high]`` with the lowest log loss of ``softmax(log_probs / T)`` on these rows.

    The log loss is convex in ``1 / T`` (a log-sum-exp of linear functions minus a linear one), so a golden-section
    search over ``1 / T`` finds its minimum to 1e-6.
    """
    log_probs, gold = np.asarray(log_probs, dtype=np.float64), np.asarray(gold)

    def loss(inverse: float) -> float:
        return negative_log_likelihood(apply_temperature(log_probs, 1.0 / inverse), gold)

    a, b = 1.0 / high, 1.0 / low
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    loss_c, loss_d = loss(c), loss(d)
    while b - a > 1e-6:
        if loss_c <= loss_d:
            b, d, loss_d = d, c, loss_c
            c = b - ratio * (b - a)
            loss_c = loss(c)
        else:
            a, c, loss_c = c, d, loss_d
            d = a + ratio * (b - a)
            loss_d = loss(d)
    return float(2.0 / (a + b))
