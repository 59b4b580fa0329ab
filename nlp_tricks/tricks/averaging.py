"""``ema_decay`` / ``ema_eval`` and ``swa_last_k``: weight averages that choose the weights evaluated and saved.
Their math is in :mod:`nlp_tricks.averaging`."""

from __future__ import annotations

import logging
import os

from ..runtime.averaging import (
    EMA,
    EMA_STATE_NAME,
    EMACallback,
    average_into,
    ema_unsupported_reason,
    last_complete_checkpoints,
    validate_ema_decay,
)
from .base import Trick

__all__ = ["ExponentialMovingAverage", "CheckpointAveraging"]

logger = logging.getLogger(__name__)


class ExponentialMovingAverage(Trick):
    """An :class:`~nlp_tricks.averaging.EMA` updated after every optimizer step (an :class:`EMACallback`), saved in
    every checkpoint (``ema_state.safetensors``) and restored on resume; with ``ema_eval`` it is swapped in for
    evaluation, prediction and the final saved model (the raw weights come back bitwise)."""

    def __init__(self, args):
        self.args = args
        self.callback = EMACallback(args.ema_decay, warmup=args.ema_warmup)

    @classmethod
    def from_args(cls, args) -> ExponentialMovingAverage | None:
        return cls(args) if args.ema_decay > 0 else None

    @staticmethod
    def validate(args) -> None:
        validate_ema_decay(args.ema_decay, "ema_decay", allow_off=True)
        if args.ema_eval is None:
            args.ema_eval = args.ema_decay > 0
        elif args.ema_eval and args.ema_decay == 0:
            raise ValueError("ema_eval=True needs an EMA to evaluate: set ema_decay in (0, 1), e.g. 0.999")

    def summary(self) -> list[str]:
        return [f"ema_decay={self.args.ema_decay}" + (" (evaluated and saved)" if self.args.ema_eval else "")]

    @property
    def ema(self) -> EMA | None:
        return self.callback.ema

    def setup(self, trainer) -> None:
        problem = ema_unsupported_reason(trainer)
        if problem is not None:
            raise ValueError(problem)

    # The trick is the trainer's callback: its EMACallback's events run through it.
    def on_train_begin(self, args, state, control, **kwargs):
        self.callback.on_train_begin(args, state, control, **kwargs)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.callback.on_optimizer_step(args, state, control, **kwargs)

    def eval_weights(self, trainer):
        return self.ema.swapped_in() if self.args.ema_eval and self.ema is not None else None

    def saved_weights_info(self, trainer) -> dict | None:
        if not self.args.ema_eval or self.ema is None:
            return None
        ema = self.ema
        return {"weights": "ema", "ema_decay": ema.decay, "ema_warmup": ema.warmup, "updates": ema.num_updates}

    def save_checkpoint(self, trainer, folder: str) -> None:
        if self.ema is not None:
            self.ema.save(os.path.join(folder, EMA_STATE_NAME))

    def checkpoint_files(self, trainer) -> tuple[str, ...]:
        return (EMA_STATE_NAME,)

    def resume(self, trainer, checkpoint: str | None) -> None:
        self.callback.resume_from = checkpoint

    def train_end(self, trainer) -> None:
        if self.ema is not None and trainer.args.load_best_model_at_end and trainer.state.best_model_checkpoint:
            # The best checkpoint's raw weights are loaded upstream; its EMA goes with them.
            self.ema.load(os.path.join(trainer.state.best_model_checkpoint, EMA_STATE_NAME))


class CheckpointAveraging(Trick):
    """``swa_last_k``: at the end of training the model holds the uniform average of the K newest complete
    checkpoints (stochastic weight averaging over the last saves)."""

    def __init__(self, args):
        self.args = args
        self.checkpoints: list[str] | None = None

    @classmethod
    def from_args(cls, args) -> CheckpointAveraging | None:
        return cls(args) if args.swa_last_k > 0 else None

    @staticmethod
    def validate(args) -> None:
        k = args.swa_last_k
        if int(k) != k or k < 0:
            raise ValueError(f"swa_last_k={k} is not allowed; it must be an integer >= 0 (0: off)")
        if k == 0:
            return
        if getattr(args.save_strategy, "value", args.save_strategy) == "no":
            raise ValueError(
                f"swa_last_k={k} averages saved checkpoints, but save_strategy='no'; choose save_strategy 'steps' or "
                "'epoch'"
            )
        if args.save_total_limit is not None and args.save_total_limit < k:
            raise ValueError(
                f"swa_last_k={k} needs that many checkpoints, but save_total_limit={args.save_total_limit} deletes "
                f"older ones; set save_total_limit >= {k} or none"
            )

    def summary(self) -> list[str]:
        return [f"swa_last_k={self.args.swa_last_k}"]

    def resume(self, trainer, checkpoint: str | None) -> None:
        self.checkpoints = None

    def saved_weights_info(self, trainer) -> dict | None:
        if self.checkpoints is None:
            return None
        return {"weights": "swa", "checkpoints": [os.path.basename(p) for p in self.checkpoints]}

    def train_end(self, trainer) -> None:
        k = self.args.swa_last_k
        trainer.accelerator.wait_for_everyone()  # the main process may still be writing the last checkpoint
        paths = last_complete_checkpoints(trainer.args.output_dir, k, max_step=trainer.state.global_step)
        if not paths:
            logger.warning(f"swa_last_k={k}: no complete checkpoint in {trainer.args.output_dir}; skipped")
            return
        if len(paths) < k:
            logger.warning(f"swa_last_k={k} but only {len(paths)} complete checkpoints exist; averaging those")
        average_into(trainer.model, paths)
        self.checkpoints = paths
        logger.info(f"swa_last_k: the model now holds the average of {', '.join(paths)}")
