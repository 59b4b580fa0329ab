"""``swa_last_k``: at the end of training the model holds the uniform average of the last K complete checkpoints.
Its math is :func:`nlp_tricks.runtime.averaging.average_into`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from ..functional.models import unwrap_model
from ..runtime.averaging import average_into, last_complete_checkpoints
from .base import BuiltInTrick

__all__ = ["SWATrick", "CheckpointAveraging", "SWAArguments"]

logger = logging.getLogger(__name__)


@dataclass
class SWAArguments:
    """Stochastic weight averaging over the last saves."""

    swa_last_k: int = field(
        default=0,
        metadata={
            "help": "At the end of training, load the uniform average of the K newest complete checkpoints into the "
            "model (stochastic weight averaging over the last saves); 0 turns it off. Needs save_strategy "
            "'steps' or 'epoch' and save_total_limit >= K (or none)."
        },
    )


class SWATrick(BuiltInTrick):
    """``swa_last_k``: at the end of training the model holds the uniform average of the K newest complete
    checkpoints (stochastic weight averaging over the last saves)."""

    arguments = SWAArguments
    order = 1200

    def __init__(self, args):
        super().__init__(args)
        self.checkpoints: list[str] | None = None

    @classmethod
    def enabled(cls, args) -> bool:
        return args.swa_last_k > 0

    @staticmethod
    def validate(args) -> None:
        k = args.swa_last_k
        if int(k) != k or k < 0:
            raise ValueError(f"swa_last_k={k} is not allowed; it must be an integer >= 0 (0: off)")
        if k == 0 or not hasattr(args, "save_strategy"):  # TricksConfig alone: checked again with the host's args
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

    def setup(self, trainer) -> None:
        if trainer.model is None:
            return
        model = unwrap_model(trainer.model, peft=True)
        if not isinstance(model, PreTrainedModel):
            raise ValueError(
                f"swa_last_k={self.args.swa_last_k} averages the weights files of a transformers model's checkpoints; "
                f"{type(model).__name__} saves its checkpoints otherwise (a folder of modules): average them yourself "
                "with nlp_tricks.runtime.averaging.average_into, or leave swa_last_k at 0"
            )

    def on_train_begin(self, args, state, control, **kwargs):
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


CheckpointAveraging = SWATrick  # its name before the built-ins were named <Flag>Trick
