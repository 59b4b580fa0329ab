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
- Tag schemes: IOB2, IOB1, BIOES (IOBES), BMES and BILOU, ``--tag_scheme auto`` (detected from the training file's
  prefixes, said in one line) or named (a tag the scheme does not have is a ``file:line`` error). One rule reads
  the entities of every scheme (conlleval's lenient reading: an ``I-`` / ``M-`` / ``E-`` with no open entity of
  its type starts one); the model trains on their IOB2 tags, so one corpus in any scheme trains alike and
  ``--crf_bio_constraints`` always fits; predictions are written back in the file's scheme (docs/recipes.md, "NER
  tag schemes").
- Labels are the IOB2 tags of the training entities (or ``--tag_names``, in id order); a tag in validation / test
  whose IOB2 tag training never has is an error naming its file and line, as is a token without a tag, a token
  holding a space, a tag-first file, IOB tags mixed with words, an empty file, a JSON record without a field or
  with tokens and tags of different lengths, and a file that is not UTF-8. Such errors print one line on stderr and
  exit with status 1.
- The tag of a word goes on its first sub-token (-100 on the rest); ``--label_all_tokens`` labels every training
  sub-token (``B-X I-X ...``).
- Scoring covers every word of every sentence: a word's prediction is its first sub-token's, and a word cut by
  ``--max_seq_length`` or without any sub-token counts as predicted ``O`` (a warning says how many).
- Metrics: exact entity-span precision / recall / F1, overall (micro average) and per entity type, and word
  accuracy of the tags as written (``nlp_tricks.metrics.spans.tag_f1``; seqeval's numbers on IOB2 and BIOES).
- Tricks: every ``TricksArguments`` field is a flag (``--loss_type focal``, ``--layer_decay 0.9``,
  ``--head_lr_scale 10``, ...), next to every ``TrainingArguments`` flag.
- ``--crf true``: a CRF over the word-level logits (docs/heads.md); metrics and ``test_predictions.txt`` come from
  its Viterbi paths, and the saved model carries it: ``--model_name_or_path outputs/ner`` loads it back and
  predicts with it, ``--crf true`` given or not (``--crf false`` with such a model is a one-line error).
  ``--crf_bio_constraints true`` forbids what IOB2 forbids (the labels are IOB2 whatever the files' scheme).
  ``--class_weights balanced`` weighs each tag by n / (n_tags x its count) over the training
  labels; ``--class_weights 1 3 ...`` gives one weight per tag (in the label order the error message lists).
- ``--span_head global_pointer`` (or ``efficient_global_pointer``): a span head instead of token tagging
  (docs/heads.md): every span of words scored per entity type, so entities may nest. Nested data is JSON lines
  ``{"tokens": [...], "entities": [{"start": i, "end": j, "type": "PER"}]}`` (word indices, ``end`` exclusive);
  tagged files are read as above, their tags turned into spans; the entity types are the training data's, sorted,
  or ``--entity_types`` in that order. Metrics are exact-span P / R / F1 (micro and per type; seqeval's on flat
  data), predictions go to ``test_predictions.jsonl`` (and, with ``--span_flat true``, to ``test_predictions.txt``
  as tags of the files' scheme), and a saved span model given as ``--model_name_or_path`` predicts with its head
  and settings.
- Outputs in ``--output_dir`` (default ``outputs/ner``): model and tokenizer (safetensors), ``all_results.json``
  (``eval_f1``, ``eval_precision``, ``eval_recall``, ``eval_accuracy``; per entity type ``eval_PER_precision``,
  ``eval_PER_recall``, ``eval_PER_f1``, ``eval_PER_number`` (gold entities); the ``test_`` ones, the training
  numbers, the data files, label list and truncated-word counts), ``test_predictions.txt`` (``token  gold
  predicted`` per word, CoNLL style: the gold tags as read, the predictions the test metrics score in the files'
  scheme) and ``trainer_state.json``. A folder
  holding an earlier run's results is refused unless ``--overwrite_output_dir``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from datasets import Dataset
from transformers import AutoModelForTokenClassification, DataCollatorForTokenClassification

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.data import DataError
from nlp_tricks.data.schemes import convert_tags
from nlp_tricks.data.spans import SpanCollator
from nlp_tricks.self_training import PseudoLabels, ner_pseudo_labels, read_unlabeled_file, token_teacher_logits

from common import (
    ENCODER_DEFAULTS,
    ModelArguments,
    build_trainer,
    check_label_arguments,
    data_record,
    load_classifier,
    own_rows,
    run_recipe,
    start_recipe,
    train_evaluate_predict,
)
from ensemble_folder import predict_with_ensemble
from ner_data import (
    NER_FEATURES,
    NerDataArguments,
    NerEvalSet,
    check_ner_splits,
    encode_ner_batch,
    load_ner_splits,
    ner_eval_set,
    prepare_data,
    prepare_ner_tokenizer,
    read_data,
    tokenize_data,
    tokenize_ner,
)
from ner_outputs import (
    entity_scores,
    ner_compute_metrics,
    ner_scores,
    ner_word_predictions,
    span_compute_metrics,
    span_word_predictions,
    write_predictions,
    write_span_predictions,
)
from ner_spans import (
    check_no_span_files,
    check_span_length,
    load_span_classifier,
    load_span_splits,
    read_span_data,
    resolve_span_scheme,
    saved_span_defaults,
    saved_span_head,
    saved_types,
    span_eval_set,
    span_types,
    tokenize_span_data,
)
from teacher import check_teacher, with_teacher

# What other recipes, the k-fold ensembles and the tests read of this recipe; the code lives in ner_data.py (tagged
# data), ner_spans.py (--span_head) and ner_outputs.py (metrics and prediction files).
__all__ = [
    "ABLATION_CONFIGURATIONS",
    "EVIDENCE_DEFAULTS",
    "MAIN_METRIC",
    "NER_FEATURES",
    "NER_TASK",
    "RECIPE_ARGUMENT_TYPES",
    "RECIPE_DEFAULTS",
    "NerDataArguments",
    "NerEvalSet",
    "check_ner_splits",
    "check_span_length",
    "encode_ner_batch",
    "entity_scores",
    "load_ner_splits",
    "load_span_classifier",
    "load_span_splits",
    "main",
    "ner_eval_set",
    "ner_scores",
    "prepare_data",
    "prepare_ner_tokenizer",
    "read_data",
    "read_span_data",
    "resolve_span_scheme",
    "saved_span_defaults",
    "saved_span_head",
    "saved_types",
    "span_eval_set",
    "span_types",
    "tokenize_ner",
    "write_predictions",
    "write_span_predictions",
]


# Tuned on the demo (WNUT-16 + MiniLM, 2-core CPU); every one is a flag.
RECIPE_DEFAULTS = {**ENCODER_DEFAULTS, "learning_rate": 1.5e-4}
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


# ---- The self-training task (recipes/self_training.py --task ner) ---------------------------------------------------


class NerTask:
    """What recipes/self_training.py needs of NER: sentences with a tag per word, pseudo-labelled word by word."""

    label_key = "ner_tags"
    # Overrides of self-training's defaults (which are this recipe's).
    self_training_defaults = {}
    # The columns of self-training's printed table.
    table_metrics = ("eval_f1", "test_f1")
    supports_crf = True

    read_labelled = staticmethod(read_data)  # the recipe's own reading of its labelled data

    def read_unlabeled(self, path: str, data) -> list[dict]:
        return read_unlabeled_file(path, "ner", data.tokens_column)

    def load_model(self, model_args, labels: list[str], model_path: str, training_args=None):
        model, tokenizer, config = load_classifier(
            AutoModelForTokenClassification, model_args, labels, model_path, training_args
        )
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
            split: (eval_set.dataset, ner_compute_metrics(id2label, eval_set, data.tag_scheme))
            for split, eval_set in eval_sets.items()
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
        """Per word: the share of labelled words of the kept sentences whose pseudo-tag is the held-out gold tag
        (both IOB2, the tags the model trains on)."""
        hits = [
            labels[y] == gold
            for i, word_labels in zip(pseudo.indices, pseudo.labels)
            for y, gold in zip(word_labels, convert_tags(hidden_gold[i]))
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


RECIPE_ARGUMENT_TYPES = (NerDataArguments, ModelArguments, TricksArguments)


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
        evidence_unless="teacher",  # the CRF takes no per-token teacher_logits
        saved_crf_models=("model_name_or_path",),  # a model trained with --crf stays a CRF
    )
    check_teacher(data_args, training_args, "ner")
    if training_args.span_head is not None:
        span_main(data_args, model_args, training_args)
    else:
        tagging_main(data_args, model_args, training_args)


def tagging_main(data_args: NerDataArguments, model_args: ModelArguments, training_args: TricksArguments) -> None:
    """The recipe with token tagging: a tag per word (a CRF over them with ``--crf true``)."""
    splits, labels, train_examples, eval_examples = _setup_tagged_data(data_args, training_args)
    model, tokenizer, config = load_classifier(
        AutoModelForTokenClassification, model_args, labels, None, training_args
    )
    prepare_ner_tokenizer(config, tokenizer)
    with training_args.main_process_first(desc="tokenizing the data"):
        train_dataset, eval_sets, truncation = tokenize_data(
            data_args, tokenizer, labels, train_examples, eval_examples
        )
    id2label, scheme = dict(enumerate(labels)), data_args.tag_scheme
    split_metrics = {split: ner_compute_metrics(id2label, eval_set, scheme) for split, eval_set in eval_sets.items()}

    def write_test_predictions(output):
        word_tags = ner_word_predictions(eval_sets["test"], output.predictions, output.label_ids, id2label)
        path = Path(training_args.output_dir) / "test_predictions.txt"
        write_predictions(path, eval_sets["test"], word_tags, scheme)

    train_dataset, collator = with_teacher(  # --teacher: soft targets (teacher_logits) on every training word
        "ner", (data_args, model_args, training_args), labels, train_examples, train_dataset, tokenizer,
        DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8),
    )  # fmt: skip
    _train_and_report(
        training_args,
        (model, tokenizer, collator),
        (train_dataset, eval_sets, split_metrics),
        {**data_record(splits, labels), **truncation},
        write_test_predictions,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
    )


def _setup_tagged_data(data_args: NerDataArguments, training_args: TricksArguments):
    """:func:`read_data`: everything read (and bad input refused) before any training, the flags that depend on the
    labels checked."""
    if data_args.entity_types is not None:
        raise DataError(None, None, "--entity_types names a span head's types; token tagging reads --tag_names")
    check_no_span_files(data_args)
    with training_args.main_process_first(desc="reading the data"):  # the others read the main process's cache
        splits, labels, train_examples, eval_examples = read_data(data_args)
    # The labels are IOB2 whatever the files' scheme, so --crf_bio_constraints always fits them.
    check_label_arguments(training_args, labels)
    return splits, labels, train_examples, eval_examples


def span_main(data_args: NerDataArguments, model_args: ModelArguments, training_args: TricksArguments) -> None:
    """The recipe with ``--span_head``: the same flow as :func:`tagging_main` over span examples (nested files
    welcome)."""
    if data_args.label_all_tokens:
        raise DataError(None, None, "--label_all_tokens labels sub-tokens with tags; a span head scores whole words")
    types, known_from = span_types(data_args, model_args)
    with training_args.main_process_first(desc="reading the data"):
        splits, types, train_examples, eval_examples = read_span_data(data_args, types, known_from)
    model, tokenizer = load_span_classifier(model_args, types, training_args)
    with training_args.main_process_first(desc="tokenizing the data"):
        train_dataset, eval_sets, truncation, most_words = tokenize_span_data(
            data_args, tokenizer, types, train_examples, eval_examples
        )
    check_span_length(most_words, training_args, data_args)
    split_metrics = {split: span_compute_metrics(types, eval_set) for split, eval_set in eval_sets.items()}

    def write_test_predictions(output):
        eval_set = eval_sets["test"]
        predicted = span_word_predictions(eval_set, own_rows(output.predictions, len(eval_set.seen_words)), types)
        out, flat = Path(training_args.output_dir), training_args.span_flat
        write_span_predictions(out, eval_set, predicted, flat, scheme=data_args.tag_scheme)

    _train_and_report(
        training_args,
        (model, tokenizer, SpanCollator(tokenizer, pad_to_multiple_of=8)),
        (train_dataset, eval_sets, split_metrics),
        {**data_record(splits, types), **truncation},
        write_test_predictions,
    )


def _train_and_report(training_args, model_parts, data_parts, record, write_test_predictions, **trainer_options):
    """Build the trainer from ``(model, tokenizer, collator)`` and ``(train_dataset, eval_sets, split_metrics)``,
    then train, evaluate and predict; ``all_results.json`` last (``record`` goes into it)."""
    model, tokenizer, collator = model_parts
    train_dataset, eval_sets, split_metrics = data_parts
    eval_datasets = {split: eval_set.dataset for split, eval_set in eval_sets.items()}
    trainer = build_trainer(
        TricksTrainer,
        training_args,
        train_dataset,
        eval_datasets,
        model=model,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=split_metrics.get("validation"),
        **trainer_options,
    )
    train_evaluate_predict(trainer, train_dataset, eval_datasets, write_test_predictions, split_metrics, record)


if __name__ == "__main__":
    run_recipe(main)
