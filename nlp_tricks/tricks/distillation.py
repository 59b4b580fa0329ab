"""``distill_temperature`` / ``distill_alpha``: knowledge distillation for batches that carry ``teacher_logits`` (a
teacher's scores, e.g. self-training's soft labels). Math: :func:`nlp_tricks.functional.losses.distillation_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..functional.losses import distillation_loss
from .base import BuiltInTrick

__all__ = ["DistillationTrick", "Distillation", "DistillationArguments"]


@dataclass
class DistillationArguments:
    """Distillation (batches that carry `teacher_logits`)."""

    distill_temperature: float = field(
        default=2.0,
        metadata={
            "help": "Temperature T > 0 of knowledge distillation (Hinton et al. 2015), used when a batch carries "
            "`teacher_logits`: alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE(labels)."
        },
    )
    distill_alpha: float = field(
        default=0.5,
        metadata={"help": "Weight in [0, 1] of the soft (teacher) term of the distillation loss."},
    )


class DistillationTrick(BuiltInTrick):
    """The loss of a batch with ``teacher_logits``: ``alpha * T^2 * KL(teacher || student) + (1 - alpha) *
    CE(labels)``, ahead of the configured loss (which answers for batches without a teacher)."""

    arguments = DistillationArguments
    order = 700
    needs_logits = False  # it answers for batches with teacher_logits only, which keep the full logits

    @classmethod
    def enabled(cls, args) -> bool:
        return True  # always there: it answers only for batches that carry teacher_logits

    @staticmethod
    def validate(args) -> None:
        if args.distill_temperature <= 0:
            raise ValueError(f"distill_temperature={args.distill_temperature} is not allowed; it must be > 0")
        if not 0.0 <= args.distill_alpha <= 1.0:
            raise ValueError(f"distill_alpha={args.distill_alpha} is not allowed; it must be in [0, 1]")

    def summary(self) -> list[str]:
        return []  # what it does depends on the data, not on a setting

    def compute_loss(self, trainer, logits, labels, num_items_in_batch=None):
        batch = trainer.loss_context.batch if trainer.loss_context is not None else None
        if batch is None or batch.teacher_logits is None:
            return None
        return distillation_loss(
            logits,
            batch.teacher_logits,
            labels,
            temperature=self.args.distill_temperature,
            alpha=self.args.distill_alpha,
            num_items_in_batch=num_items_in_batch,
        )


Distillation = DistillationTrick  # its name before the built-ins were named <Flag>Trick
