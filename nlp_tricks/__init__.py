"""nlp_tricks: competition-proven fine-tuning tricks for Hugging Face transformers.

The public names load on first use, so ``import nlp_tricks.losses`` (or the ``nlp-tricks`` command) does not pay for
importing transformers' Trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "TricksArguments": ".config",
    "TricksTrainer": ".trainer",
    "Trick": ".tricks",
    "focal_loss": ".losses",
    "label_smoothing_cross_entropy": ".losses",
    "cross_entropy": ".losses",
    "distillation_loss": ".losses",
    "rdrop_loss": ".losses",
    "FocalLoss": ".losses",
    "LabelSmoothingCrossEntropy": ".losses",
    "build_param_groups": ".param_groups",
    "load_state_dict_portable": ".checkpoint",
    "FGM": ".adversarial",
    "PGD": ".adversarial",
    "AWP": ".adversarial",
    "FreeLB": ".adversarial",
    "load_span_model": ".functional.spans",
}

__all__ = [
    "TricksArguments",
    "TricksTrainer",
    "Trick",
    "focal_loss",
    "label_smoothing_cross_entropy",
    "cross_entropy",
    "distillation_loss",
    "rdrop_loss",
    "FocalLoss",
    "LabelSmoothingCrossEntropy",
    "build_param_groups",
    "load_state_dict_portable",
    "FGM",
    "PGD",
    "AWP",
    "FreeLB",
    "load_span_model",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nlp_tricks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .adversarial import AWP, FGM, PGD, FreeLB
    from .checkpoint import load_state_dict_portable
    from .config import TricksArguments
    from .functional.spans import load_span_model
    from .losses import (
        FocalLoss,
        LabelSmoothingCrossEntropy,
        cross_entropy,
        distillation_loss,
        focal_loss,
        label_smoothing_cross_entropy,
        rdrop_loss,
    )
    from .param_groups import build_param_groups
    from .trainer import TricksTrainer
    from .tricks import Trick
