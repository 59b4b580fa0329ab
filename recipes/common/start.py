"""The start every recipe's ``main`` shares: its arguments parsed, the seed set, its output folder made safe."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

from transformers import TrainingArguments, set_seed

from .arguments import DataArguments, ModelArguments
from .models import check_saved_crf, saved_crf_defaults
from .outputs import prepare_output_dir
from .parsing import parse_recipe_args
from .peft import check_peft_tricks
from .run import resume_argument
from .summary import remember_command


def start_recipe(
    argument_types: tuple,
    recipe: str,
    defaults: dict | None = None,
    *,
    description: str | None,
    dependent_defaults: tuple[str | Callable, dict] | list[tuple[str | Callable, dict]] | None = None,
    evidence_defaults: dict | None = None,
    evidence_unless: str | None = None,
    saved_crf_models: tuple[str, ...] = (),
    reads: tuple[str, ...] = ("model_name_or_path", "tokenizer_name"),
    resumes: bool = True,
    argv: list[str] | None = None,
) -> tuple:
    """Parse a recipe's command line and prepare its run; the parsed dataclasses, in the order of ``argument_types``.

    The command line is read by :func:`parse_recipe_args` (``recipe``, ``defaults``, ``description``: the recipe's
    docstring, ``dependent_defaults``, ``evidence_defaults``, ``evidence_unless`` and ``argv`` as it takes them).
    ``saved_crf_models`` names the model fields whose model, saved with ``--crf``, stays a CRF: ``--crf true`` unless
    given, and ``--crf false`` refused (:func:`saved_crf_defaults`, :func:`check_saved_crf`). Then the seed is set
    (``--seed``) and the output folder is prepared (:func:`prepare_output_dir`) against overwriting the models named
    by the ``reads`` fields of the model arguments; a recipe that ``resumes`` keeps its checkpoints there with
    ``--resume_from_checkpoint``. Every recipe's ``argument_types`` hold one ``DataArguments``, one
    ``ModelArguments`` and one ``TrainingArguments`` (sub)class.
    """
    if saved_crf_models:
        pairs = dependent_defaults if isinstance(dependent_defaults, list) else [dependent_defaults]
        dependent_defaults = [*(pair for pair in pairs if pair is not None), saved_crf_defaults(*saved_crf_models)]
    parsed = parse_recipe_args(
        argument_types,
        recipe,
        defaults,
        argv=argv,
        dependent_defaults=dependent_defaults,
        description=description,
        evidence_defaults=evidence_defaults,
        evidence_unless=evidence_unless,
    )
    data_args, model_args, training_args = (
        next(args for args in parsed if isinstance(args, kind))
        for kind in (DataArguments, ModelArguments, TrainingArguments)
    )
    if saved_crf_models:
        check_saved_crf(training_args, model_args)
    data_fields = {f.name for f in dataclasses.fields(data_args)} - {"overwrite_output_dir"}
    remember_command(recipe, list(sys.argv[1:] if argv is None else argv), data_fields)
    check_peft_tricks(model_args, training_args)
    set_seed(training_args.seed)
    prepare_output_dir(
        training_args.output_dir,
        data_args.overwrite_output_dir,
        resume_argument(training_args.resume_from_checkpoint) if resumes else None,
        reads=tuple(getattr(model_args, name) for name in reads),
    )
    return parsed
