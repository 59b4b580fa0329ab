"""``rdrop_alpha``: R-Drop (Liang et al. 2021), two dropout passes as one doubled batch and their symmetric KL.
Its math is :func:`nlp_tricks.losses.rdrop_kl`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..functional.losses import rdrop_kl
from ..functional.models import unwrap_model
from ..trick import LossBatch
from .base import BuiltInTrick

__all__ = ["RDropTrick", "RDrop", "RDropArguments"]


@dataclass
class RDropArguments:
    """R-Drop."""

    rdrop_alpha: float = field(
        default=0.0,
        metadata={
            "help": "R-Drop (Liang et al. 2021) weight alpha >= 0; 0 disables it. Each batch runs twice with "
            "independent dropout (as one doubled batch) and the loss per counted item is loss(a) + loss(b) + "
            "alpha / 2 * (KL(p_a || p_b) + KL(p_b || p_a)), with loss_type's loss on both passes; logs `loss_kl`. "
            "Needs a model with dropout."
        },
    )


class RDropTrick(BuiltInTrick):
    """The batch runs twice with independent dropout (one forward of the doubled batch); the loss per counted item
    is ``loss(a) + loss(b) + rdrop_alpha / 2 * (KL(p_a || p_b) + KL(p_b || p_a))``. Logs ``loss_kl``."""

    arguments = RDropArguments
    order = 600
    changes_loss = True
    in_evaluation = False

    def __init__(self, args):
        super().__init__(args)
        self._checked = False  # the first batch checks that the model has active dropout (PEFT: after a step)

    @classmethod
    def enabled(cls, args) -> bool:
        return args.rdrop_alpha > 0

    @staticmethod
    def validate(args) -> None:
        if not args.rdrop_alpha >= 0:
            raise ValueError(f"rdrop_alpha={args.rdrop_alpha} is not allowed; it must be >= 0 (0: off)")

    def summary(self) -> list[str]:
        return [f"rdrop_alpha={self.args.rdrop_alpha}"]

    def prepare_loss_batch(self, trainer, batch: LossBatch) -> LossBatch:
        """The batch concatenated with itself along the batch dimension (one forward gives both dropout passes)."""
        size = batch.labels.shape[0]
        inputs = {}
        for key, value in batch.inputs.items():
            if torch.is_tensor(value) and value.dim() > 0:
                if value.shape[0] != size:
                    raise ValueError(
                        f"rdrop_alpha > 0 runs the two passes as one doubled batch, but input {key!r} of shape "
                        f"{tuple(value.shape)} has no batch dimension of size {size}"
                    )
                value = torch.cat([value, value])
            inputs[key] = value

        def doubled(t):
            return None if t is None else torch.cat([t, t])

        return batch.replace(
            inputs=inputs,
            labels=doubled(batch.labels),
            loss_labels=doubled(batch.loss_labels),
            teacher_logits=doubled(batch.teacher_logits),
        )

    def adjust_logits_loss(self, trainer, logits, batch: LossBatch, loss):
        # The loss sums both passes per item; a mean over the doubled batch is half of that.
        return (loss if batch.num_items is not None else 2 * loss) + self.kl_term(
            trainer, logits, batch.loss_labels, batch.num_items
        )

    def kl_term(self, trainer, logits, labels, num_items_in_batch=None) -> torch.Tensor:
        """``rdrop_alpha / 2 * (KL(p_a || p_b) + KL(p_b || p_a))`` per counted item on the doubled batch's logits
        and labels, on ``logits / temperature``, in float32; logs ``loss_kl`` (the term without ``rdrop_alpha``)."""
        if self.args.temperature != 1.0:
            logits = logits / self.args.temperature
        logits_a, logits_b = logits.chunk(2)
        if not self._checked:
            model = unwrap_model(trainer.model)  # a PEFT model stays one: its dropout is judged after a step
            if not torch.equal(logits_a, logits_b):
                self._checked = True
            # A LoRA adapter's B starts at zero, so its dropout acts on a path that adds nothing until the first
            # update: a PEFT model is judged after one optimizer step.
            elif not (hasattr(model, "peft_config") and trainer.state.global_step == 0):
                raise ValueError(
                    f"rdrop_alpha={self.args.rdrop_alpha} needs dropout, but the two passes over the batch gave "
                    f"identical logits: {type(model).__name__} has no active dropout (e.g. hidden_dropout_prob=0 in "
                    "its config); give it a dropout probability > 0 or set rdrop_alpha=0"
                )
        kl = rdrop_kl(logits_a, logits_b, labels.chunk(2)[0], num_items_in_batch=num_items_in_batch)
        trainer.record_loss_term("loss_kl", kl, num_items_in_batch)
        return self.args.rdrop_alpha * kl


RDrop = RDropTrick  # its name before the built-ins were named <Flag>Trick
