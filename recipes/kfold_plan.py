"""What each model of a k-fold run trains for: the single model's number of optimizer steps (``--fold_steps
match``), its own seed, and (``--fold_select best``) the checkpoint its held-out fold scores best.

A fold model trains on (K - 1) / K of the training data. With the recipe's epochs it would take (K - 1) / K of the
single model's optimizer steps, and at the recipes' few epochs that is a less trained model, not only one that saw
less data: the ensemble would then be compared with a model trained longer. ``match`` gives every fold (and every
full-fit seed) ``--max_steps N``, N the steps the recipe takes on the whole training split with the same flags.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import NamedTuple

from kfold_data import strip_flags


class FoldJob(NamedTuple):
    """One training run of a k-fold run (a fold of round ``round``, or with round -1 the full-fit seed ``fold``):
    ``python script --output_dir run_dir <flags>`` in the environment ``env`` (None: this process's; the executor
    adds the run's threads and GPUs)."""

    round: int
    fold: int
    script: str
    run_dir: Path
    flags: list[str]
    env: dict | None = None


class FoldFailed(RuntimeError):
    """A fold's run ended without results (its folder holds its log)."""


FOLD_STEPS = ("match", "epochs")
FOLD_SELECT = ("last", "best")


def training_steps(training_args, examples: int, processes: int = 1) -> int:
    """The optimizer steps the recipe takes on ``examples`` training examples with these arguments, as
    ``transformers.Trainer`` counts them: ``--max_steps`` when given; else ``ceil(epochs * steps per epoch)``, a step
    per ``--gradient_accumulation_steps`` batches (a last, shorter group counts as one), batches of
    ``--per_device_train_batch_size`` on each of ``processes`` processes (the last one short, or dropped with
    ``--dataloader_drop_last``)."""
    if training_args.max_steps is not None and training_args.max_steps > 0:
        return int(training_args.max_steps)
    size = training_args.per_device_train_batch_size
    batches = examples // size if training_args.dataloader_drop_last else math.ceil(examples / size)
    per_process = math.ceil(batches / processes)
    accumulation = training_args.gradient_accumulation_steps
    per_epoch = max(per_process // accumulation + int(per_process % accumulation > 0), 1)
    return math.ceil(training_args.num_train_epochs * per_epoch)


def member_seed(seed: int, kind: str, index: int) -> int:
    """The seed of member ``index`` of ``kind`` (``"fold"``, ``"full_fit"``) of a run with ``--seed seed``: the first
    31 bits of ``sha256("{seed}/{kind}/{index}")``. Deterministic, a different one per member and per run seed (so
    members differ in their head's start, data order and dropout), and none is the run's own seed by design."""
    digest = hashlib.sha256(f"{seed}/{kind}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def member_flags(flags: list[str], seed: int, steps: int | None) -> list[str]:
    """``flags`` with the member's ``--seed`` and (``steps``) ``--max_steps`` in place of any given."""
    out = strip_flags(flags, ("seed", "max_steps") if steps is not None else ("seed",))
    out += ["--seed", str(seed)]
    if steps is not None:
        out += ["--max_steps", str(steps)]
    return out


def best_checkpoint_flags(training_args, metric: str) -> list[str]:
    """``--fold_select best``: evaluate on the held-out fold (the fold's validation file) as the recipe's
    ``--eval_strategy`` says (``epoch`` when it says ``no``), save a checkpoint at each evaluation and load the one
    with the best ``metric`` at the end (``--load_best_model_at_end``); the others are deleted
    (``--save_total_limit 1``: Trainer keeps the best and the last)."""
    strategy = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy))
    strategy = "epoch" if strategy == "no" else strategy
    flags = ["--eval_strategy", strategy, "--save_strategy", strategy]
    if strategy == "steps":
        every = str(training_args.eval_steps or training_args.logging_steps)
        flags += ["--eval_steps", every, "--save_steps", every]
    return flags + ["--load_best_model_at_end", "true", "--metric_for_best_model", metric, "--greater_is_better",
                    "true", "--save_total_limit", "1", "--save_only_model", "true"]  # fmt: skip
