"""The divergence guard: a non-finite training loss, gradient norm or weight stops training at that step, and nothing
of it is written as finished.

Upstream's Trainer trains on through NaN: ``logging_nan_inf_filter`` (on by default) logs a NaN step as the mean of
the others, so ``train_loss`` looks fine, and the final model and every later checkpoint hold NaN weights that resume
picks as complete. :class:`DivergenceGuard` reads what that filter hides: the raw loss of every micro-batch (the value
``training_step`` returns) and the gradient norm the Trainer computes before each optimizer step. On a non-finite
one, before the optimizer step:

- by default the step's gradients are dropped (the weights stay those of the previous step), training stops at that
  step without an evaluation or a checkpoint, and ``train()`` raises :class:`TrainingDivergedError`, one line naming
  the step, the loss and what to try; the recipes exit with :data:`DIVERGED_EXIT_CODE`;
- with ``max_nonfinite_steps=N`` the first N such steps are skipped instead (gradients dropped, no optimizer step;
  the learning-rate schedule moves on), counted in ``trick_state["nonfinite_steps_skipped"]`` (so in every training
  log and checkpoint), and the next one stops training as above.

Under fp16 loss scaling a step whose gradient norm is non-finite is the grad scaler's: it skips the step and lowers
its scale, so the guard leaves it alone. The weights themselves are checked (one pass over the parameters) before
every checkpoint save and at the end of training: a step with a finite loss can still overflow them (an enormous
learning rate), and such weights are never saved as a checkpoint nor left as a finished model. Under DDP every
process takes the same decision: the per-process flags are combined in one all-reduce per optimizer step.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

__all__ = [
    "DIVERGED_EXIT_CODE",
    "NONFINITE_SKIPPED",
    "DivergenceGuard",
    "TrainingDivergedError",
    "install_divergence_guard",
    "nonfinite_parameters",
    "validate_divergence_arguments",
]

logger = logging.getLogger(__name__)

# Not 1 (a failed run: bad data, a bug's traceback), 2 (bad arguments) or 75 (preempted: retry the same command):
# rerunning a diverged run unchanged diverges again.
DIVERGED_EXIT_CODE = 3
# The trick_state entry of the skipped steps (logged, saved with checkpoints, restored on resume).
NONFINITE_SKIPPED = "nonfinite_steps_skipped"

# Codes of one check, combined over processes by their maximum.
_FINITE, _INF, _NAN = 0, 1, 2
_NAMES = {_INF: "inf", _NAN: "nan"}
# Elements checked per kernel: bounds the temporary memory of a huge parameter (an embedding).
_CHUNK = 1 << 26
_MAX_NAMED = 3


class TrainingDivergedError(RuntimeError):
    """Training stopped at a non-finite loss, gradient norm or weight; ``str()`` is one line, ``step`` the step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


@dataclass
class RunSafetyArguments:
    """The divergence guard (docs/checkpoints.md, "What is refused and why")."""

    stop_on_nonfinite: bool = field(
        default=True,
        metadata={
            "help": "Stop training at the first step whose loss or gradient norm is NaN or infinite, before its "
            "optimizer step, and never save non-finite weights: train() raises TrainingDivergedError, one line "
            "naming the step (the recipes exit with status 3, writing no model or all_results.json), and the last "
            "checkpoint stays the good one resume picks. Under fp16 a step the grad scaler skips is not counted. "
            "False: train on as upstream does."
        },
    )
    max_nonfinite_steps: int = field(
        default=0,
        metadata={
            "help": "Skip up to N non-finite steps instead of stopping (>= 0): their gradients are dropped and "
            "their optimizer step is not taken (the learning-rate schedule moves on); the count is logged as "
            "nonfinite_steps_skipped. The next one stops training. 0: stop at the first."
        },
    )


def validate_divergence_arguments(args) -> None:
    """The guard's fields: ``max_nonfinite_steps`` >= 0, and only with ``stop_on_nonfinite``."""
    if args.max_nonfinite_steps < 0:
        raise ValueError(
            f"max_nonfinite_steps={args.max_nonfinite_steps} is not allowed; it must be >= 0 (0: stop at the first "
            "non-finite step)"
        )
    if args.max_nonfinite_steps > 0 and not args.stop_on_nonfinite:
        raise ValueError(
            f"max_nonfinite_steps={args.max_nonfinite_steps} needs stop_on_nonfinite=True (the guard that finds the "
            "non-finite steps)"
        )


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s parameters holding a NaN or an infinity (this process's shard under FSDP / ZeRO-3);
    one host synchronisation for the whole model."""
    names, flags = [], []
    for name, param in model.named_parameters():
        shard = getattr(param, "ds_tensor", None)  # DeepSpeed ZeRO-3: the parameter itself is an empty stand-in
        tensor = (param if shard is None else shard).detach()
        if hasattr(tensor, "to_local"):  # a DTensor (FSDP2): its local shard
            tensor = tensor.to_local()
        if tensor.numel() == 0 or tensor.is_meta or not tensor.is_floating_point():
            continue
        flat = tensor.reshape(-1)
        finite = torch.stack([torch.isfinite(chunk).all() for chunk in flat.split(_CHUNK)]).all()
        names.append(name)
        flags.append(finite.to(flags[0].device) if flags else finite)
    if not flags:
        return []
    finite = torch.stack(flags).tolist()
    return [name for name, ok in zip(names, finite) if not ok]


def _code(values: torch.Tensor) -> torch.Tensor:
    """0 all finite, 1 an infinity, 2 a NaN (a 0-d int tensor, on ``values``' device)."""
    values = values.detach().float()
    return torch.where(torch.isnan(values).any(), _NAN, torch.where(torch.isinf(values).any(), _INF, _FINITE)).int()


class DivergenceGuard(TrainerCallback):
    """Stops (or skips up to ``max_nonfinite_steps``) training steps with a non-finite loss or gradient norm, and
    refuses to save non-finite weights; see the module's docstring. Installed by :func:`install_divergence_guard`.

    The trainer feeds it: :meth:`record_loss` with each micro-batch's loss, :meth:`record_grad_norm` with the norm
    it computes before the optimizer step. After ``train()``, :meth:`raise_if_diverged`.

    Args:
        trainer: the Trainer it watches (its optimizer, grad scaler, model and arguments).
        enabled (`bool`, defaults to ``True``): ``False`` checks nothing (upstream's behaviour).
        max_nonfinite_steps (`int`, defaults to 0): how many non-finite steps to skip before stopping.
    """

    def __init__(self, trainer, enabled: bool = True, max_nonfinite_steps: int = 0):
        self.trainer = trainer
        self.enabled = enabled
        self.max_nonfinite_steps = max_nonfinite_steps
        #: After a stop: the one line :meth:`raise_if_diverged` raises; ``None`` otherwise.
        self.diverged: str | None = None
        self.diverged_step: int | None = None
        self._losses: list[torch.Tensor] = []
        self._grad_norm = None
        self._stop_after_step = False
        self._checked_step: int | None = None  # the step whose weights were last checked

    # -- fed by the trainer --

    def record_loss(self, loss: torch.Tensor) -> None:
        """Note one micro-batch's training loss (the raw value, before any logging filter)."""
        if self.enabled and torch.is_tensor(loss):
            self._losses.append(loss.detach().reshape(-1))

    def record_grad_norm(self, grad_norm) -> None:
        """Note the step's gradient norm (a tensor, a float or ``None`` where the backend reports none)."""
        if self.enabled:
            self._grad_norm = grad_norm

    def raise_if_diverged(self) -> None:
        """Raise :class:`TrainingDivergedError` if the last ``train()`` stopped at a non-finite step."""
        if self.diverged is not None:
            raise TrainingDivergedError(self.diverged, self.diverged_step)

    # -- events --

    def on_train_begin(self, args, state, control, **kwargs):
        self.diverged = self.diverged_step = None
        self._stop_after_step = False
        self._checked_step = None
        self._losses.clear()
        self._grad_norm = None
        if self.enabled and self.max_nonfinite_steps > 0:
            self.trainer.trick_state.setdefault(NONFINITE_SKIPPED, 0)  # logged from the first log on

    def on_step_begin(self, args, state, control, **kwargs):
        self._losses.clear()
        self._grad_norm = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.enabled:
            return
        loss_code, grad_code = self._step_codes(args)
        self._losses.clear()
        if loss_code == _FINITE and grad_code == _FINITE:
            return
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if grad_code != _FINITE and scaler is not None and scaler.is_enabled():
            return  # fp16 loss scaling: the scaler skips this step and lowers its scale
        step = state.global_step + 1
        # Dropped either way: the optimizer step must not apply them (torch's optimizers skip a parameter without one).
        self.trainer.optimizer.zero_grad(set_to_none=True)
        what = self._describe(loss_code, grad_code)
        skipped = int(self.trainer.trick_state.get(NONFINITE_SKIPPED, 0))
        if skipped < self.max_nonfinite_steps:
            self.trainer.trick_state[NONFINITE_SKIPPED] = skipped + 1
            logger.warning(
                f"step {step}: {what}; skipped its optimizer step ({skipped + 1} of --max_nonfinite_steps "
                f"{self.max_nonfinite_steps})"
            )
            return
        self._stop(step, f"{what} (the weights were left as they were before this step)", args, control)
        self._stop_after_step = True

    def on_step_end(self, args, state, control, **kwargs):
        if not self.enabled:
            return
        if self._stop_after_step:
            self._halt(control)
            return
        if control.should_save:
            self._check_weights(args, state, control, "before saving")

    def on_epoch_end(self, args, state, control, **kwargs):
        if not self.enabled:
            return
        if self.diverged is not None:
            self._halt(control)  # the end of the epoch would save and evaluate the step training stopped at
        elif control.should_save:
            self._check_weights(args, state, control, "before saving")

    def on_save(self, args, state, control, **kwargs):
        # Saves decided where no callback sees them first (save_strategy="best", after an evaluation).
        if not self.enabled or self._checked_step == state.global_step:
            return
        if self._check_weights(args, state, control, "in the checkpoint just saved"):
            return
        run_dir = self.trainer._get_output_dir(trial=getattr(self.trainer, "_trial", None))
        folder = os.path.join(run_dir, f"checkpoint-{state.global_step}")
        if args.should_save and os.path.isdir(folder):
            shutil.rmtree(folder, ignore_errors=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.enabled and self.diverged is None and self._checked_step != state.global_step:
            self._check_weights(args, state, control, "at the end of training")

    # -- helpers --

    def _step_codes(self, args) -> tuple[int, int]:
        """The step's loss and gradient-norm codes, the maximum over processes (one all-reduce)."""
        device = args.device
        loss = _code(torch.cat(self._losses)) if self._losses else torch.tensor(_FINITE, dtype=torch.int32)
        norm = self._grad_norm
        if norm is None:
            grad = torch.tensor(_FINITE, dtype=torch.int32)
        else:
            grad = _code(norm if torch.is_tensor(norm) else torch.tensor(float(norm)))
        codes = torch.stack([loss.to(device), grad.to(device)])
        if _distributed(args):
            torch.distributed.all_reduce(codes, op=torch.distributed.ReduceOp.MAX)
        loss_code, grad_code = codes.tolist()
        return loss_code, grad_code

    def _describe(self, loss_code: int, grad_code: int) -> str:
        parts = []
        if loss_code != _FINITE:
            parts.append(f"the loss is {_NAMES[loss_code]}")
        if grad_code != _FINITE:
            parts.append(f"the gradient norm is {_NAMES[grad_code]}")
        else:
            norm = self._grad_norm
            if norm is not None:
                parts.append(f"the gradient norm is {float(norm):.4g}")
        return " and ".join(parts)

    def _check_weights(self, args, state, control, when: str) -> bool:
        """Whether every weight is finite (all processes agree); if not, training stops as diverged."""
        self._checked_step = state.global_step
        bad = nonfinite_parameters(self.trainer.model)
        flag = torch.tensor([int(bool(bad))], dtype=torch.int32, device=args.device)
        if _distributed(args):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if not flag.item():
            return True
        named = ", ".join(bad[:_MAX_NAMED]) + (", ..." if len(bad) > _MAX_NAMED else "")
        where = f" ({named})" if bad else " (on another process)"
        self._stop(state.global_step, f"the weights are not finite {when}{where}", args, control)
        self._halt(control)
        return False

    def _stop(self, step: int, what: str, args, control) -> None:
        hints = [f"a lower --learning_rate (now {args.learning_rate:g})"]
        if not args.max_grad_norm or args.max_grad_norm <= 0 or not math.isfinite(args.max_grad_norm):
            hints.append("--max_grad_norm 1.0 (now off)")
        else:
            hints.append(f"a lower --max_grad_norm (now {args.max_grad_norm:g})")
        if args.fp16:
            hints.append("--bf16 instead of --fp16")
        if self.max_nonfinite_steps == 0:
            hints.append("--max_nonfinite_steps N to skip up to N such steps")
        hints = ", ".join(hints[:-1]) + f" or {hints[-1]}"
        self.diverged_step = step
        self.diverged = f"training diverged at step {step}: {what}; nothing of this step was saved. Try {hints}"

    @staticmethod
    def _halt(control) -> None:
        control.should_training_stop = True
        control.should_save = False
        control.should_evaluate = False


def _distributed(args) -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and args.world_size > 1


def install_divergence_guard(trainer) -> DivergenceGuard:
    """Add a :class:`DivergenceGuard` set from ``trainer.args`` (``stop_on_nonfinite``, ``max_nonfinite_steps``;
    on, stopping at the first non-finite step, where the arguments lack them) to ``trainer``, and return it.

    Add it after the callbacks that decide on saving (upstream's flow, the preemption stop): it sees their decision
    at each step's end and can overrule it. Skipping steps needs an optimizer step the guard can empty, which
    DeepSpeed (it steps inside its backward) does not offer: refused there.
    """
    args = trainer.args
    enabled = bool(getattr(args, "stop_on_nonfinite", True))
    max_skipped = int(getattr(args, "max_nonfinite_steps", 0))
    if max_skipped > 0 and getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(
            f"max_nonfinite_steps={max_skipped} cannot skip a step under DeepSpeed (its engine steps inside the "
            "backward); set it to 0 (stop at the first non-finite step) or train without DeepSpeed"
        )
    guard = DivergenceGuard(trainer, enabled=enabled, max_nonfinite_steps=max_skipped)
    trainer.add_callback(guard)
    return guard
