"""``ema_decay`` / ``ema_warmup`` / ``ema_eval``: an exponential moving average of the weights, swapped in for
evaluation, prediction and the final model. Its math is :class:`nlp_tricks.functional.averaging.EMA`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..functional.averaging import EMA, validate_ema_decay
from ..runtime.averaging import EMA_STATE_NAME
from ..runtime.state import checkpoint_trick_states
from .base import BuiltInTrick

__all__ = ["EMATrick", "ExponentialMovingAverage", "EMAArguments"]


@dataclass
class EMAArguments:
    """An exponential moving average of the weights."""

    ema_decay: float = field(
        default=0.0,
        metadata={
            "help": "Exponential moving average of the weights, decay in [0, 1); 0 turns it off. After every "
            "optimizer step: ema = d_t * ema + (1 - d_t) * w over the trainable parameters (float32), "
            "d_t = min(ema_decay, (1 + t) / (10 + t)) with t the steps before it (see ema_warmup). Saved in every "
            "checkpoint. Typical: 0.99-0.9999 (the average spans about 1 / (1 - ema_decay) steps)."
        },
    )
    ema_warmup: bool = field(
        default=True,
        metadata={
            "help": "Warm the EMA decay up as min(ema_decay, (1 + t) / (10 + t)); false uses ema_decay from the "
            "first step (the average then leans on the starting weights for about 1 / (1 - ema_decay) steps)."
        },
    )
    ema_eval: bool | None = field(
        default=None,
        metadata={
            "help": "Evaluate, predict and save the final model (save_model) with the EMA weights; training goes on "
            "with the raw weights, restored bitwise. Default: true when ema_decay > 0."
        },
    )


class EMATrick(BuiltInTrick):
    """An :class:`~nlp_tricks.functional.averaging.EMA` built when training begins (from the weights training starts
    from), updated after every optimizer step, its tensors in the state store of every checkpoint and restored on
    resume; with ``ema_eval`` it is swapped in for evaluation, prediction and the final saved model (the raw weights
    come back bitwise)."""

    arguments = EMAArguments
    name = "EMA"
    order = 1100
    legacy_files = (EMA_STATE_NAME,)  # where checkpoints written before the state store kept the average
    # FSDP and ZeRO-3 shard the parameters: each process holds a slice, and an average of it would average
    # placeholders. DDP, DataParallel and ZeRO-1/2 keep whole, identical parameters on every process: each process
    # updates its own average from the same weights, with no communication.
    zero3 = False
    fsdp = False
    unsupported_reason = (
        "it shards the parameters and the EMA needs whole ones; train with DDP or DeepSpeed ZeRO-1/2, or set "
        "ema_decay=0"
    )

    def __init__(self, args):
        super().__init__(args)
        self.ema: EMA | None = None

    @classmethod
    def enabled(cls, args) -> bool:
        return args.ema_decay > 0

    @staticmethod
    def validate(args) -> None:
        validate_ema_decay(args.ema_decay, "ema_decay", allow_off=True)
        if args.ema_eval is None:
            args.ema_eval = args.ema_decay > 0
            # A default that follows ema_decay: derived again when the fields change (a search trial).
            getattr(args, "_derived", set()).add("ema_eval")
        elif args.ema_eval and args.ema_decay == 0:
            raise ValueError("ema_eval=True needs an EMA to evaluate: set ema_decay in (0, 1), e.g. 0.999")

    def summary(self) -> list[str]:
        return [f"ema_decay={self.args.ema_decay}" + (" (evaluated and saved)" if self.args.ema_eval else "")]

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # The model holds the weights training starts from (a resumed run: the checkpoint's, and then the saved
        # average is restored into this EMA right after).
        self.ema = EMA(model, self.args.ema_decay, warmup=self.args.ema_warmup)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.ema.update()

    def state_dict(self) -> dict:
        return {} if self.ema is None else self.ema.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.ema.load_state_dict(state)

    def legacy_state(self, legacy: dict) -> dict | None:
        """A checkpoint written before the state store kept the EMA in ``ema_state.safetensors``."""
        if legacy["ema_file"] is not None:
            self.ema.load(legacy["ema_file"])
        return None

    def eval_weights(self, trainer):
        return self.ema.swapped_in() if self.args.ema_eval and self.ema is not None else None

    def saved_weights_info(self, trainer) -> dict | None:
        if not self.args.ema_eval or self.ema is None:
            return None
        ema = self.ema
        return {"weights": "ema", "ema_decay": ema.decay, "ema_warmup": ema.warmup, "updates": ema.num_updates}

    def train_end(self, trainer) -> None:
        best = trainer.state.best_model_checkpoint
        if self.ema is not None and trainer.args.load_best_model_at_end and best:
            # The best checkpoint's raw weights are loaded upstream; its EMA goes with them.
            saved = (checkpoint_trick_states(best) or {}).get(self.state_name)
            if saved:
                self.ema.load_state_dict(saved, where=best)
            else:
                self.ema.load(os.path.join(best, EMA_STATE_NAME))


ExponentialMovingAverage = EMATrick  # its name before the built-ins were named <Flag>Trick
