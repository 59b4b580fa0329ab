"""A recipe's ``--help``: its docstring's opening, then the flags in groups (data, model, ..., tricks, Trainer)."""

from __future__ import annotations

import argparse
import dataclasses

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from .peft import PeftArguments


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its command lines stay lines); each flag's help with its default."""


def description_of(docstring: str | None) -> str | None:
    """A recipe docstring's opening: what it does and its command lines, up to the "Features:" list."""
    if not docstring:
        return None
    return docstring.split("\nFeatures:")[0].strip()


def as_flags(values: dict) -> list[str]:
    """``{"crf": True}`` -> ``["--crf true"]``: values as they are typed on the command line."""
    return [f"--{name} {str(value).lower() if isinstance(value, bool) else value}" for name, value in values.items()]


# Titles of the --help groups, by the dataclass a flag comes from (its docstring's first line describes the group).
GROUP_TITLES = (("DataArguments", "data"), ("ModelArguments", "model"), ("SelfTrainingArguments", "self-training"))


def group_arguments(parser: argparse.ArgumentParser, dataclass_types: tuple) -> None:
    """Move every flag from argparse's one flat list into a group per dataclass; the ``TrainingArguments``
    subclass splits into the tricks (fields it adds, ``TricksArguments``') and the Trainer's own fields."""
    actions: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        actions.setdefault(action.dest, []).append(action)
    for dtype in dataclass_types:
        for title, text, names in _groups_of(dtype):
            group = parser.add_argument_group(title, text)
            for name in names:
                for action in actions.get(name, []):
                    for other in parser._action_groups:
                        if action in other._group_actions:
                            other._group_actions.remove(action)
                    group._group_actions.append(action)


def _groups_of(dtype) -> list[tuple[str, str | None, list[str]]]:
    """``(title, description, field names)`` of the --help groups one dataclass's flags go into."""
    names = [f.name for f in dataclasses.fields(dtype) if f.init]
    if issubclass(dtype, TrainingArguments):
        trainer_fields = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
        return [
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
    bases = [cls.__name__ for cls in dtype.__mro__]
    title = next((t for name, t in GROUP_TITLES if name in bases), dtype.__name__.removesuffix("Arguments"))
    doc = (dtype.__doc__ or "").strip().splitlines()
    groups = [(title, doc[0] if doc and not doc[0].startswith(dtype.__name__ + "(") else None, names)]
    if issubclass(dtype, PeftArguments):  # the LoRA flags in a group of their own, after the model's
        peft_names = {f.name for f in dataclasses.fields(PeftArguments)}
        groups = [
            (title, groups[0][1], [n for n in names if n not in peft_names]),
            ("LoRA / PEFT", PeftArguments.__doc__.strip().splitlines()[0], [n for n in names if n in peft_names]),
        ]
    return groups


def describe_run_flags(actions: dict, evidence_defaults: dict, evidence_unless: str | None) -> None:
    """The help of the flags whose meaning the recipes give: ``--tricks`` (with this recipe's defaults),
    ``--resume_from_checkpoint`` and ``--enable_jit_checkpoint``. ``actions``: each flag's argparse action."""
    if "resume_from_checkpoint" in actions:
        actions["resume_from_checkpoint"].help = (
            "Resume training: 'true' picks the newest COMPLETE checkpoint-N in --output_dir (a folder a crash left "
            "half-written is skipped with a warning), or give a checkpoint folder. Checkpoints are written with "
            "--save_steps N (or --save_strategy epoch), and by a run stopped by SIGTERM or --max_time."
        )
    actions["tricks"].help += (
        " This recipe's: "
        + (", ".join(as_flags(evidence_defaults)) or "none yet")
        + (f" (not with --{evidence_unless})" if evidence_defaults and evidence_unless else "")
        + "."
    )
    if "enable_jit_checkpoint" in actions:
        actions["enable_jit_checkpoint"].help = (
            "On SIGTERM or SIGUSR1 (a preemption: Kubernetes, SLURM's --signal, spot instances), finish the current "
            "optimizer step, save a complete checkpoint-N of it and exit with status 75; rerun with "
            "--resume_from_checkpoint true. On by default in the recipes; false lets the signal end the run at once."
        )


def flag_help(dtype) -> dict[str, str]:
    """The ``FLAG_HELP`` texts of a dataclass and of its bases (``{field: help}``), a subclass's winning over its
    bases' as a redefined field would."""
    merged: dict[str, str] = {}
    for cls in reversed(dtype.__mro__):
        merged.update(vars(cls).get("FLAG_HELP", {}))
    return merged
