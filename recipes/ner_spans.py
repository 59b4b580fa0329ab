"""The NER recipe with ``--span_head``: span examples (nested files, or tags turned into spans), their tokenization
and length guard, the entity types, and a saved span model's settings and weights."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
from datasets import Dataset, Features, Sequence, Value
from transformers import AutoModelForTokenClassification

from nlp_tricks import TricksArguments
from nlp_tricks.data import DataError, iter_ner_file
from nlp_tricks.data.arrow import column_values, first_rows
from nlp_tricks.data.schemes import scan_examples
from nlp_tricks.data.spans import check_entity_types, is_nested_file, iter_span_file, span_label_rows, tags_to_spans
from nlp_tricks.functional.spans import load_span_model

from common import (
    ModelArguments,
    eval_splits,
    load_classifier,
    load_config_and_tokenizer,
    refusals_of_the_model,
    resolve_model_path,
)
from ner_data import (
    COVERAGE_COLUMNS,
    NerDataArguments,
    NerEvalSet,
    coverage_counts,
    encode_ner_batch,
    eval_set_of,
    load_sentence_splits,
    map_sentences,
    ner_truncation_record,
    prepare_ner_tokenizer,
    resolve_tag_scheme,
)

SPAN_FEATURES = Features(
    {
        "tokens": Sequence(Value("string")),
        "entities": [{"type": Value("string"), "start": Value("int64"), "end": Value("int64")}],
        "line": Value("int64"),
    }
)
# The span head settings a saved span model records in its config (the trick writes span_flat).
SAVED_SPAN_FIELDS = ("span_head", "span_head_size", "span_head_rope", "span_flat")


def saved_span_head(model_name_or_path: str | None) -> dict | None:
    """The span head settings of a local model folder saved with ``--span_head`` (its ``config.json``), or None."""
    config_file = Path(model_name_or_path) / "config.json" if model_name_or_path else None
    if config_file is None or not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("span_head") is None:
        return None
    return {name: config[name] for name in SAVED_SPAN_FIELDS if name in config}


class _OwnDefaults(dict):
    """A ``dependent_defaults`` table whose key is the defaults themselves (a tuple of ``(field, value)``)."""

    def get(self, key, default=None):
        return dict(key) if key else {}


def saved_span_defaults(*model_fields: str):
    """``dependent_defaults``: a model saved with ``--span_head`` sets the span flags it was trained with (head,
    size, rotary positions, flat decoding), unless given, so it predicts as it did at the end of training."""

    def key(namespace):
        for name in model_fields:
            saved = saved_span_head(getattr(namespace, name, None))
            if saved:
                return tuple(sorted(saved.items()))
        return None

    return key, _OwnDefaults()


def _span_example(example: dict) -> dict:
    """A tagged example (``tokens``, ``ner_tags``) as a span example (its ``line`` kept, if it has one)."""
    spans = sorted(set(tags_to_spans(example["ner_tags"])), key=lambda s: (s[1], s[2], s[0]))
    entities = [{"type": kind, "start": start, "end": end} for kind, start, end in spans]
    line = {"line": example["line"]} if "line" in example else {}
    return {"tokens": example["tokens"], "entities": entities, **line}


def check_no_span_files(data_args: NerDataArguments) -> None:
    """Without ``--span_head`` a nested JSON-lines file (``entities`` per sentence) cannot be read as tags: one
    line saying which flag reads it."""
    for path in (data_args.train_file, data_args.validation_file, data_args.test_file):
        if path and is_nested_file(path):
            raise DataError(
                path,
                None,
                "holds entities as spans ('entities' per sentence); read it with --span_head global_pointer (or "
                "efficient_global_pointer), or give tags ('ner_tags') for token tagging",
            )


def load_span_splits(data) -> dict[str, tuple[object, str]]:
    """:func:`load_ner_splits` for a span head: ``{split: (examples, source)}`` with ``entities`` per sentence, from
    nested JSON-lines files (``{"tokens", "entities": [{"start", "end", "type"}]}``, ``end`` exclusive) or tagged
    data (CoNLL, JSON lines with tags, the demo, the Hub), whose tags become spans."""
    return load_sentence_splits(data, "spans", iter_span_file, SPAN_FEATURES, _span_example)


def read_span_data(data_args: NerDataArguments, types: list[str] | None = None, known_from: str | None = None):
    """``(splits, types, train_examples, eval_examples)`` for a span head: :func:`read_data`'s counterpart. The
    entity types are ``types`` (a saved span model's, or ``--entity_types``: ``known_from`` names where they come
    from) or the training data's, sorted; a type of the data outside them is a ``file:line`` error."""
    splits = load_span_splits(data_args)
    resolve_span_scheme(data_args)
    train_source = splits["train"][1]
    if types is None:
        found = {
            e["type"]
            for entities in column_values(splits.get("all", splits["train"])[0], "entities")
            for e in entities
        }
        types = sorted(found)
        if not types:
            raise DataError(train_source, None, "no entity in the training data; a span head needs at least one type")
    for split in ("train", "validation", "test"):
        if split in splits:
            check_entity_types(splits[split][0], types, splits[split][1], known_from)
    train = first_rows(splits["train"][0], data_args.max_train_samples)
    return splits, types, train, eval_splits(splits, data_args.max_eval_samples)


def resolve_span_scheme(data_args: NerDataArguments) -> str:
    """The tag scheme of a span head's tagged files, resolved as token tagging resolves it (``--tag_scheme``, or
    detected in the first of them and said in one line; each checked, one ``file:line`` error at a tag it does not
    have): the scheme ``--span_flat`` writes ``test_predictions.txt`` in. Nested files, the demo and the Hub have
    no tags to read it from: ``--tag_scheme``, IOB2 under auto. ``data_args.tag_scheme`` becomes it."""
    files = {split: getattr(data_args, f"{split}_file") for split in ("train", "validation", "test")}
    tagged = {split: path for split, path in files.items() if path and not is_nested_file(path)}
    if not tagged:
        data_args.tag_scheme = "iob2" if data_args.tag_scheme == "auto" else data_args.tag_scheme
        return data_args.tag_scheme
    columns = (data_args.tokens_column, data_args.tags_column, data_args.tag_names)
    scans = {split: scan_examples(iter_ner_file(path, *columns)) for split, path in tagged.items()}
    return resolve_tag_scheme(scans, {split: (None, path) for split, path in tagged.items()}, data_args)


def encode_span_batch(batch: dict, tokenizer, type2id: dict, max_seq_length: int) -> dict:
    """One ``map`` batch: :func:`encode_ner_batch`'s encodings and word coverage, with span label rows
    (:func:`nlp_tricks.data.spans.span_label_rows`) as ``labels``: each seen word's first sub-token, then each
    entity whose first and last words are seen."""
    tags = [["O"] * len(words) for words in batch["tokens"]]
    encoded = encode_ner_batch(
        {"tokens": batch["tokens"], "ner_tags": tags}, tokenizer, {"O": 0}, max_seq_length, False
    )
    rows = []
    for word_labels, seen, entities in zip(encoded["labels"], encoded["seen_words"], batch["entities"]):
        positions = [p for p, label in enumerate(word_labels) if label != -100]
        spans = [(type2id[e["type"]], e["start"], e["end"]) for e in entities]
        rows.append(span_label_rows(positions, spans, seen))
    encoded["labels"] = rows
    return encoded


def _tokenize_spans(examples, tokenizer, types: list[str], data_args: NerDataArguments) -> Dataset:
    """Span examples tokenized by :func:`encode_span_batch`, with each sentence's word coverage columns."""
    options = {"type2id": {kind: i for i, kind in enumerate(types)}, "max_seq_length": data_args.max_seq_length}
    return map_sentences(examples, encode_span_batch, {"tokenizer": tokenizer, **options}, data_args)


def span_eval_set(examples, tokenizer, types: list[str], data_args: NerDataArguments) -> tuple[NerEvalSet, int]:
    """``(eval set, most words)``: a split of span examples tokenized for prediction and scoring, and the most seen
    words of one of its sentences (what the length guard checks)."""
    tokenized = _tokenize_spans(examples, tokenizer, types, data_args)
    return eval_set_of(examples, tokenized), _most_words(tokenized)


def tokenize_span_data(data_args: NerDataArguments, tokenizer, types: list[str], train_examples, eval_examples):
    """``(train_dataset, eval_sets, truncation record, most words)``: :func:`tokenize_data` for a span head."""
    tokenized = _tokenize_spans(train_examples, tokenizer, types, data_args)
    most_words = _most_words(tokenized)
    train_cut, train_empty, _ = coverage_counts(tokenized)
    train_dataset = tokenized.remove_columns(list(COVERAGE_COLUMNS))
    eval_sets = {}
    for split, examples in eval_examples.items():
        eval_sets[split], words = span_eval_set(examples, tokenizer, types, data_args)
        most_words = max(most_words, words)
    record = ner_truncation_record((train_cut, train_empty), eval_sets, data_args.max_seq_length)
    return train_dataset, eval_sets, record, most_words


def check_span_length(most_words: int, training_args: TricksArguments, data_args: NerDataArguments) -> None:
    """The span head's length guard over the data, before any training or prediction: one line naming the limit."""
    if most_words > training_args.span_head_max_words:
        raise DataError(
            None,
            None,
            f"--span_head_max_words {training_args.span_head_max_words}: a sentence has {most_words} words within "
            f"--max_seq_length {data_args.max_seq_length}; lower --max_seq_length or raise --span_head_max_words",
        )


def _most_words(tokenized: Dataset) -> int:
    if len(tokenized) == 0:
        return 0
    return pc.max(pc.list_value_length(tokenized.data.column("seen_words"))).as_py() or 0


def load_span_classifier(model_args: ModelArguments, types: list[str], training_args=None):
    """``(model, tokenizer)``: a model saved with a span head loaded with it (:func:`load_span_model`), or a token
    classifier over ``types`` whose output layer the span head replaces when the trainer is built (trained with
    ``training_args``)."""
    path = resolve_model_path(model_args.model_name_or_path)
    if saved_span_head(path) is None:
        model, tokenizer, config = load_classifier(
            AutoModelForTokenClassification, model_args, types, None, training_args
        )
        prepare_ner_tokenizer(config, tokenizer)
        return model, tokenizer
    config, tokenizer = load_config_and_tokenizer(path, model_args.tokenizer_name, model_args.trust_remote_code)
    prepare_ner_tokenizer(config, tokenizer)
    with refusals_of_the_model():
        model = load_span_model(path, config=config, trust_remote_code=model_args.trust_remote_code)
    return model, tokenizer


def saved_types(model_args: ModelArguments) -> list[str] | None:
    """The entity types of a model saved with a span head, in id order (its predictions are over those)."""
    saved = saved_span_head(model_args.model_name_or_path)
    if saved is None:
        return None
    config = json.loads((Path(model_args.model_name_or_path) / "config.json").read_text(encoding="utf-8"))
    return [config["id2label"][str(i)] for i in range(len(config["id2label"]))]


def span_types(data_args: NerDataArguments, model_args: ModelArguments | None) -> tuple[list[str] | None, str | None]:
    """``(types, where they come from)``: a saved span model's (its predictions are over those), else
    ``--entity_types``, else ``(None, None)`` (the training data's); a saved model and other ``--entity_types``
    are refused in one line."""
    saved = saved_types(model_args) if model_args is not None else None
    given = data_args.entity_types
    if saved is not None and given is not None and saved != given:
        raise DataError(
            None,
            None,
            f"--entity_types {' '.join(given)}: --model_name_or_path {model_args.model_name_or_path} predicts the "
            f"types {' '.join(saved)} (in this order); drop --entity_types or give those",
        )
    if saved is not None:
        return saved, f"the types of --model_name_or_path {model_args.model_name_or_path}"
    if given is not None:
        return given, "--entity_types"
    return None, None
