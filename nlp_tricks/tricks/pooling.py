"""``pooling``: classify from a pooled vector (mean, max, mean-max, weighted layers, attention, CLS) instead of the
model's own pooler. Its math is in :mod:`nlp_tricks.pooling`."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..functional.layers import seeded
from ..functional.models import unwrap_model
from ..functional.pooling import POOLING_MODES, Pooling, add_pooling
from .base import BuiltInTrick

__all__ = ["PoolingTrick", "PoolingHead", "PoolingArguments"]


@dataclass
class PoolingArguments:
    """Sequence classification from a pooled vector."""

    pooling: str | None = field(
        default=None,
        metadata={
            "help": "Sequence classification on an encoder: classify from this pooled vector instead of the model's "
            "own pooler / first token. 'cls' (first position), 'mean' / 'max' (over the positions the attention mask "
            "keeps), 'mean_max' (both concatenated; the head's first linear layer doubles its input), "
            "'weighted_layers' (learned softmax weights over every layer's masked mean) or 'attention' (learned "
            "attention over positions). The pooled vector feeds the model's own head; saved with the model "
            "(config.pooling); load it with nlp_tricks.pooling.load_pooled_model. Default: the model's own head.",
            "choices": list(POOLING_MODES),
        },
    )


class PoolingTrick(BuiltInTrick):
    """Attaches :func:`~nlp_tricks.pooling.add_pooling` to the model before the Trainer wraps it; its new weights are
    drawn under ``seed``. Training, saving and loading need nothing else (``load_pooled_model`` reads the saved
    model back)."""

    arguments = PoolingArguments
    order = 100

    @classmethod
    def enabled(cls, args) -> bool:
        return args.pooling is not None

    @staticmethod
    def validate(args) -> None:
        if args.pooling is not None and args.pooling not in POOLING_MODES:
            raise ValueError(f"pooling={args.pooling!r} is not allowed; choose one of {', '.join(POOLING_MODES)}")

    def summary(self) -> list[str]:
        return [f"pooling={self.args.pooling}"]

    def prepare_model(self, trainer, model: nn.Module) -> None:
        inner = unwrap_model(model, peft=True)
        if inner is not model and not isinstance(getattr(inner, "pooling", None), Pooling):
            raise ValueError(
                f"pooling={self.args.pooling!r} cannot be added to a PEFT model after wrapping: call "
                "nlp_tricks.pooling.add_pooling(model, mode) first, then get_peft_model with 'pooling' and the "
                "classifier in modules_to_save"
            )
        param = next(inner.parameters(), None)
        with seeded(self.args.seed, param.device if param is not None else None):
            add_pooling(inner, self.args.pooling)


PoolingHead = PoolingTrick  # its name before the built-ins were named <Flag>Trick
