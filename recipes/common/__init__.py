"""What the scripts in ``recipes/`` share, one concern per module; every name is re-exported here.

Each recipe stays one readable script and imports this package from its own folder (``from common import ...``);
nothing here is part of the ``nlp_tricks`` package, whose toolkit the recipes use like any user would.

- ``start``: :func:`start_recipe`, the start of every recipe's ``main`` (parse, seed, output folder).
- ``parsing``: :func:`parse_recipe_args`, the command line parsed once into the argument dataclasses;
  ``config_file``: a ``recipe.py run.yaml`` file's values, each checked as its flag would be; ``help``: ``--help`` in
  groups.
- ``arguments``: the shared argument dataclasses (data, model, the run's own flags).
- ``data``: splits from files, the demo or the Hub; labels; the tokenizing map's options.
- ``models``: the model to start from, its config, tokenizer and weights; a saved CRF kept; ``pad_token``: a padding
  token for tokenizers without one; ``peft``: the LoRA flags, the adapter built, loaded back and merged.
- ``outputs``: the output folder (an earlier run's results refused or removed) and atomic JSON.
- ``threads``: the torch threads of a CPU run (the cores free at start, unless the user chose).
- ``run``: running a recipe (its threads, one-line data errors) and the end of a run (train, evaluate, predict,
  ``all_results.json``, the exit of a preempted run).
- ``summary``: the lines a person reads at the end of a run (headline scores, where the files are, the commands
  that predict and plot).
- ``trainer``: :func:`build_trainer`, the trainer every recipe builds (validation, ``--trick`` tricks, refusals).
- ``user_tricks``: ``--trick module:Class``, a user's own trick with its flags (:func:`user_tricks`).
- ``errors``: load and build errors as one line; ``process``: rank 0 and its warnings.
"""

from .arguments import (
    ENCODER_DEFAULTS,
    TABLE_TRAIN_FILE_HELP,
    DataArguments,
    ModelArguments,
    RunArguments,
    dataset_help,
)
from .config_file import CONFIG_SUFFIXES
from .data import (
    check_label_arguments,
    check_split_labels,
    data_record,
    eval_splits,
    labelled_splits,
    labels_of,
    load_splits,
    map_options,
)
from .errors import one_line_load_errors, refusals_of_the_model
from .models import (
    DEMO_MODELS,
    check_saved_crf,
    check_task_class,
    is_causal_lm,
    load_classifier,
    load_config_and_tokenizer,
    load_weights,
    model_holds_crf,
    resolve_model_path,
    saved_crf_defaults,
)
from .outputs import RESULT_OUTPUTS, RUN_OUTPUTS, prepare_output_dir, write_json_atomic
from .pad_token import choose_pad_token, fit_model_to_tokenizer
from .parsing import parse_recipe_args
from .peft import PeftArguments, adapter_config, add_lora, check_peft_tricks, merge_trained_adapter
from .process import is_main_process, logger, warn
from .run import exit_if_preempted, own_rows, resume_argument, run_recipe, train_evaluate_predict
from .start import start_recipe
from .summary import print_summary, summary_lines
from .threads import choose_threads, has_accelerator
from .trainer import build_trainer
from .user_tricks import TrickError, load_trick, trick_specs, user_tricks

__all__ = [
    "CONFIG_SUFFIXES",
    "DEMO_MODELS",
    "ENCODER_DEFAULTS",
    "RESULT_OUTPUTS",
    "RUN_OUTPUTS",
    "DataArguments",
    "ModelArguments",
    "PeftArguments",
    "RunArguments",
    "TABLE_TRAIN_FILE_HELP",
    "TrickError",
    "adapter_config",
    "add_lora",
    "build_trainer",
    "check_label_arguments",
    "choose_threads",
    "check_peft_tricks",
    "check_saved_crf",
    "check_split_labels",
    "check_task_class",
    "choose_pad_token",
    "data_record",
    "dataset_help",
    "eval_splits",
    "exit_if_preempted",
    "has_accelerator",
    "fit_model_to_tokenizer",
    "is_causal_lm",
    "is_main_process",
    "labelled_splits",
    "labels_of",
    "load_trick",
    "load_classifier",
    "load_config_and_tokenizer",
    "load_splits",
    "load_weights",
    "logger",
    "map_options",
    "merge_trained_adapter",
    "model_holds_crf",
    "one_line_load_errors",
    "own_rows",
    "parse_recipe_args",
    "prepare_output_dir",
    "print_summary",
    "refusals_of_the_model",
    "resolve_model_path",
    "resume_argument",
    "run_recipe",
    "saved_crf_defaults",
    "start_recipe",
    "summary_lines",
    "train_evaluate_predict",
    "trick_specs",
    "user_tricks",
    "warn",
    "write_json_atomic",
]
