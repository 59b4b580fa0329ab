"""``head_dropout_samples`` / ``head_dropout``: multi-sample dropout on the classification head's input. Its
mechanics are in :class:`nlp_tricks.heads.MultiSampleDropout`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..functional.multi_sample_dropout import MultiSampleDropout, validate_multi_sample_dropout
from .base import BuiltInTrick

__all__ = ["HeadDropoutTrick", "MultiSampleDropoutHead", "HeadDropoutArguments"]


@dataclass
class HeadDropoutArguments:
    """Multi-sample dropout on the classification head's input."""

    head_dropout_samples: int = field(
        default=1,
        metadata={
            "help": "Multi-sample dropout (Inoue 2019): K >= 1 dropout masks on the features entering the "
            "classification head; the loss is the mean of the K heads' losses. Off at evaluation. 1: off."
        },
    )
    head_dropout: float = field(
        default=0.0,
        metadata={
            "help": "Dropout probability in [0, 1) of each multi-sample dropout mask (with head_dropout_samples)."
        },
    )


class HeadDropoutTrick(BuiltInTrick):
    """K dropout masks on the features entering the head; the loss is the mean of the K heads' losses (the
    returned logits are the first head's). Off at evaluation."""

    arguments = HeadDropoutArguments
    order = 500
    changes_loss = True
    in_evaluation = False

    def __init__(self, args):
        super().__init__(args)
        self.hooks: MultiSampleDropout | None = None

    @classmethod
    def enabled(cls, args) -> bool:
        return args.head_dropout_samples > 1 or args.head_dropout > 0

    @staticmethod
    def validate(args) -> None:
        validate_multi_sample_dropout(
            args.head_dropout_samples, args.head_dropout, names=("head_dropout_samples", "head_dropout")
        )

    def summary(self) -> list[str]:
        return [f"head_dropout_samples={self.args.head_dropout_samples}", f"head_dropout={self.args.head_dropout}"]

    def prepare_model(self, trainer, model: nn.Module) -> None:
        if self.hooks is not None:
            self.hooks.remove()
        self.hooks = MultiSampleDropout.attach(model, self.args.head_dropout_samples, self.args.head_dropout)

    def head_samples(self, trainer, logits: torch.Tensor) -> list[torch.Tensor] | None:
        samples = self.hooks.take() if self.hooks is not None else None
        if samples is None:
            return None
        if samples.shape[1:] != logits.shape:
            raise ValueError(
                f"head_dropout_samples: the head's output {tuple(samples.shape[1:])} is not the model's logits "
                f"{tuple(logits.shape)}; multi-sample dropout needs a model that returns its head's output as logits"
            )
        return list(samples.unbind(0))


MultiSampleDropoutHead = HeadDropoutTrick  # its name before the built-ins were named <Flag>Trick
