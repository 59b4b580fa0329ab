"""Entities as spans: tags <-> spans, the nested JSON-lines reader, and the span heads' label rows and collator.

A span is ``(type, start, end)`` over a sentence's words with ``end`` EXCLUSIVE: ``("PER", 0, 2)`` is words 0 and 1;
a one-word entity at word ``i`` is ``(type, i, i + 1)``. Nested data is JSON lines, one sentence per line::

    {"tokens": ["The", "Bank", "of", "China"], "entities": [{"start": 1, "end": 4, "type": "ORG"},
                                                           {"start": 3, "end": 4, "type": "LOC"}]}

Flat data (CoNLL, or JSON lines with tags) is read as today and its tags turned into spans by :func:`tags_to_spans`,
the one rule of :mod:`nlp_tricks.data.schemes` for every tag scheme (IOB1, IOB2, BIOES, BMES, BILOU): conlleval's
lenient reading, the entities seqeval finds in its default mode. The label rows of
:mod:`nlp_tricks.functional.spans` are built by :func:`span_label_rows` and padded by :class:`SpanCollator`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from .readers import JSONL_SUFFIXES, DataError, _iter_lines, iter_jsonl, iter_ner_file
from .schemes import spans_to_tags, split_tag, tags_to_spans

__all__ = [
    "tags_to_spans",
    "spans_to_tags",
    "iter_span_file",
    "read_span_file",
    "is_nested_file",
    "check_entity_types",
    "first_sub_tokens",
    "span_label_rows",
    "SpanCollator",
]

# A span head label row that marks a word's first sub-token (the same value as nlp_tricks.functional.spans.WORD).
WORD = -1


# Tags <-> spans: ``tags_to_spans`` and ``spans_to_tags`` (IOB2 unless a scheme is named) are nlp_tricks.data.schemes'.


# ---- Reading ------------------------------------------------------------------------------------------------------


def is_nested_file(path: str | Path, entities_field: str = "entities") -> bool:
    """Whether ``path`` is a JSON-lines file of spans: its first record has an ``entities_field`` field."""
    if Path(path).suffix.lower() not in JSONL_SUFFIXES:
        return False
    for _, line in _iter_lines(path):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return False  # the tag reader reports it, with its line
            return isinstance(record, dict) and entities_field in record
    return False


def iter_span_file(
    path: str | Path,
    tokens_field: str = "tokens",
    tags_field: str = "ner_tags",
    tag_names: Sequence[str] | None = None,
    entities_field: str = "entities",
) -> Iterator[dict]:
    """Sentences as ``{"tokens", "entities": [{"type", "start", "end"}, ...], "line"}`` from a nested JSON-lines file
    (:func:`is_nested_file`) or a tagged one (CoNLL, JSON lines with tags: read by
    :func:`~nlp_tricks.data.readers.iter_ner_file`, tags turned into spans). Each sentence's entities are distinct,
    sorted by start, end and type. Bad input raises one :class:`DataError` naming the file, the line and the field.
    """
    if is_nested_file(path, entities_field):
        for record in iter_jsonl(path, [tokens_field, entities_field]):
            yield _nested_record(path, record, tokens_field, entities_field)
        return
    for ex in iter_ner_file(path, tokens_field, tags_field, tag_names):
        lines = ex.get("tag_lines") or [ex["line"]] * len(ex["ner_tags"])
        for tag, line in zip(ex["ner_tags"], lines):
            try:
                split_tag(tag)
            except ValueError as err:
                raise DataError(path, line, f"{err}; a span head reads entities from the tags") from None
        spans = tags_to_spans(ex["ner_tags"])
        yield {"tokens": ex["tokens"], "entities": _entity_dicts(spans), "line": ex["line"]}


def read_span_file(path: str | Path, **kwargs) -> list[dict]:
    """:func:`iter_span_file` as a list."""
    return list(iter_span_file(path, **kwargs))


def _entity_dicts(spans: Iterable[tuple[str, int, int]]) -> list[dict]:
    distinct = sorted(set(spans), key=lambda s: (s[1], s[2], s[0]))
    return [{"type": kind, "start": start, "end": end} for kind, start, end in distinct]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nested_record(path, record: dict, tokens_field: str, entities_field: str) -> dict:
    """One nested record checked: tokens a non-empty list of strings, every entity a span of them."""
    tokens, entities, line = record[tokens_field], record[entities_field], record["line"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(v, str) for v in tokens):
        raise DataError(path, line, f"field {tokens_field!r} must be a non-empty list of strings")
    if not isinstance(entities, list):
        raise DataError(path, line, f"field {entities_field!r} must be a list of {{'start', 'end', 'type'}} objects")
    spans = []
    for k, entity in enumerate(entities):
        where = f"field {entities_field!r}[{k}]"
        if not isinstance(entity, dict):
            raise DataError(path, line, f"{where} must be an object with 'start', 'end' and 'type'")
        for name in ("start", "end", "type"):
            if name not in entity:
                raise DataError(path, line, f"{where} has no field {name!r}; it has {sorted(entity)}")
        start, end, kind = entity["start"], entity["end"], entity["type"]
        for name, value in (("start", start), ("end", end)):
            if not _is_int(value):
                raise DataError(path, line, f"{where}.{name} must be an integer word index, got {value!r}")
        if not isinstance(kind, str) or not kind.strip():
            raise DataError(path, line, f"{where}.type must be a non-empty string, got {kind!r}")
        hint = "end is exclusive: a one-word entity at word i is start=i, end=i+1"
        if end < start:
            raise DataError(path, line, f"{where} is inverted: end {end} < start {start} ({hint})")
        if end == start:
            raise DataError(path, line, f"{where} is empty: start = end = {start} ({hint})")
        if start < 0 or end > len(tokens):
            raise DataError(
                path, line, f"{where} ({start}, {end}) is out of range: the sentence has {len(tokens)} tokens ({hint})"
            )
        spans.append((kind, start, end))
    return {"tokens": tokens, "entities": _entity_dicts(spans), "line": line}


def check_entity_types(
    examples: Iterable[dict], types: Sequence[str], source: str | Path, known_from: str | None = None
) -> None:
    """Refuse an entity type outside ``types`` (one :class:`DataError` naming its line): types the training data
    never has, or, with ``known_from`` (``"--entity_types"``, ``"the model's types"``), types it does not name."""
    known = set(types)
    for ex in examples:
        for entity in ex["entities"]:
            if entity["type"] not in known:
                why = "does not occur in the training data" if known_from is None else f"is not one of {known_from}"
                raise DataError(
                    source, ex.get("line"), f"entity type {entity['type']!r} {why} (types: {sorted(known)})"
                )


# ---- Label rows ---------------------------------------------------------------------------------------------------


def first_sub_tokens(word_ids: Sequence[int | None]) -> dict[int, int]:
    """``{word: position of its first sub-token}`` from a fast tokenizer's ``word_ids()``, in word order."""
    first: dict[int, int] = {}
    for position, word in enumerate(word_ids):
        if word is not None and word not in first:
            first[word] = position
    return first


def span_label_rows(
    word_positions: Sequence[int], spans: Iterable[tuple[int, int, int]], seen_words: Sequence[int] | None = None
) -> list[list[int]]:
    """The label rows of one sentence: ``(WORD, p, -1)`` per word (its first sub-token ``p``, in order), then
    ``(type id, start, end)`` per span over those words (``end`` exclusive).

    ``spans`` are over the sentence's own words; with ``seen_words`` (the words that have a sub-token within the
    truncated encoding, in order, as ``word_positions``) they are moved onto those, and a span whose first or last
    word the model cannot see is left out (it could not be trained on its true boundaries); without them a span
    outside the words raises ``ValueError``.
    """
    rows = [[WORD, int(p), -1] for p in word_positions]
    index = {word: k for k, word in enumerate(range(len(word_positions)) if seen_words is None else seen_words)}
    for kind, start, end in spans:
        if seen_words is None and not 0 <= start < end <= len(word_positions):
            raise ValueError(
                f"span ({kind}, {start}, {end}) is not within {len(word_positions)} words (end exclusive)"
            )
        if start in index and end - 1 in index:
            rows.append([int(kind), index[start], index[end - 1] + 1])
    return rows


class SpanCollator:
    """Pads a batch of tokenized sentences whose ``labels`` are span label rows (:func:`span_label_rows`): inputs
    with the tokenizer's ``pad``, rows to ``(B, N, 3)`` with -100; on a left-padding tokenizer the word positions
    move with the padding.

    Args:
        tokenizer: the tokenizer (its ``pad`` and ``padding_side``).
        pad_to_multiple_of (`int`, *optional*): as ``DataCollatorWithPadding``'s.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None):
        self.tokenizer = tokenizer
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict:
        import torch

        rows = [feature.get("labels") for feature in features]
        inputs = [{k: v for k, v in feature.items() if k != "labels"} for feature in features]
        batch = self.tokenizer.pad(
            inputs, padding=True, pad_to_multiple_of=self.pad_to_multiple_of, return_tensors="pt"
        )
        if any(r is None for r in rows):
            return dict(batch)
        rows = [torch.as_tensor(r, dtype=torch.long).view(-1, 3) for r in rows]
        labels = torch.full((len(rows), max([1, *map(len, rows)]), 3), -100, dtype=torch.long)
        length = batch["input_ids"].shape[1]
        for b, (row, feature) in enumerate(zip(rows, features)):
            row = row.clone()
            if self.tokenizer.padding_side == "left":
                row[row[:, 0] == WORD, 1] += length - len(feature["input_ids"])
            labels[b, : len(row)] = row
        batch = dict(batch)
        batch["labels"] = labels
        return batch
