"""nlp_tricks: competition-proven fine-tuning tricks for Hugging Face transformers.

The public names load on first use, so ``import nlp_tricks.losses`` (or the ``nlp-tricks`` command) does not pay for
importing transformers' Trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _moved, _pipeline_hook

__version__ = "0.1.0"

_moved.install()  # old import paths of moved modules (nlp_tricks.losses, ...) keep working
_pipeline_hook.install()  # transformers' pipelines load and decode a CRF, span head or pooling (nlp_tricks.pipelines)

# public name -> the module that defines it
_EXPORTS = {
    "TricksArguments": ".config",
    "TricksTrainer": ".trainer",
    "TricksConfig": ".config",
    "Trick": ".trick",
    "HOOK_RULES": ".trick",
    "with_tricks": ".hosts",
    "focal_loss": ".functional.losses",
    "label_smoothing_cross_entropy": ".functional.losses",
    "cross_entropy": ".functional.losses",
    "distillation_loss": ".functional.losses",
    "rdrop_loss": ".functional.losses",
    "FocalLoss": ".functional.losses",
    "LabelSmoothingCrossEntropy": ".functional.losses",
    "build_param_groups": ".runtime.param_groups",
    "load_state_dict_portable": ".runtime.checkpoint",
    "FGM": ".functional.adversarial",
    "PGD": ".functional.adversarial",
    "AWP": ".functional.adversarial",
    "FreeLB": ".functional.adversarial",
    "load_crf_model": ".functional.crf",
    "load_pooled_model": ".functional.pooling",
    "load_span_model": ".functional.spans",
}

__all__ = [
    "TricksArguments",
    "TricksTrainer",
    "TricksConfig",
    "Trick",
    "HOOK_RULES",
    "with_tricks",
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
    "load_crf_model",
    "load_pooled_model",
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
    from .config import TricksArguments, TricksConfig
    from .functional.adversarial import AWP, FGM, PGD, FreeLB
    from .functional.crf import load_crf_model
    from .functional.losses import (
        FocalLoss,
        LabelSmoothingCrossEntropy,
        cross_entropy,
        distillation_loss,
        focal_loss,
        label_smoothing_cross_entropy,
        rdrop_loss,
    )
    from .functional.pooling import load_pooled_model
    from .functional.spans import load_span_model
    from .hosts import with_tricks
    from .runtime.checkpoint import load_state_dict_portable
    from .runtime.param_groups import build_param_groups
    from .trainer import TricksTrainer
    from .trick import HOOK_RULES, Trick
