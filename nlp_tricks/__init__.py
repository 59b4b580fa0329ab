"""nlp_tricks: competition-proven fine-tuning tricks for Hugging Face transformers."""

from .adversarial import FGM, PGD  # --- Adversarial ---
from .checkpoint import load_state_dict_portable  # --- Checkpoints ---
from .config import TricksArguments
from .losses import FocalLoss, LabelSmoothingCrossEntropy, cross_entropy, focal_loss, label_smoothing_cross_entropy
from .param_groups import build_param_groups
from .trainer import TricksTrainer

__version__ = "0.1.0"

__all__ = [
    "TricksArguments",
    "TricksTrainer",
    "focal_loss",
    "label_smoothing_cross_entropy",
    "cross_entropy",
    "FocalLoss",
    "LabelSmoothingCrossEntropy",
    "build_param_groups",
    # --- Checkpoints ---
    "load_state_dict_portable",
    # --- Adversarial ---
    "FGM",
    "PGD",
]
