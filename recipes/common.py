"""What the scripts in ``recipes/`` share: argument bases and parsing, split loading, model loading, the end of a run.

Each recipe stays one readable script and imports this module from its own folder (``from common import ...``);
nothing here is part of the ``nlp_tricks`` package, whose toolkit the recipes use like any user would.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    HfArgumentParser,
    TrainingArguments,
)

from nlp_tricks.checkpoint import DESCRIPTION_FILES, is_state_dict_file, load_state_dict_portable, read_state_dict
from nlp_tricks.crf import add_crf, bio_constraints, load_crf_model
from nlp_tricks.data import (
    DataError,
    check_labels,
    demo_causal_lm_path,
    demo_model_path,
    kfold_examples,
    label_list,
    split_examples,
)
from nlp_tricks.data.arrow import as_dataset, distinct_values, first_rows
from nlp_tricks.losses import focal_alpha_weights
from nlp_tricks.pooling import load_pooled_model
from nlp_tricks.preemption import PREEMPTED_EXIT_CODE, describe_stop, set_time_budget
from nlp_tricks.resume import get_last_complete_checkpoint
from nlp_tricks.runtime.divergence import DIVERGED_EXIT_CODE, TrainingDivergedError
from nlp_tricks.runtime.integrity import NO_SPACE_EXIT_CODE, NoSpaceLeftError
from nlp_tricks.runtime.lock import OutputDirBusyError, lock_output_dir

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")

logger = logging.getLogger("nlp_tricks.recipes")


# ---- Arguments ----------------------------------------------------------------------------------------------------


@dataclass
class DataArguments:
    """Where the examples come from. Each recipe extends it with its columns and lengths."""

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
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={
            "help": "Start a fresh head when the model folder's head has another shape (e.g. a trained NER model "
            "fine-tuned on data with other labels); its other weights are kept."
        },
    )


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

    max_time: str | None = field(
        default=None,
        metadata={
            "help": "Wall-clock budget of this process, e.g. 8h45m, 30m, 90s: before it runs out, training stops "
            "after a whole step, saves a complete checkpoint-N and exits with status 75 (as on SIGTERM); rerun "
            "with --resume_from_checkpoint true. Counted from the process start, so loading is included; the "
            "final evaluation and prediction of a finished run are not. See docs/checkpoints.md."
        },
    )


def is_main_process() -> bool:
    """Rank 0 of a launched job (or a plain run), read from the launcher's environment without any collective."""
    return int(os.environ.get("RANK", "0")) == 0


def parse_recipe_args(
    dataclass_types: tuple,
    recipe: str,
    defaults: dict | None = None,
    argv: list[str] | None = None,
    dependent_defaults: tuple[str | Callable, dict] | list[tuple[str | Callable, dict]] | None = None,
    description: str | None = None,
    evidence_defaults: dict | None = None,
    evidence_unless: str | None = None,
):
    """Parse the command line, once, into the dataclasses.

    A ``.yaml`` / ``.yml`` / ``.json`` file given first supplies values, and the flags after it override them
    (``recipe.py run.yaml --max_steps 2``); its unknown keys are reported before anything else, with the closest
    known name. ``defaults`` replace the dataclasses' own defaults (e.g. the recipe's learning rate);
    ``output_dir`` defaults to ``outputs/<recipe>``, ``report_to`` to ``none`` and ``do_train`` to true
    (``--do_train false`` evaluates the model as it is). ``dependent_defaults`` ``(field, {value: {name: default}})``
    picks more defaults by the parsed value of ``field`` (self-training's task), unless given; ``field`` may be a
    function of the parsed namespace instead (pretraining: whether the demo is used; NER: whether the model holds a
    CRF); a list of such pairs applies each. ``evidence_defaults`` (``{name: value}``) are the tricks the recipe turns
    on by default, unless given, ``--tricks none`` or the boolean flag ``evidence_unless`` is on (where the evidence
    was not measured); when they do not combine with a flag the user gave, they are left off with a warning (what the
    user asked for wins). ``--save_steps N`` without ``--save_strategy`` saves every N steps. ``--help`` opens with
    ``description`` (the recipe's docstring up to its "Features:") and lists the flags in groups: data, model (and
    any other dataclass of the recipe), tricks (``TricksArguments``' own fields), Trainer (``TrainingArguments``). A
    value the arguments reject prints one line (the error and a pointer to ``--help``, without the usage block) and
    exits with status 2, as argparse does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {
        "output_dir": f"outputs/{recipe}",
        "report_to": "none",
        "do_train": True,
        "enable_jit_checkpoint": True,
        **(defaults or {}),
    }
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        # A launched multi-process job without GPUs (`accelerate launch --multi_gpu` on CPUs): accelerate forms the
        # CPU (gloo) process group only with use_cpu; without it every process would train alone on all the data.
        defaults.setdefault("use_cpu", True)
    parser = HfArgumentParser(
        (*dataclass_types, RunArguments),
        prog=f"{recipe}.py",
        usage="%(prog)s [CONFIG.yaml] [--FLAG VALUE ...]",  # argparse's own lists every flag: hundreds of lines
        description=_description(description),
        formatter_class=_HelpFormatter,
    )
    parser.allow_abbrev = False  # `given` below reads the flags as typed
    # The run's own flags (--max_time) between the recipe's and the trainer's groups.
    trainer_types = tuple(t for t in dataclass_types if issubclass(t, TrainingArguments))
    others = tuple(t for t in dataclass_types if t not in trainer_types)
    _group_arguments(parser, (*others, RunArguments, *trainer_types))
    parser.error = functools.partial(_one_line_error, parser)
    actions = {action.dest: action for action in parser._actions if action.dest != "help"}
    if "resume_from_checkpoint" in actions:
        actions["resume_from_checkpoint"].help = (
            "Resume training: 'true' picks the newest COMPLETE checkpoint-N in --output_dir (a folder a crash left "
            "half-written is skipped with a warning), or give a checkpoint folder. Checkpoints are written with "
            "--save_steps N (or --save_strategy epoch), and by a run stopped by SIGTERM or --max_time."
        )
    evidence_defaults = evidence_defaults or {}
    actions["tricks"].help += (
        " This recipe's: "
        + (", ".join(_as_flags(evidence_defaults)) or "none yet")
        + (f" (not with --{evidence_unless})" if evidence_defaults and evidence_unless else "")
        + "."
    )
    if "enable_jit_checkpoint" in actions:
        actions["enable_jit_checkpoint"].help = (
            "On SIGTERM or SIGUSR1 (a preemption: Kubernetes, SLURM's --signal, spot instances), finish the current "
            "optimizer step, save a complete checkpoint-N of it and exit with status 75; rerun with "
            "--resume_from_checkpoint true. On by default in the recipes; false lets the signal end the run at once."
        )
    from_file = {}
    if argv and argv[0].endswith(CONFIG_SUFFIXES) and not argv[0].startswith("-"):
        from_file = _read_config_file(parser, argv.pop(0), actions)
    parser.set_defaults(**{**defaults, **from_file})
    namespace = parser.parse_args(argv)
    given = set(from_file) | {
        action.dest
        for action in parser._actions
        for option in action.option_strings
        if any(arg == option or arg.startswith(option + "=") for arg in argv)
    }
    if dependent_defaults is not None:
        pairs = dependent_defaults if isinstance(dependent_defaults, list) else [dependent_defaults]
        for key, by_value in pairs:
            value_of_key = key(namespace) if callable(key) else getattr(namespace, key)
            for name, value in by_value.get(value_of_key, {}).items():
                if name not in given:
                    setattr(namespace, name, value)
    if "save_steps" in given and "save_strategy" not in given and hasattr(namespace, "save_strategy"):
        namespace.save_strategy = "steps"
    try:
        set_time_budget(namespace.max_time)
    except ValueError as err:
        parser.error(f"--max_time: {err}")

    def build():
        return tuple(
            dtype(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(dtype) if f.init})
            for dtype in dataclass_types
        )

    evidence_on = namespace.tricks == "default" and not (evidence_unless and getattr(namespace, evidence_unless))
    applied = {n: v for n, v in evidence_defaults.items() if evidence_on and n not in given}
    plain = {name: getattr(namespace, name) for name in applied}
    for name, value in applied.items():
        setattr(namespace, name, value)
    try:
        try:
            return build()
        except ValueError as err:
            if not applied:
                raise
            for name, value in plain.items():  # what the user gave wins over the recipe's defaults
                setattr(namespace, name, value)
            parsed = build()
            flags = " ".join(_as_flags(applied))
            warn(f"{flags} (this recipe's default, --tricks default) is left off: {str(err).splitlines()[0]}")
            return parsed
    except ValueError as err:
        parser.error(str(err).splitlines()[0] if str(err) else type(err).__name__)


def _as_flags(values: dict) -> list[str]:
    """``{"crf": True}`` -> ``["--crf true"]``: values as they are typed on the command line."""
    return [f"--{name} {str(value).lower() if isinstance(value, bool) else value}" for name, value in values.items()]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its command lines stay lines); each flag's help with its default."""


def _description(docstring: str | None) -> str | None:
    """A recipe docstring's opening: what it does and its command lines, up to the "Features:" list."""
    if not docstring:
        return None
    return docstring.split("\nFeatures:")[0].strip()


# Titles of the --help groups, by the dataclass a flag comes from (its docstring's first line describes the group).
_GROUP_TITLES = (("DataArguments", "data"), ("ModelArguments", "model"), ("SelfTrainingArguments", "self-training"))


def _group_arguments(parser: argparse.ArgumentParser, dataclass_types: tuple) -> None:
    """Move every flag from argparse's one flat list into a group per dataclass; the ``TrainingArguments``
    subclass splits into the tricks (fields it adds, ``TricksArguments``') and the Trainer's own fields."""
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    trainer_fields = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    actions: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        actions.setdefault(action.dest, []).append(action)
    for dtype in dataclass_types:
        names = [f.name for f in dataclasses.fields(dtype) if f.init]
        if issubclass(dtype, TrainingArguments):
            groups = [
                (
                    "tricks",
                    "nlp_tricks.TricksArguments: every trick is a flag.",
                    [n for n in names if n not in trainer_fields],
                ),
                (
                    "Trainer",
                    "transformers.TrainingArguments, as upstream reads them.",
                    [n for n in names if n in trainer_fields],
                ),
            ]
        else:
            bases = [cls.__name__ for cls in dtype.__mro__]
            title = next((t for name, t in _GROUP_TITLES if name in bases), dtype.__name__.removesuffix("Arguments"))
            doc = (dtype.__doc__ or "").strip().splitlines()
            groups = [(title, doc[0] if doc and not doc[0].startswith(dtype.__name__ + "(") else None, names)]
        for title, text, group_names in groups:
            group = parser.add_argument_group(title, text)
            for name in group_names:
                for action in actions.get(name, []):
                    for other in parser._action_groups:
                        if action in other._group_actions:
                            other._group_actions.remove(action)
                    group._group_actions.append(action)


def _one_line_error(parser: argparse.ArgumentParser, message: str):
    """argparse's error without the usage block (hundreds of flags): the error and where to read about the flags."""
    parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")


def _read_config_file(parser: argparse.ArgumentParser, path: str, actions: dict) -> dict:
    """The values of a YAML / JSON config file, checked against the recipe's arguments (one line per problem)."""
    file = Path(path)
    if not file.is_file():
        parser.error(f"{path}: no such config file")
    try:
        text = file.read_text(encoding="utf-8")
        if file.suffix == ".json":
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        parser.error(f"{path}: cannot read it ({str(err).splitlines()[0]})")
    except Exception as err:  # yaml.YAMLError, without importing yaml for JSON users
        parser.error(f"{path}: not valid YAML ({str(err).splitlines()[0]})")
    if values is None:
        return {}
    if not isinstance(values, dict):
        parser.error(f"{path}: expected a mapping of argument names to values")
    for key in values:
        if key not in actions:
            close = difflib.get_close_matches(str(key), list(actions), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            parser.error(f"{path}: unknown key {key!r}{hint}")
    for key, value in values.items():
        # A list argument given one value in the file (focal_alpha: 0.25) is a list of one.
        if actions[key].nargs in ("+", "*") and not isinstance(value, list):
            values[key] = [value]
    return values


def use_every_core() -> None:
    """Let a single CPU process use every core, unless the user chose a thread count.

    ``accelerate launch`` sets ``OMP_NUM_THREADS=1`` for one CPU process when the user set neither that variable nor
    ``--num_cpu_threads_per_process``, which leaves all cores but one idle (the NER demo on 2 cores: 214 s on one
    thread, 134 s on two). Only that case is changed, read from the launcher's own environment and command line.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or torch.cuda.is_available():
        return
    if os.environ.get("OMP_NUM_THREADS") != "1" or "ACCELERATE_MIXED_PRECISION" not in os.environ:
        return
    try:
        parent = os.getppid()
        launcher_env = Path(f"/proc/{parent}/environ").read_bytes().split(b"\0")
        launcher_cmd = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return  # not Linux, or not readable: keep what the launcher set
    user_chose = any(item.startswith(b"OMP_NUM_THREADS=") for item in launcher_env) or any(
        item.startswith(b"--num_cpu_threads_per_process") for item in launcher_cmd
    )
    if not user_chose and b"launch" in launcher_cmd:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(cores)


def run_recipe(main: Callable[[], None]) -> None:
    """Run ``main``; a :class:`~nlp_tricks.data.DataError` or an ``--output_dir`` another run holds ends it with one
    line on stderr and exit status 1, a diverged training run with status 3 (``DIVERGED_EXIT_CODE``), a full disk
    while saving a checkpoint with status 74 (``NO_SPACE_EXIT_CODE``).

    Only rank 0 prints, so a launched job with N processes shows the line once. Nothing else is caught: a bug keeps
    its traceback. The output folder's lock is released when ``main`` ends, however it ends.
    """
    use_every_core()
    try:
        main()
    except (DataError, OutputDirBusyError, TrainingDivergedError, NoSpaceLeftError) as err:
        if is_main_process():
            print(str(err), file=sys.stderr, flush=True)
        codes = {TrainingDivergedError: DIVERGED_EXIT_CODE, NoSpaceLeftError: NO_SPACE_EXIT_CODE}
        sys.exit(next((code for kind, code in codes.items() if isinstance(err, kind)), 1))
    finally:
        while _output_dir_locks:
            _output_dir_locks.pop().release()


# ---- Data ---------------------------------------------------------------------------------------------------------


def load_splits(
    data: DataArguments,
    read_file: Callable[[str], object],
    demo: Callable[[], list[dict] | dict[str, list[dict]]],
    demo_source: str,
    hub_converter: Callable,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
) -> dict[str, tuple[object, str]]:
    """``{split: (examples, source name for errors)}`` from the files, the demo or a Hub dataset; the examples of
    each split are a ``datasets.Dataset`` (Arrow, memory-mapped: memory does not grow with the file).

    ``read_file(path)`` returns a file's examples (a dataset, e.g. from :func:`nlp_tricks.data.arrow_dataset`);
    ``demo()`` the built-in examples (one list, or a dict of splits); ``hub_converter(features)`` the function turning
    one Hub row into an example. With neither a validation nor a test split, train is split into train / validation
    / test by ``fractions`` (80/10/10) with ``data.split_seed`` (``select``: no row is copied).
    """
    if data.train_file:
        splits = {"train": (read_file(data.train_file), data.train_file)}
        for split, path in (("validation", data.validation_file), ("test", data.test_file)):
            if path:
                splits[split] = (read_file(path), path)
    elif data.dataset_name == "demo":
        examples = demo()
        if isinstance(examples, dict):
            splits = {split: (as_dataset(rows), f"{demo_source}[{split}]") for split, rows in examples.items()}
        else:
            splits = {"train": (as_dataset(examples), demo_source)}
    else:
        from datasets import load_dataset

        try:
            raw = load_dataset(data.dataset_name, data.dataset_config_name)
        except (OSError, ValueError, ConnectionError) as err:  # no such dataset, or offline (HF_DATASETS_OFFLINE)
            raise DataError(
                None, None, f"--dataset_name {data.dataset_name}: cannot load it: {_first_sentence(err)}"
            ) from err
        splits = {}
        for split in ("train", "validation", "test"):
            if split in raw:
                convert = hub_converter(raw[split].features)
                rows = raw[split].map(
                    convert,
                    remove_columns=raw[split].column_names,
                    num_proc=getattr(data, "preprocessing_num_workers", None),
                    desc=f"Reading {data.dataset_name}[{split}]",
                )
                splits[split] = (rows, f"{data.dataset_name}[{split}]")
    if getattr(data, "num_folds", None) is not None:
        if "validation" in splits or "test" in splits:
            raise DataError(
                None,
                None,
                "--num_folds needs single-split data (a --train_file alone, or the NER / classification demo)",
            )
        examples, source = splits["train"]
        train, validation, test = kfold_examples(examples, data.num_folds, data.fold, seed=data.split_seed)
        # "all": every fold's model knows every label, even one that occurs only in its test fold.
        splits = {"train": (train, source), "validation": (validation, source), "test": (test, source)}
        splits["all"] = (examples, source)
    elif "validation" not in splits and "test" not in splits:
        examples, source = splits["train"]
        train, validation, test = split_examples(examples, fractions, seed=data.split_seed)
        splits = {"train": (train, source), "validation": (validation, source), "test": (test, source)}
    return splits


def eval_splits(splits: dict[str, tuple[object, str]], max_samples: int | None) -> dict[str, object]:
    """The validation and test examples that exist, each cut to ``max_samples``."""
    return {
        split: first_rows(splits[split][0], max_samples)
        for split in ("validation", "test")
        if split in splits and len(splits[split][0])
    }


def labels_of(examples, label_key: str) -> list[str]:
    """:func:`~nlp_tricks.data.label_list` of a list of examples or of a dataset (read column by column)."""
    if isinstance(examples, list):
        return label_list(examples, label_key)
    return label_list([{label_key: sorted(distinct_values(examples, label_key))}], label_key)


def check_split_labels(examples, label_key: str, labels: list[str], source: str) -> None:
    """:func:`~nlp_tricks.data.check_labels` of a split; a dataset whose labels are all known (read column by
    column) is not read row by row."""
    if not isinstance(examples, list):
        try:
            check_labels([{label_key: sorted(distinct_values(examples, label_key))}], label_key, labels, source)
            return
        except DataError:
            pass  # read row by row below, for the line of the first unknown label
    check_labels(examples, label_key, labels, source)


def labelled_splits(
    splits: dict[str, tuple[object, str]], label_key: str, data: DataArguments, labels: list[str] | None = None
):
    """``(labels, train_examples, eval_examples)``: the label list (``labels`` when given, else the labels of the
    whole training split, numbers in numeric order), every validation / test label checked against it (an unseen
    one is a ``file:line`` error), and the splits cut to ``--max_train_samples`` / ``--max_eval_samples``."""
    if labels is None:
        labels = labels_of(splits.get("all", splits["train"])[0], label_key)
    if len(labels) < 2:
        raise DataError(
            splits["train"][1], None, f"only one label ({labels[0]!r}) in the training data; a classifier needs two"
        )
    for split in ("validation", "test"):
        if split in splits:
            check_split_labels(splits[split][0], label_key, labels, splits[split][1])
    train = first_rows(splits["train"][0], data.max_train_samples)
    return labels, train, eval_splits(splits, data.max_eval_samples)


def map_options(data: DataArguments, desc: str) -> dict:
    """The keyword arguments of every tokenizing ``Dataset.map``: batched, ``--preprocessing_num_workers``
    processes, the datasets cache unless ``--overwrite_cache``, and a progress bar named ``desc``."""
    return {
        "batched": True,
        "num_proc": getattr(data, "preprocessing_num_workers", None),
        "load_from_cache_file": not getattr(data, "overwrite_cache", False),
        "desc": desc,
    }


def check_label_arguments(training_args, labels: list[str]) -> None:
    """Arguments that depend on the labels (``--focal_alpha``, ``--class_weights``, ``--crf_bio_constraints``)
    checked before any model loads: one line if wrong."""
    if getattr(training_args, "focal_alpha", None) is not None:
        try:
            focal_alpha_weights(training_args.focal_alpha, labels)
        except ValueError as err:
            raise DataError(None, None, f"--focal_alpha: {err}") from err
    weights = getattr(training_args, "class_weights", None)
    if isinstance(weights, list) and len(weights) != len(labels):
        order = ", ".join(f"{i}={name}" for i, name in enumerate(labels))
        raise DataError(
            None,
            None,
            f"--class_weights: {len(weights)} weights for {len(labels)} classes; give one per class in this order: "
            f"{order} (or 'balanced')",
        )
    if getattr(training_args, "crf_bio_constraints", False):
        try:
            bio_constraints(labels)
        except ValueError as err:
            raise DataError(None, None, f"--crf_bio_constraints: {err}") from err


# ---- Model --------------------------------------------------------------------------------------------------------


# Names of built-in demo models that --model_name_or_path takes, and the function giving each one's folder.
DEMO_MODELS = {"smollm2-demo": demo_causal_lm_path, "minilm-demo": demo_model_path}


def resolve_model_path(model_name_or_path: str | None) -> str:
    """The model to start from: the given path or hub id, a built-in demo model's folder (``smollm2-demo``:
    SmolLM2-135M-Instruct, converted on first use; ``minilm-demo``: the demo's MiniLM encoder), or that MiniLM encoder
    when none is given."""
    if model_name_or_path in DEMO_MODELS:
        return DEMO_MODELS[model_name_or_path]()
    return model_name_or_path or demo_model_path()


def load_config_and_tokenizer(
    model_name_or_path: str,
    tokenizer_name: str | None = None,
    trust_remote_code: bool = False,
    **config_kwargs,
):
    """The config and tokenizer of ``model_name_or_path``.

    A raw state-dict file (``.pt`` / ``.pth`` / ``.bin`` / ``.safetensors``) has neither: its architecture and
    tokenizer are the demo model's (or ``tokenizer_name``'s), and :func:`load_weights` loads the file into it.
    """
    source = demo_model_path() if is_state_dict_file(model_name_or_path) else model_name_or_path
    with _one_line_errors(f"--model_name_or_path {model_name_or_path}"):
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **config_kwargs)
    with _one_line_errors(f"--tokenizer_name {tokenizer_name or source}"):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or source, trust_remote_code=trust_remote_code)
    return config, tokenizer


@contextlib.contextmanager
def refusals_of_the_model():
    """Around building the trainer: a trick that refuses this model (``--pooling`` on a head it cannot feed,
    ``--reinit_layers`` / ``--freeze_layers`` beyond its layers) raises ``ValueError`` naming the setting; it becomes
    that one line instead of a traceback."""
    try:
        yield
    except DataError:
        raise
    except ValueError as err:
        raise DataError(None, None, str(err).splitlines()[0]) from err


@contextlib.contextmanager
def _one_line_errors(what: str):
    """A model / dataset that cannot be loaded (no such folder, a Hub id while offline, a head of another shape)
    becomes one :class:`DataError` line naming the flag, instead of a traceback."""
    try:
        yield
    except OSError as err:  # transformers' "not a folder, not reachable on the Hub" (and offline mode)
        raise DataError(None, None, f"{what}: cannot load it: {_first_sentence(err)}") from err
    except RuntimeError as err:
        if "ignore_mismatched_sizes" not in str(err):
            raise
        raise DataError(
            None,
            None,
            f"{what}: its head has another shape than this data's labels need; add --ignore_mismatched_sizes true "
            "to start a fresh head",
        ) from err


def _first_sentence(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text.split(". ")[0].rstrip(".") if text else type(err).__name__


def load_classifier(auto_cls, model_args: ModelArguments, labels: list[str], model_path: str | None = None):
    """``(model, tokenizer, config)``: ``auto_cls`` (a token / sequence classification class) from
    ``model_path`` (default ``--model_name_or_path``) with a fresh head over ``labels``."""
    path = resolve_model_path(model_path or model_args.model_name_or_path)
    config, tokenizer = load_config_and_tokenizer(
        path,
        model_args.tokenizer_name,
        model_args.trust_remote_code,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    model = load_weights(
        auto_cls,
        path,
        config,
        model_args.trust_remote_code,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    return model, tokenizer, config


def load_weights(
    auto_cls, model_name_or_path: str, config, trust_remote_code: bool = False, ignore_mismatched_sizes: bool = False
):
    """``auto_cls.from_pretrained``; for a raw state-dict file, the model built from ``config`` with its weights.

    A model saved with a CRF (``--crf``: ``config.crf``, or ``crf.*`` keys in a state-dict file) comes back with it;
    one saved with ``--pooling`` (``config.pooling``) with its pooling.
    """
    if is_state_dict_file(model_name_or_path):
        # Any checkpoint (DataParallel / DDP / compiled prefixes), any device, strict, with clear errors.
        model = auto_cls.from_config(config, trust_remote_code=trust_remote_code)
        state = read_state_dict(model_name_or_path)
        if any(key == "crf.transitions" or key.endswith(".crf.transitions") for key in state):
            add_crf(model)
        load_state_dict_portable(model, state)
        return model
    if getattr(config, "crf", False) and auto_cls is AutoModelForTokenClassification:
        with _one_line_errors(f"--model_name_or_path {model_name_or_path}"):
            return load_crf_model(
                model_name_or_path,
                config=config,
                trust_remote_code=trust_remote_code,
                ignore_mismatched_sizes=ignore_mismatched_sizes,
            )
    if getattr(config, "pooling", None) is not None and auto_cls is AutoModelForSequenceClassification:
        with _one_line_errors(f"--model_name_or_path {model_name_or_path}"):
            return load_pooled_model(
                model_name_or_path,
                config=config,
                trust_remote_code=trust_remote_code,
                ignore_mismatched_sizes=ignore_mismatched_sizes,
            )
    with _one_line_errors(f"--model_name_or_path {model_name_or_path}"):
        return auto_cls.from_pretrained(
            model_name_or_path,
            config=config,
            trust_remote_code=trust_remote_code,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
        )


def model_holds_crf(model_name_or_path: str | None) -> bool:
    """Whether ``--model_name_or_path`` is a model saved with its CRF (``--crf true``): ``config.crf`` in its folder,
    or ``crf.*`` weights in a state-dict file. Such a model is only right as a CRF (Viterbi over its emissions)."""
    if not model_name_or_path or model_name_or_path in DEMO_MODELS:
        return False
    if is_state_dict_file(model_name_or_path):
        try:
            keys = read_state_dict(model_name_or_path).keys()
        except Exception:  # an unreadable file is reported, in one line, where the model loads
            return False
        return any(key == "crf.transitions" or key.endswith(".crf.transitions") for key in keys)
    config_file = Path(model_name_or_path) / "config.json"
    if config_file.is_file():
        try:
            return json.loads(config_file.read_text(encoding="utf-8")).get("crf") is True
        except (OSError, ValueError, AttributeError):
            return False
    return False  # a Hub id: load_weights still loads a saved CRF with it (config.crf)


def saved_crf_defaults(*model_fields: str) -> tuple[Callable, dict]:
    """``dependent_defaults`` of the NER recipes: ``--crf true`` unless given when a model they load holds a CRF."""
    return (
        lambda namespace: any(model_holds_crf(getattr(namespace, name, None)) for name in model_fields),
        {True: {"crf": True}},
    )


def check_saved_crf(training_args, model_args) -> None:
    """A model saved with a CRF used without it (``--crf false`` given) would predict the emissions' argmax: refused
    in one line. (Without the flag the recipes turn ``--crf`` on for it, see :func:`saved_crf_defaults`.)"""
    for name in ("model_name_or_path", "student_model_name_or_path"):
        path = getattr(model_args, name, None)
        if not training_args.crf and model_holds_crf(path):
            raise DataError(
                None, None, f"--{name} {path} was trained with a CRF and predicts with it (Viterbi); drop --crf false"
            )


# ---- Output folder ------------------------------------------------------------------------------------------------

# What a recipe run writes into --output_dir (glob patterns): the Trainer's model, tokenizer and state files, the
# recipes' results and predictions, checkpoints, and self-training's rounds.
RUN_OUTPUTS = (
    "all_results.json",
    "test_predictions.*",
    "self_training_results.json",
    "round_*",
    "trainer_state.json",
    "training_args.bin",
    "config.json",
    *DESCRIPTION_FILES,
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.*",
    "adapter_config.json",
    "checkpoint-*",
)
# Of those, the ones that make a folder hold results: an earlier run's numbers, predictions, model or checkpoints.
RESULT_OUTPUTS = (
    "all_results.json",
    "test_predictions.*",
    "self_training_results.json",
    "round_*",
    "trainer_state.json",
    "model*.safetensors",
    "pytorch_model*.bin",
    "adapter_model.*",
    "checkpoint-*",
)


# The output folders this process locked (prepare_output_dir), released when the recipe ends (run_recipe).
_output_dir_locks: list = []


def _matches(folder: Path, patterns: tuple[str, ...]) -> list[Path]:
    return sorted({path for pattern in patterns for path in folder.glob(pattern)})


def prepare_output_dir(
    output_dir: str | Path, overwrite: bool, resume: str | bool | None = None, reads: tuple[str | None, ...] = ()
) -> None:
    """Make sure no file of an earlier run can be read as this run's.

    A folder holding an earlier run's results (``RESULT_OUTPUTS``) is refused with a :class:`DataError` (one line,
    exit 1) unless ``overwrite`` (``--overwrite_output_dir``): then everything a run writes (``RUN_OUTPUTS``) is
    removed before the run starts, and nothing else (your own files stay). ``resume``
    (``--resume_from_checkpoint``) continues the run in the folder: its checkpoints stay and its earlier results
    are removed without asking. A folder holding a model the run reads (``reads``: ``--model_name_or_path``, ...)
    is always refused, since replacing its files would remove what the run is about to load. Only the main process
    removes; every process checks.

    First of all the main process locks the folder (created if missing) for this run: one that another run holds
    is refused (``OutputDirBusyError``, one line naming that run) before anything in it is touched.
    """
    if is_main_process():
        lock = lock_output_dir(output_dir)
        if lock is not None:
            _output_dir_locks.append(lock)
    folder = Path(output_dir)
    if not folder.is_dir():
        return
    keep_checkpoints = bool(resume)
    results = [
        p for p in _matches(folder, RESULT_OUTPUTS) if not (keep_checkpoints and p.name.startswith("checkpoint-"))
    ]
    if not results:
        return
    for source in reads:
        if (
            source
            and Path(source).exists()
            and folder.resolve() in (Path(source).resolve(), *Path(source).resolve().parents)
        ):
            raise DataError(
                folder,
                None,
                f"holds the model this run loads ({source}) and an earlier run's results; write this run to another "
                "--output_dir",
            )
    if not overwrite and not resume:
        names = ", ".join(p.name for p in results[:3]) + (", ..." if len(results) > 3 else "")
        only_checkpoints = all(p.name.startswith("checkpoint-") for p in results)
        hint = " (or --resume_from_checkpoint true to continue it)" if only_checkpoints else ""
        raise DataError(
            folder,
            None,
            f"holds the results of an earlier run ({names}); give --overwrite_output_dir to replace them, or "
            f"another --output_dir{hint}",
        )
    if not is_main_process():
        return
    for path in _matches(folder, RUN_OUTPUTS):
        if keep_checkpoints and path.name.startswith("checkpoint-"):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    logger.warning("%s: removed the outputs of an earlier run (%s)", folder, "resumed" if resume else "overwritten")


# ---- The end of a run ---------------------------------------------------------------------------------------------


def resume_argument(value: str | None) -> str | bool | None:
    """``--resume_from_checkpoint``: ``true`` means the newest complete checkpoint in output_dir, else a path."""
    if value is not None and value.strip().lower() in ("true", "yes", "1"):
        return True
    return value or None


def train_evaluate_predict(
    trainer,
    train_dataset,
    eval_datasets: dict,
    write_test_predictions: Callable[[object], None] | None = None,
    split_metrics: dict[str, Callable] | None = None,
    record: dict | None = None,
    extra_results: Callable[[dict], None] | None = None,
) -> dict:
    """The end of every recipe: train (``--resume_from_checkpoint`` honoured; skipped with ``--do_train false``), save
    the model and the Trainer state, evaluate on validation, predict on test (``write_test_predictions(output)`` on
    rank 0, with the ``PredictionOutput``), then write ``all_results.json`` once, atomically, on rank 0. Returns the
    results.

    ``split_metrics`` gives each split its own ``compute_metrics`` (the Trainer's is swapped in before that split
    is scored), for metrics that need the split's own data: every word of an NER sentence, the full reference
    summaries. ``record`` is stored in ``all_results.json`` as it is (data files, label list, truncation counts);
    ``extra_results(results)`` may add to the results first (pretraining: perplexities).
    """
    args = trainer.args
    results = {}
    if args.do_train:
        resume = resume_argument(args.resume_from_checkpoint)
        if resume is True and get_last_complete_checkpoint(args.output_dir, trainer.required_checkpoint_files) is None:
            raise DataError(
                None,
                None,
                f"--resume_from_checkpoint true: no complete checkpoint-N in {args.output_dir} (a run writes them "
                "with --save_steps N or --save_strategy epoch)",
            )
        train_result = trainer.train(resume_from_checkpoint=resume)
        exit_if_preempted(trainer)
        trainer.save_model()
        trainer.save_state()
        results.update(train_result.metrics)
        if hasattr(train_dataset, "__len__"):  # a stream (pretraining's --streaming) has no length
            results["train_samples"] = len(train_dataset)
    if "validation" in eval_datasets:
        if split_metrics and "validation" in split_metrics:
            trainer.compute_metrics = split_metrics["validation"]
        results.update(trainer.evaluate(eval_datasets["validation"]))
        results["eval_samples"] = len(eval_datasets["validation"])
    if "test" in eval_datasets:
        if split_metrics and "test" in split_metrics:
            trainer.compute_metrics = split_metrics["test"]
        output = trainer.predict(eval_datasets["test"], metric_key_prefix="test")
        results.update(output.metrics)
        results["test_samples"] = len(eval_datasets["test"])
        if trainer.is_world_process_zero() and write_test_predictions is not None:
            write_test_predictions(output)
    record = record or {}
    results.update({key: value for key, value in record.items() if isinstance(value, int | float)})
    if extra_results is not None:
        extra_results(results)
    trainer.log_metrics("all", results)
    results.update(record)
    if trainer.is_world_process_zero():
        write_json_atomic(Path(args.output_dir) / "all_results.json", results)
    return results


def exit_if_preempted(trainer, hint: str = "rerun with --resume_from_checkpoint true") -> None:
    """End the recipe if training was stopped early (a preemption signal or ``--max_time``): one line on rank 0
    (``stopped by SIGTERM at step 7; rerun with --resume_from_checkpoint true``) and exit status 75, with no final
    model, evaluation, predictions or ``all_results.json``: nothing that looks like a finished run. The checkpoint
    of the step it stopped at is complete."""
    if getattr(trainer, "preempted", None) is None:
        return
    if trainer.is_world_process_zero():
        print(describe_stop(trainer.preemption, hint), file=sys.stderr, flush=True)
    sys.exit(PREEMPTED_EXIT_CODE)


def data_record(splits: dict[str, tuple[list[dict], str]], labels: list[str] | None = None) -> dict:
    """What ``all_results.json`` records about the data: each split's source (file, demo or Hub split) and the
    label list in id order (``labels[i]`` is class ``i``)."""
    record = {"data_files": {split: source for split, (_, source) in splits.items() if split != "all"}}
    if labels is not None:
        record["label_list"] = list(labels)
    return record


def own_rows(array, n: int):
    """The first ``n`` rows of a split's gathered predictions / labels.

    A multi-process evaluation completes its last batch with repeated samples, which ``gather_for_metrics``
    normally drops; an evaluation inside the training loop (``eval_strategy``) can still bring them
    (accelerate's one ``GradientState`` for both dataloaders). They come after the split's own rows, in order.
    """
    if len(array) < n:
        raise RuntimeError(f"{len(array)} predictions for {n} examples")
    return array[:n]


def warn(message: str) -> None:
    """A warning on the main process only (a launched job with N processes shows it once)."""
    if is_main_process():
        logger.warning(message)


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write ``data`` as JSON through a temporary file and a rename, so a reader never sees a partial file.

    A NaN or an infinity (an undefined metric, such as a correlation of constant predictions) is written as
    ``null``: strict JSON has no such numbers, and Python's bare ``NaN`` breaks other readers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    text = json.dumps(_finite_or_null(data), indent=2, sort_keys=True, allow_nan=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _finite_or_null(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value
