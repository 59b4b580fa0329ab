"""A recipe's command line (and config file), parsed once into its argument dataclasses."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable

import torch
from transformers import HfArgumentParser, TrainingArguments

from nlp_tricks.runtime.preemption import set_time_budget

from .arguments import RunArguments
from .config_file import flag_actions, is_config_file, read_config_file
from .help import HelpFormatter, as_flags, describe_run_flags, description_of, flag_help, group_arguments
from .process import warn
from .threads import has_accelerator
from .user_tricks import TrickError, attach_user_tricks, config_trick_specs, load_user_tricks, trick_specs

# `--logging_steps` unless given: a share of the run's steps (the Trainer reads a value below 1 so), about 50 points
# however long the run, so that a 30-step run on a user's file still plots its loss and learning rate.
LOGGING_SHARE = 0.02
# `--eval_steps` unless given, with `--eval_strategy steps`: the Trainer would take the logging interval (50
# evaluations a run).
EVAL_SHARE = 0.1


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
    known name, and each value is checked as the same value after its flag would be. ``defaults`` replace the
    dataclasses' own defaults (e.g. the recipe's learning rate); ``output_dir`` defaults to ``outputs/<recipe>``,
    ``report_to`` to ``none`` and ``do_train`` to true (``--do_train false`` evaluates the model as it is).
    ``dependent_defaults`` ``(field, {value: {name: default}})`` picks more defaults by the parsed value of ``field``
    (self-training's task), unless given; ``field`` may be a function of the parsed namespace instead (pretraining:
    whether the demo is used; NER: whether the model holds a CRF); a list of such pairs applies each.
    ``evidence_defaults`` (``{name: value}``) are the tricks the recipe turns on by default, unless given, ``--tricks
    none`` or the boolean flag ``evidence_unless`` is on (where the evidence was not measured); when they do not
    combine with a flag the user gave, they are left off with a warning (what the user asked for wins). ``--save_steps
    N`` without ``--save_strategy`` saves every N steps. ``--help`` opens with ``description`` (the recipe's docstring
    up to its "Features:") and lists the flags in groups: data, model (and any other dataclass of the recipe), tricks
    (``TricksArguments``' own fields), Trainer (``TrainingArguments``). A value the arguments reject (a float flag
    refuses ``nan`` and ``inf``) prints one line (the error and a pointer to ``--help``, without the usage block) and
    exits with status 2, as argparse does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    evidence_defaults = evidence_defaults or {}
    tricks = _user_tricks(recipe, dataclass_types, argv)
    trick_types = tuple(trick.arguments for trick in tricks if trick.arguments is not None)
    parser = recipe_parser((*dataclass_types, *trick_types), recipe, description, evidence_defaults, evidence_unless)
    from_file = {}
    if argv and is_config_file(argv[0]):
        from_file = read_config_file(parser, argv.pop(0), (*dataclass_types, *trick_types, RunArguments))
    parser.set_defaults(**{**run_defaults(recipe, defaults), **from_file})
    namespace = parser.parse_args(argv)
    given = set(from_file) | flags_given(parser, argv)
    apply_dependent_defaults(namespace, dependent_defaults, given)
    if getattr(namespace, "eval_steps", 0) is None and "logging_steps" not in given:
        # --load_best_model_at_end saves at evaluations: a share cannot be kept a divisor of whole save steps.
        whole_saves = namespace.load_best_model_at_end and namespace.save_steps >= 1
        namespace.eval_steps = namespace.save_steps if whole_saves else EVAL_SHARE
    if "save_steps" in given and "save_strategy" not in given and hasattr(namespace, "save_strategy"):
        namespace.save_strategy = "steps"
    try:
        set_time_budget(namespace.max_time)
    except ValueError as err:
        parser.error(f"--max_time: {err}")
    evidence_on = namespace.tricks == "default" and not (evidence_unless and getattr(namespace, evidence_unless))
    applied = {n: v for n, v in evidence_defaults.items() if evidence_on and n not in given}
    try:
        parsed = build_with_evidence_defaults(namespace, (*dataclass_types, *trick_types), applied)
        training_args = next(args for args in parsed if isinstance(args, TrainingArguments))
        attach_user_tricks(training_args, tricks, parsed[len(dataclass_types) :])
    except ValueError as err:
        parser.error(str(err).splitlines()[0] if str(err) else type(err).__name__)
    return parsed[: len(dataclass_types)]


def _user_tricks(recipe: str, dataclass_types: tuple, argv: list[str]) -> list:
    """The ``--trick`` classes of the command line (else of its config file), loaded before the parser is built, as
    their fields are flags; a bad one is one line and exit 2, as argparse's errors."""
    specs = trick_specs(argv) or (config_trick_specs(argv[0]) if argv and is_config_file(argv[0]) else [])
    taken = {f.name for dtype in (*dataclass_types, RunArguments) for f in dataclasses.fields(dtype)}
    try:
        return load_user_tricks(specs, taken)
    except TrickError as err:
        _exit_with(f"{recipe}.py", str(err))


def run_defaults(recipe: str, defaults: dict | None) -> dict:
    """Every recipe's defaults (its own ``defaults`` win): outputs/<recipe>, no reporting, training on, a checkpoint
    on preemption, the loss logged at the first step and then about 50 times a run, and no pinned memory without an
    accelerator (where torch warns that it has nothing to pin for)."""
    defaults = {
        "output_dir": f"outputs/{recipe}",
        "report_to": "none",
        "do_train": True,
        "enable_jit_checkpoint": True,
        "logging_steps": LOGGING_SHARE,
        "logging_first_step": True,
        **(defaults or {}),
    }
    if not has_accelerator():
        defaults.setdefault("dataloader_pin_memory", False)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        # A launched multi-process job without GPUs (`accelerate launch --multi_gpu` on CPUs): accelerate forms the
        # CPU (gloo) process group only with use_cpu; without it every process would train alone on all the data.
        defaults.setdefault("use_cpu", True)
    return defaults


def recipe_parser(
    dataclass_types: tuple, recipe: str, description: str | None, evidence_defaults: dict, evidence_unless: str | None
) -> HfArgumentParser:
    """The parser of a recipe's flags, its ``--help`` in groups, its errors on one line."""
    parser = HfArgumentParser(
        (*dataclass_types, RunArguments),
        prog=f"{recipe}.py",
        usage="%(prog)s [CONFIG.yaml] [--FLAG VALUE ...]",  # argparse's own lists every flag: hundreds of lines
        description=description_of(description),
        formatter_class=HelpFormatter,
    )
    parser.allow_abbrev = False  # `flags_given` reads the flags as typed
    # The run's own flags (--max_time) between the recipe's and the trainer's groups.
    trainer_types = tuple(t for t in dataclass_types if issubclass(t, TrainingArguments))
    others = tuple(t for t in dataclass_types if t not in trainer_types)
    group_arguments(parser, (*others, RunArguments, *trainer_types))
    parser.error = functools.partial(_one_line_error, parser)
    actions = flag_actions(parser)
    describe_run_flags(actions, evidence_defaults, evidence_unless)
    for dtype in dataclass_types:
        for name, text in flag_help(dtype).items():
            actions[name].help = text
    for action in parser._actions:
        if action.type is float:
            action.type = finite_float
    return parser


def finite_float(text: str) -> float:
    """argparse's ``float`` without ``nan`` / ``inf``, which no float flag of a recipe means (a learning rate of
    ``nan`` trains nothing and fails deep in the optimizer)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


finite_float.__name__ = "float"  # argparse names the type in its message: "invalid float value: 'nan'"


def _one_line_error(parser, message: str):
    """argparse's error without the usage block (hundreds of flags): the error and where to read about the flags."""
    _exit_with(parser.prog, message)


def _exit_with(prog: str, message: str):
    sys.stderr.write(f"{prog}: error: {message} (see {prog} --help)\n")
    sys.exit(2)


def flags_given(parser, argv: list[str]) -> set[str]:
    """The destinations of the flags typed in ``argv`` (``--name value`` or ``--name=value``)."""
    return {
        action.dest
        for action in parser._actions
        for option in action.option_strings
        if any(arg == option or arg.startswith(option + "=") for arg in argv)
    }


def apply_dependent_defaults(namespace, dependent_defaults, given: set[str]) -> None:
    """Set the defaults that depend on a parsed value (see :func:`parse_recipe_args`), except those ``given``."""
    if dependent_defaults is None:
        return
    pairs = dependent_defaults if isinstance(dependent_defaults, list) else [dependent_defaults]
    for key, by_value in pairs:
        value_of_key = key(namespace) if callable(key) else getattr(namespace, key)
        for name, value in by_value.get(value_of_key, {}).items():
            if name not in given:
                setattr(namespace, name, value)


def build_with_evidence_defaults(namespace, dataclass_types: tuple, applied: dict) -> tuple:
    """The dataclasses from ``namespace`` with the recipe's evidence defaults ``applied``; when those do not combine
    with what the user gave (a ``ValueError`` from the dataclasses), without them and with a warning."""
    plain = {name: getattr(namespace, name) for name in applied}
    for name, value in applied.items():
        setattr(namespace, name, value)
    try:
        return _build(namespace, dataclass_types)
    except ValueError as err:
        if not applied:
            raise
        for name, value in plain.items():  # what the user gave wins over the recipe's defaults
            setattr(namespace, name, value)
        parsed = _build(namespace, dataclass_types)
        flags = " ".join(as_flags(applied))
        warn(f"{flags} (this recipe's default, --tricks default) is left off: {str(err).splitlines()[0]}")
        return parsed


def _build(namespace, dataclass_types: tuple) -> tuple:
    return tuple(
        dtype(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(dtype) if f.init})
        for dtype in dataclass_types
    )
