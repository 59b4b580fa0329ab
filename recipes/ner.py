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
- Metrics: entity-level precision / recall / F1 with seqeval's semantics, from the ``evaluate`` module shipped in
  ``nlp_tricks/metrics/seqeval_f1`` (works offline).
- Tricks: every ``TricksArguments`` field is a flag (``--loss_type focal``, ``--layer_decay 0.9``,
  ``--head_lr_scale 10``, ...), next to every ``TrainingArguments`` flag.
- Outputs in ``--output_dir`` (default ``outputs/ner``): model and tokenizer (safetensors), ``all_results.json``
  (``eval_f1``, ``eval_precision``, ``eval_recall``, ``eval_accuracy``, the ``test_`` ones and the training
  numbers), ``test_predictions.txt`` (``token  gold  predicted`` per line, CoNLL style) and ``trainer_state.json``.
"""

from __future__ import annotations

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
from nlp_tricks.data import check_labels, label_list
from nlp_tricks.recipe_utils import (
    load_config_and_tokenizer,
    load_weights,
    ner_compute_metrics,
    parse_recipe_args,
    prepare_ner_tokenizer,
    resolve_model_path,
    run_recipe,
    train_evaluate_predict,
)
from nlp_tricks.recipe_utils import load_ner_splits as load_splits
from nlp_tricks.recipe_utils import tokenize_ner as tokenize

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


@dataclass
class DataArguments:
    """Where the sentences come from and how they are cut."""

    dataset_name: str = field(
        default="demo",
        metadata={
            "help": "'demo' (WNUT-16 tweets shipped by the demo extra, offline) or a Hub dataset with 'tokens' and "
            "'ner_tags' columns (e.g. conll2003). Ignored when --train_file is given."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "Training data: CoNLL (.conll/.txt/.tsv/...: token first, tag last) or JSON lines (.jsonl)."
        },
    )
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same formats."})
    test_file: str | None = field(default=None, metadata={"help": "Test data, same formats; predictions are written."})
    tokens_column: str = field(default="tokens", metadata={"help": "Field of the words (JSON lines, Hub)."})
    tags_column: str = field(default="ner_tags", metadata={"help": "Field of the tags (JSON lines, Hub)."})
    max_seq_length: int = field(
        default=128, metadata={"help": "Sub-tokens per sentence after tokenization; longer ones are truncated."}
    )
    label_all_tokens: bool = field(
        default=False,
        metadata={"help": "Train on every sub-token of a word (I- after a B-), not only its first sub-token."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training sentences."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N validation (and test) sentences."}
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
        (DataArguments, ModelArguments, TricksArguments), "ner", RECIPE_DEFAULTS
    )
    set_seed(training_args.seed)

    # ---- Data: read everything (and fail on bad input) before any training ----
    splits = load_splits(data_args)
    train_examples = splits["train"][0][: data_args.max_train_samples]
    labels = label_list(splits["train"][0], "ner_tags")
    for split in ("validation", "test"):
        if split in splits:
            check_labels(splits[split][0], "ner_tags", labels, splits[split][1])
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
    prepare_ner_tokenizer(config, tokenizer)
    model = load_weights(AutoModelForTokenClassification, model_path, config, model_args.trust_remote_code)

    train_dataset = tokenize(train_examples, tokenizer, label2id, data_args.max_seq_length, data_args.label_all_tokens)
    # Evaluation scores words: only first sub-tokens carry labels, whatever --label_all_tokens says.
    eval_datasets = {
        split: tokenize(examples, tokenizer, label2id, data_args.max_seq_length, False)
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
