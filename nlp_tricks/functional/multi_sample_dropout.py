"""Multi-sample dropout on the input of a classification head.

Inoue 2019, "Multi-Sample Dropout for Accelerated Training and Better Generalization", https://arxiv.org/abs/1905.09788

In training, the features entering the head's last ``nn.Linear`` get K independent dropout masks and the head runs
on each (one batched matmul); the loss is the mean of the K heads' losses. The model's returned logits are the
first sample's, the K are kept for the loss (:meth:`MultiSampleDropout.take`). In evaluation nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MultiSampleDropout", "find_classifier", "validate_multi_sample_dropout"]


def validate_multi_sample_dropout(samples, p, names: tuple[str, str] = ("samples", "p")) -> None:
    """Raise ``ValueError`` naming the field unless ``samples`` is an integer >= 1 and ``p`` in [0, 1), with p > 0
    when there are several samples (identical samples otherwise)."""
    samples_name, p_name = names
    if int(samples) != samples or samples < 1:
        raise ValueError(f"{samples_name}={samples} is not allowed; it must be an integer >= 1")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{p_name}={p} is not allowed; it must be in [0, 1)")
    if samples > 1 and p == 0:
        raise ValueError(
            f"{samples_name}={samples} needs {p_name} > 0 (e.g. 0.5): without dropout the samples are identical"
        )


def find_classifier(model: nn.Module) -> tuple[str, nn.Linear]:
    """The classification head's output layer: the last ``nn.Linear`` with ``config.num_labels`` outputs outside
    ``model.base_model`` (``classifier`` for BERT, ``classifier.out_proj`` for RoBERTa, ...; of a PEFT model, the
    trained copy in ``modules_to_save``). Returns its name too."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        # A PEFT model: its transformers model, where the head (PEFT's modules_to_save copy of it last) is found.
        model = model.get_base_model()
    num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    base = getattr(model, "base_model", model)
    body = {id(m) for m in base.modules()} if base is not model else set()
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and id(module) not in body
        and (num_labels is None or module.out_features == num_labels)
    ]
    if not found:
        raise ValueError(
            f"head_dropout_samples needs a classification head, but {type(model).__name__} has no nn.Linear with "
            f"config.num_labels={num_labels} outputs outside its base model"
        )
    return found[-1]


class MultiSampleDropout:
    """K dropout masks on the input of ``head`` (an ``nn.Linear``) while it is in training mode.

    Args:
        head (`nn.Linear`): the layer whose input is dropped (see :func:`find_classifier`).
        samples (`int`): K >= 1.
        p (`float`): dropout probability in [0, 1) of each mask.

    After a training forward, :meth:`take` returns the K logits ``(K, *logits.shape)`` (and forgets them); the
    forward itself returns the first. ``samples=1, p=0`` reproduces the plain head exactly. :meth:`remove` detaches
    the hooks.
    """

    def __init__(self, head: nn.Linear, samples: int, p: float):
        if not isinstance(head, nn.Linear):
            raise TypeError(f"head must be an nn.Linear, got {type(head).__name__}")
        validate_multi_sample_dropout(samples, p)
        self.head, self.samples, self.p = head, int(samples), float(p)
        self._logits: torch.Tensor | None = None
        self._active = False
        self._handles = [head.register_forward_pre_hook(self._before), head.register_forward_hook(self._after)]

    @classmethod
    def attach(cls, model: nn.Module, samples: int, p: float) -> MultiSampleDropout:
        """Hook the classification head of a ``*ForSequenceClassification`` / ``*ForTokenClassification`` model."""
        return cls(find_classifier(model)[1], samples, p)

    def masks(self, features: torch.Tensor) -> torch.Tensor:
        """K inverted-dropout masks ``(K, *features.shape)``: 0 with probability p, else 1 / (1 - p)."""
        keep = torch.empty((self.samples, *features.shape), dtype=features.dtype, device=features.device)
        return keep.bernoulli_(1.0 - self.p).div_(1.0 - self.p)

    def _before(self, module: nn.Module, args: tuple):
        self._active = module.training
        if not self._active:
            return None
        features = args[0]
        stacked = features.unsqueeze(0).expand(self.samples, *features.shape)
        if self.p > 0:
            stacked = stacked * self.masks(features)
        return (stacked, *args[1:])

    def _after(self, module: nn.Module, args: tuple, output: torch.Tensor):
        if not self._active:
            return None
        self._active = False
        self._logits = output
        return output[0]

    def take(self) -> torch.Tensor | None:
        """The K logits of the last training forward, ``(K, ...)``, or ``None`` (evaluation, or already taken)."""
        logits, self._logits = self._logits, None
        return logits

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
