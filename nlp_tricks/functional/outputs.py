"""Reading a model's outputs whether it returned a ``ModelOutput`` (``return_dict=True``) or a plain tuple."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from transformers.utils import ModelOutput

__all__ = ["output_logits", "output_loss", "outputs_with_loss"]


def output_logits(outputs) -> torch.Tensor:
    """``outputs.logits``; for a tuple (``return_dict=False``, no labels passed) its first element."""
    return outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]


def output_loss(outputs) -> torch.Tensor:
    """``outputs.loss``; for a tuple (``return_dict=False``, labels passed) its first element."""
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]


def outputs_with_loss(outputs, loss: torch.Tensor):
    """The outputs as the model returns them given labels: the loss first (upstream's ``prediction_step`` takes a
    tuple's ``outputs[1:]`` as the predictions)."""
    if isinstance(outputs, ModelOutput):
        if "loss" in {f.name for f in dataclasses.fields(outputs)}:
            return type(outputs)(**{**outputs, "loss": loss})
        return outputs
    if isinstance(outputs, dict):
        return {"loss": loss, **outputs}
    if isinstance(outputs, (tuple, list)):
        return (loss, *outputs)
    return (loss, outputs)
