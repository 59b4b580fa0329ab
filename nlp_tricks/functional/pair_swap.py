"""Pair order: a text-pair classifier scored on both orders, (a, b) and (b, a), with the labels mapped by the swap.

Training on both orders (LMSYS 2024 2nd: both in one optimizer step) teaches the model that the order carries no
information beyond the label map ("A wins" becomes "B wins"); averaging ``p(a, b)`` with the mapped ``p(b, a)`` at
prediction removes the position bias that is left (+0.003 to +0.015 in the 2024 write-ups).

Plain torch; recipes/classification.py (``--pair_swap``, ``--pair_swap_predict``) uses it.
"""

from __future__ import annotations

import torch

__all__ = ["parse_label_map", "swap_permutation", "swap_averaged_logits", "PairSwapAverage"]


def parse_label_map(spec: str, labels: list[str]) -> dict[str, str]:
    """``{label: label of the swapped pair}`` from ``"a=b,b=a,tie=tie"`` or ``"symmetric"`` (each label its own).

    Every label must be mapped, to a label, and swapping twice must give the pair back (``a=b`` needs ``b=a``).

    Raises:
        ValueError: naming what is wrong.
    """
    if spec.strip() == "symmetric":
        return {label: label for label in labels}
    mapping: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"{part.strip()!r} is not label=label (e.g. a=b,b=a,tie=tie, or symmetric)")
        if key in mapping:
            raise ValueError(f"label {key!r} is mapped twice")
        mapping[key] = value
    known = set(labels)
    unknown = sorted((set(mapping) | set(mapping.values())) - known)
    if unknown:
        raise ValueError(f"labels {unknown} are not among the training labels {labels}")
    missing = [label for label in labels if label not in mapping]
    if missing:
        raise ValueError(f"labels {missing} are not mapped; map every label (x=x for one that a swap keeps)")
    for key, value in mapping.items():
        if mapping[value] != key:
            raise ValueError(f"{key}={value} needs {value}={key}: swapping the pair twice must give it back")
    return mapping


def swap_permutation(mapping: dict[str, str], labels: list[str]) -> list[int]:
    """``perm[i]``: the class id of the swapped pair's label when the pair's label is class ``i``."""
    index = {label: i for i, label in enumerate(labels)}
    return [index[mapping[label]] for label in labels]


def swap_averaged_logits(
    logits_ab: torch.Tensor, logits_ba: torch.Tensor, permutation: list[int] | torch.Tensor, multi_label: bool = False
) -> torch.Tensor:
    """``(B, C)`` logits whose probabilities are ``(p(a, b) + p(b, a)[:, perm]) / 2``.

    Single-label: ``log`` of the averaged softmax probabilities (their softmax is that average again); multi-label:
    the ``logit`` of the averaged sigmoids. Class ``i`` of ``(a, b)`` is class ``perm[i]`` of ``(b, a)``.
    """
    perm = torch.as_tensor(permutation, device=logits_ba.device, dtype=torch.long)
    logits_ab, logits_ba = logits_ab.float(), logits_ba.float().index_select(-1, perm)
    if multi_label:
        # log(mean of sigmoids) - log(mean of 1 - sigmoids), from log-sigmoids for stability (the halves cancel).
        logsigmoid = torch.nn.functional.logsigmoid
        pos = torch.logaddexp(logsigmoid(logits_ab), logsigmoid(logits_ba))
        neg = torch.logaddexp(logsigmoid(-logits_ab), logsigmoid(-logits_ba))
        return pos - neg
    two = torch.log(torch.tensor(2.0, device=logits_ab.device))
    return torch.logaddexp(logits_ab.log_softmax(-1), logits_ba.log_softmax(-1)) - two


class PairSwapAverage:
    """Forward hooks that make a classifier's evaluation forwards score both orders of each pair.

    A call with ``swap_input_ids`` (``swap_attention_mask``, ...: the swapped pairs, padded as a batch of their own)
    in eval mode runs the model on them too and returns the :func:`swap_averaged_logits` of the two passes (and,
    given ``labels``, the loss on those logits: cross-entropy, or binary cross-entropy for float labels). Calls
    without them, and every call in training mode, are untouched. Any model returning ``.logits`` works, under
    ``Trainer.predict`` too.

    Args:
        permutation (`list[int]`): :func:`swap_permutation`.
        multi_label (`bool`): sigmoids instead of a softmax.
    """

    def __init__(self, permutation: list[int], multi_label: bool = False):
        self.permutation = list(permutation)
        self.multi_label = multi_label
        self._swapped: dict | None = None
        self._inner = False
        self.handles: list = []

    def attach(self, model: torch.nn.Module) -> PairSwapAverage:
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _before(self, module, args, kwargs):
        if self._inner:
            return None
        swapped = {key[len("swap_") :]: kwargs.pop(key) for key in list(kwargs) if key.startswith("swap_")}
        self._swapped = swapped if swapped and not module.training else None
        return args, kwargs

    def _after(self, module, args, kwargs, output):
        if self._inner or self._swapped is None:
            return None
        swapped, self._swapped = self._swapped, None
        self._inner = True
        try:
            other = module(**swapped)
        finally:
            self._inner = False
        logits = swap_averaged_logits(output.logits, other.logits, self.permutation, self.multi_label)
        output["logits"] = logits.to(output.logits.dtype)
        labels = kwargs.get("labels")
        if labels is not None:
            if labels.is_floating_point() and labels.shape == logits.shape:
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
            else:
                loss = torch.nn.functional.cross_entropy(logits, labels.view(-1))
            output["loss"] = loss
        return output
