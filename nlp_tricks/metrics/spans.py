"""Entity precision / recall / F1 over exact spans ``(type, start, end)``, nested entities allowed; of tag sequences
in any scheme (:func:`tag_f1`).

On flat entities it is seqeval's entity score (``classification_report``'s micro average) computed on the spans
instead of the tags: the same numbers, to the last bit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from ..data.schemes import tags_to_spans

__all__ = ["span_f1", "tag_f1"]


def span_f1(
    predictions: Sequence[Iterable[tuple[str, int, int]]], references: Sequence[Iterable[tuple[str, int, int]]]
) -> dict:
    """Micro-averaged and per-type precision, recall and F1 of predicted against gold spans, sentence by sentence.

    A predicted span counts when the same ``(type, start, end)`` is gold in the same sentence (each sentence's spans
    are a set, so nested spans and one span with two types count separately). Returns ``{"precision", "recall",
    "f1", "number"}`` (``number``: gold spans) and, per type found in either, ``{type: {"precision", "recall", "f1",
    "number"}}`` (seqeval's ``classification_report`` layout); a ratio with nothing to count is 0.
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predicted sentences for {len(references)} gold ones")
    hits, predicted, gold = Counter(), Counter(), Counter()
    for pred, ref in zip(predictions, references):
        pred, ref = set(map(tuple, pred)), set(map(tuple, ref))
        hits.update(span[0] for span in pred & ref)
        predicted.update(span[0] for span in pred)
        gold.update(span[0] for span in ref)
    scores = {kind: _scores(hits[kind], predicted[kind], gold[kind]) for kind in sorted(set(predicted) | set(gold))}
    scores.update(_scores(sum(hits.values()), sum(predicted.values()), sum(gold.values())))
    return scores


def _scores(hits: int, predicted: int, gold: int) -> dict:
    precision = hits / predicted if predicted else 0.0
    recall = hits / gold if gold else 0.0
    # seqeval's order of operations (2 * p * r / (p + r)), so flat scores equal its own bit for bit.
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "number": gold}


def tag_f1(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> dict:
    """:func:`span_f1` of tag sequences in any scheme (IOB1, IOB2, BIOES, BMES, BILOU), their entities read by the one
    rule of :mod:`nlp_tricks.data.schemes` (conlleval's lenient reading), and ``accuracy``: the share of words whose
    predicted tag is the gold one, as written. seqeval's numbers on the schemes seqeval reads."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predicted sentences for {len(references)} gold ones")
    right = words = 0
    for i, (pred, gold) in enumerate(zip(predictions, references)):
        if len(pred) != len(gold):
            raise ValueError(f"sentence {i}: {len(pred)} predicted tags for {len(gold)} gold ones")
        right += sum(p == g for p, g in zip(pred, gold))
        words += len(gold)
    scores = span_f1([tags_to_spans(p) for p in predictions], [tags_to_spans(g) for g in references])
    scores["accuracy"] = right / words if words else 0.0
    return scores
