"""Reading a model's outputs whether it returned a ``ModelOutput`` (``return_dict=True``) or a plain tuple."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["output_logits", "output_loss"]


def output_logits(outputs) -> torch.Tensor:
    """``outputs.logits``; for a tuple (``return_dict=False``, no labels passed) its first element."""
    return outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]


def output_loss(outputs) -> torch.Tensor:
    """``outputs.loss``; for a tuple (``return_dict=False``, labels passed) its first element."""
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
