"""What the NER recipe scores and writes: each word's predicted tag or each sentence's predicted spans, the metrics
over every word / entity, and the prediction files (``test_predictions.txt``, ``test_predictions.jsonl``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nlp_tricks.data.schemes import convert_tags
from nlp_tricks.data.spans import spans_to_tags
from nlp_tricks.metrics.spans import span_f1, tag_f1

from common import own_rows, warn
from ner_data import NerEvalSet


def ner_word_predictions(eval_set: NerEvalSet, predictions: np.ndarray, label_ids: np.ndarray, id2label) -> list:
    """The predicted tag of every word of every sentence: a seen word's first sub-token's prediction, ``O`` for a
    word the model could not see.

    ``predictions`` / ``label_ids`` are the Trainer's ``(N, L)`` arrays (argmax ids, padded with -100 on either
    side); a sentence's labelled positions are its seen words' first sub-tokens, in order, so the alignment goes
    by word, whatever the padding side and whatever words tokenized to nothing.
    """
    out = []
    for i, ex in enumerate(eval_set.examples):
        positions = np.flatnonzero(np.asarray(label_ids[i]) != -100)
        seen = eval_set.seen_words[i]
        if len(positions) != len(seen):
            raise RuntimeError(f"sentence {i}: {len(positions)} labelled tokens for {len(seen)} seen words")
        tags = ["O"] * len(ex["tokens"])
        for word, position in zip(seen, positions):
            tags[word] = id2label[int(predictions[i][position])]
        out.append(tags)
    return out


def ner_compute_metrics(id2label: dict, eval_set: NerEvalSet, scheme: str = "iob2") -> Callable:
    """``compute_metrics`` for one split: exact-span entity P / R / F1 (micro and per type) and word accuracy over
    every word of every sentence (:func:`~nlp_tricks.metrics.spans.tag_f1`), the predictions written in the files'
    ``scheme`` against the gold tags as read (words the model could not see count as predicted ``O``): the numbers
    of ``test_predictions.txt``."""

    def compute_metrics(eval_pred):
        n = len(eval_set.examples)
        predictions, label_ids = own_rows(eval_pred.predictions, n), own_rows(eval_pred.label_ids, n)
        predicted = ner_word_predictions(eval_set, predictions, label_ids, id2label)
        return ner_scores([ex["ner_tags"] for ex in eval_set.examples], predicted, scheme)

    return compute_metrics


def ner_scores(gold: list[list[str]], predicted: list[list[str]], scheme: str | None = None) -> dict[str, float]:
    """The recipe's metrics of predicted against gold tags (with ``scheme``, the predictions written in it first):
    ``precision``, ``recall``, ``f1``, ``accuracy`` and per entity type (:func:`entity_scores`)."""
    if scheme is not None:
        predicted = [convert_tags(tags, scheme) for tags in predicted]
    scores = tag_f1(predicted, gold)
    return {**{key: float(scores[key]) for key in ("precision", "recall", "f1", "accuracy")}, **entity_scores(scores)}


def entity_scores(scores: dict) -> dict[str, float]:
    """Per entity type of a :func:`~nlp_tricks.metrics.spans.span_f1` (or ``tag_f1``) result: ``<TYPE>_precision``,
    ``_recall``, ``_f1`` and ``_number`` (its gold entities), flat floats as the Trainer logs metrics (``eval_PER_f1``
    in ``all_results.json``)."""
    return {
        f"{entity}_{name}": float(values[name])
        for entity, values in scores.items()
        if isinstance(values, dict)
        for name in ("precision", "recall", "f1", "number")
    }


def write_predictions(path: Path, eval_set: NerEvalSet, word_tags: list[list[str]], scheme: str = "iob2") -> None:
    """One ``token<TAB>gold<TAB>predicted`` line per word of every sentence, a blank line between sentences: the
    gold tags as read, the predictions the metrics scored written in ``scheme`` (the files'; a word the model could
    not see: ``O``)."""
    lines = []
    for ex, predicted in zip(eval_set.examples, word_tags):
        predicted = convert_tags(predicted, scheme)
        lines += [f"{tok}\t{gold}\t{pred}" for tok, gold, pred in zip(ex["tokens"], ex["ner_tags"], predicted)]
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def span_word_predictions(eval_set: NerEvalSet, rows: np.ndarray, types: list[str]) -> list[list[tuple]]:
    """Each sentence's predicted entities ``(type, start, end exclusive)`` over its own words, from the Trainer's
    ``(N, K, 3)`` span rows over the seen words (-100 rows: padding)."""
    out = []
    for i, seen in enumerate(eval_set.seen_words):
        spans = {(types[t], seen[a], seen[b - 1] + 1) for t, a, b in np.asarray(rows[i]).tolist() if t >= 0}
        out.append(sorted(spans, key=lambda s: (s[1], s[2], s[0])))
    return out


def gold_spans(eval_set: NerEvalSet) -> list[list[tuple]]:
    return [[(e["type"], e["start"], e["end"]) for e in ex["entities"]] for ex in eval_set.examples]


def span_compute_metrics(types: list[str], eval_set: NerEvalSet) -> Callable:
    """``compute_metrics`` for one split: exact-span precision / recall / F1 (micro and per type) over every
    sentence, against the gold entities as read (entities beyond --max_seq_length count as missed)."""

    def compute_metrics(eval_pred):
        rows = own_rows(eval_pred.predictions, len(eval_set.seen_words))
        scores = span_f1(span_word_predictions(eval_set, rows, types), gold_spans(eval_set))
        return {**{key: float(scores[key]) for key in ("precision", "recall", "f1")}, **entity_scores(scores)}

    return compute_metrics


def write_span_predictions(
    out: Path,
    eval_set: NerEvalSet,
    predicted: list[list[tuple]],
    flat: bool,
    name: str = "test_predictions",
    scheme: str = "iob2",
) -> None:
    """``<name>.jsonl`` (``test_predictions.jsonl``): per sentence ``{"tokens", "entities": predicted,
    "gold_entities": gold}`` (a nested data file of the predictions); with ``flat`` also ``<name>.txt``
    (``token<TAB>gold<TAB>predicted`` tags per word in ``scheme``, as the tagging recipe writes), when the gold
    entities are flat too."""
    gold = gold_spans(eval_set)
    lines = []
    for ex, pred, ref in zip(eval_set.examples, predicted, gold):
        record = {"tokens": ex["tokens"], "entities": _entity_list(pred), "gold_entities": _entity_list(ref)}
        lines.append(json.dumps(record, ensure_ascii=False))
    (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    if not flat:
        return
    try:
        tags = [
            (ex["tokens"], *(spans_to_tags(spans, len(ex["tokens"]), scheme) for spans in (ref, pred)))
            for ex, pred, ref in zip(eval_set.examples, predicted, gold)
        ]
    except ValueError:
        warn(f"--span_flat true: the gold entities nest, so no {name}.txt (tags of one entity per word) is written")
        return
    blocks = ["\n".join(f"{t}\t{g}\t{p}" for t, g, p in zip(*sentence)) + "\n" for sentence in tags]
    (out / f"{name}.txt").write_text("\n".join(blocks), encoding="utf-8")


def _entity_list(spans) -> list[dict]:
    return [{"start": start, "end": end, "type": kind} for kind, start, end in spans]
