"""``freeze_layers`` / ``freeze_embeddings`` / ``unfreeze_at_step``: the embeddings and bottom layers held fixed
(for a while). The mechanics are in :mod:`nlp_tricks.functional.layers`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn
from transformers.training_args import ParallelMode

from ..functional.layers import freeze_bottom_layers, model_layers, unfreeze
from ..functional.models import unwrap_model
from .base import BuiltInTrick
from .reinit_layers import check_count

logger = logging.getLogger(__name__)


__all__ = ["FreezeLayersTrick", "LayerFreezing", "FreezeArguments"]


@dataclass
class FreezeArguments:
    """Frozen embeddings and bottom layers."""

    freeze_layers: int = field(
        default=0,
        metadata={
            "help": "Freeze the embeddings and the bottom N layers: no update and no optimizer state (see "
            "unfreeze_at_step). 0: off."
        },
    )
    freeze_embeddings: bool = field(
        default=False,
        metadata={"help": "Freeze the embeddings (with freeze_layers > 0 they are frozen anyway)."},
    )
    unfreeze_at_step: int | None = field(
        default=None,
        metadata={
            "help": "Make the frozen parameters (freeze_layers / freeze_embeddings) trainable from optimizer step S "
            "(>= 1): steps 0..S-1 leave them alone, their optimizer state starts at step S. Under DDP it needs "
            "ddp_find_unused_parameters (on by default without gradient checkpointing). Default: frozen throughout."
        },
    )


class FreezeLayersTrick(BuiltInTrick):
    """Holds the embeddings (and the bottom ``freeze_layers`` layers) fixed.

    Without ``unfreeze_at_step`` they are frozen (``requires_grad=False``) before the Trainer builds its optimizer
    and wraps the model: the optimizer never holds them and DDP never reduces their gradients. With it they stay in
    the optimizer and in DDP's reducer, are frozen when training begins (they get no gradient, so AdamW skips them and
    keeps no state), and become trainable again after optimizer step ``unfreeze_at_step`` (their optimizer state
    starts then). Only parameters that were trainable are touched: a PEFT model's frozen base stays frozen.
    """

    arguments = FreezeArguments
    # After the EMA (1100): it is built when training begins, before this trick freezes what unfreeze_at_step thaws.
    order = 1300

    unsupported_reason = (
        "unfreeze_at_step changes which parameters train during the run, which DeepSpeed / FSDP flattened parameters "
        "do not allow; freeze without unfreezing, or use DDP"
    )

    def __init__(self, args):
        super().__init__(args)
        self.frozen: list[nn.Parameter] = []

    @property
    def deepspeed(self) -> bool:
        return self.args.unfreeze_at_step is None

    @property
    def fsdp(self) -> bool:
        return self.args.unfreeze_at_step is None

    @classmethod
    def enabled(cls, args) -> bool:
        return args.freeze_layers > 0 or args.freeze_embeddings

    @staticmethod
    def validate(args) -> None:
        check_count(args.freeze_layers, "freeze_layers")
        step = args.unfreeze_at_step
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise ValueError(f"unfreeze_at_step={step!r} is not allowed; it must be an integer >= 1")
            if args.freeze_layers == 0 and not args.freeze_embeddings:
                raise ValueError(
                    f"unfreeze_at_step={step} needs something frozen: set freeze_layers > 0 or freeze_embeddings"
                )

    def summary(self) -> list[str]:
        settings = [f"freeze_layers={self.args.freeze_layers}"] if self.args.freeze_layers else []
        if self.args.freeze_embeddings and not self.args.freeze_layers:
            settings.append("freeze_embeddings=True")
        if self.args.unfreeze_at_step is not None:
            settings.append(f"unfreeze_at_step={self.args.unfreeze_at_step}")
        return [", ".join(settings)]

    def prepare_model(self, trainer, model: nn.Module) -> None:
        n = self.args.freeze_layers
        if getattr(self.args, "reinit_layers", 0):
            _, layers, _ = model_layers(model)
            if n > len(layers) - getattr(self.args, "reinit_layers", 0):
                raise ValueError(
                    f"freeze_layers={n} and reinit_layers={getattr(self.args, 'reinit_layers', 0)} overlap on "
                    f"{type(unwrap_model(model, peft=True)).__name__}'s {len(layers)} layers: a re-initialised layer "
                    "would never train"
                )
        self.frozen = freeze_bottom_layers(model, n, embeddings=True)
        if not self.frozen:
            logger.warning(
                f"{self.summary()[0]}: no trainable parameter there to freeze (a PEFT model's base is frozen already)"
            )
        if self.args.unfreeze_at_step is not None:
            # Kept trainable until training begins: the optimizer and DDP's reducer must hold them.
            unfreeze(self.frozen)

    def setup(self, trainer) -> None:
        if self.args.unfreeze_at_step is None:
            return
        args = self.args
        if args.parallel_mode == ParallelMode.DISTRIBUTED:
            find_unused = args.ddp_find_unused_parameters
            if find_unused is None:
                find_unused = not (args.activation_checkpointing or args.gradient_checkpointing)
            if not find_unused:
                raise ValueError(
                    f"unfreeze_at_step={args.unfreeze_at_step} under DDP needs ddp_find_unused_parameters=True "
                    "(frozen parameters produce no gradient until then); it is off (set explicitly, or by gradient "
                    "checkpointing)"
                )

    def on_train_begin(self, args, state, control, **kwargs):
        if self.args.unfreeze_at_step is not None and state.global_step < self.args.unfreeze_at_step:
            for param in self.frozen:
                param.requires_grad_(False)

    def on_step_end(self, args, state, control, **kwargs):
        if self.args.unfreeze_at_step is not None and state.global_step == self.args.unfreeze_at_step:
            unfreeze(self.frozen)


LayerFreezing = FreezeLayersTrick  # its name before the built-ins were named <Flag>Trick
