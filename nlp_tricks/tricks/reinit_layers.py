"""``reinit_layers``: the top layers started again from the model's own init. The mechanics are in
:mod:`nlp_tricks.functional.layers`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from ..functional.layers import reinit_top_layers, seeded
from .base import BuiltInTrick

__all__ = ["ReinitLayersTrick", "ReinitLayers", "ReinitArguments", "check_count"]

logger = logging.getLogger(__name__)


@dataclass
class ReinitArguments:
    """Re-initialised top layers."""

    reinit_layers: int = field(
        default=0,
        metadata={
            "help": "Re-initialise the top K encoder layers (and the base model's pooler, if it has one) with the "
            "model's own init before training (Zhang et al. 2021), drawn under `seed`; every other weight stays "
            "the pretrained one. 0: off. Typical: 1-3."
        },
    )


def check_count(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 0")


class ReinitLayersTrick(BuiltInTrick):
    """Re-initialises the top ``reinit_layers`` layers (and the base model's pooler) with the model's own
    ``_init_weights`` before training, drawing under ``seed`` (the global RNG is left as it was)."""

    arguments = ReinitArguments
    order = 200

    def __init__(self, args):
        super().__init__(args)
        self.reinitialised: list[str] = []

    @classmethod
    def enabled(cls, args) -> bool:
        return args.reinit_layers > 0

    @staticmethod
    def validate(args) -> None:
        check_count(args.reinit_layers, "reinit_layers")

    def summary(self) -> list[str]:
        return [f"reinit_layers={self.args.reinit_layers}"]

    def prepare_model(self, trainer, model: nn.Module) -> None:
        param = next(model.parameters(), None)
        with seeded(self.args.seed, param.device if param is not None else None):
            self.reinitialised = reinit_top_layers(model, self.args.reinit_layers)
        logger.info(f"reinit_layers={self.args.reinit_layers}: re-initialised {', '.join(self.reinitialised)}")


ReinitLayers = ReinitLayersTrick  # its name before the built-ins were named <Flag>Trick
