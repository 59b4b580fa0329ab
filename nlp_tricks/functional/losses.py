"""Classification losses as plain functions (plus thin ``nn.Module`` wrappers).

Every function takes ``(logits, labels, *, ignore_index=-100, reduction="mean", num_items_in_batch=None, ...)``.
``logits`` is ``(N, C)`` or ``(B, L, C)`` and ``labels`` ``(N,)`` or ``(B, L)``. The loss is computed in float32
whatever the logits' dtype. When ``num_items_in_batch`` is given the result is ``sum / num_items_in_batch``: the
normaliser the Trainer counts over a whole accumulated (and multi-process) batch, which makes gradient accumulation
exact.

``cross_entropy``, ``focal_loss``, ``label_smoothing_cross_entropy``, ``dft_loss`` and ``poly1_loss`` also take, in
place of the logits, an :class:`~nlp_tricks.functional.chunked_loss.LMHeadLogits` (a linear LM head's input and
weight): the same loss computed in chunks of tokens, never holding the ``(tokens, vocab)`` logits. Each starts from
:func:`_targets` (each item's counted flag, safe label, log-sum-exp and target logit), which is what makes that work.

No Trainer imports here: these are usable in any training loop.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .chunked_loss import LMHeadLogits

__all__ = [
    "focal_alpha_weights",
    "focal_loss",
    "label_smoothing_cross_entropy",
    "cross_entropy",
    "dft_loss",
    "poly1_loss",
    "distillation_loss",
    "balanced_class_weights",
    "parse_class_weights",
    "rdrop_kl",
    "rdrop_loss",
    "multilabel_categorical_crossentropy",
    "FocalLoss",
    "LabelSmoothingCrossEntropy",
]

_REDUCTIONS = ("mean", "sum", "none")


def _flatten(logits: torch.Tensor | LMHeadLogits, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match labels of shape {tuple(labels.shape)}: "
            "expected logits (N, C) with labels (N,), or (B, L, C) with (B, L)"
        )
    if isinstance(logits, LMHeadLogits):
        return logits.flatten(), labels.reshape(-1)
    return logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)


def _reduce(
    loss: torch.Tensor,
    weight: torch.Tensor,
    labels_shape: torch.Size,
    reduction: str,
    num_items_in_batch: torch.Tensor | int | None,
) -> torch.Tensor:
    """Reduce per-item losses (already zero at ignored items); ``weight`` is each item's share of a mean."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if reduction == "none":
        return loss.reshape(labels_shape)
    total = loss.sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    # Like F.cross_entropy: the mean over non-ignored items, NaN when there are none.
    return total / weight.sum()


class _LogitStats(torch.autograd.Function):
    """Per row of ``x``: ``logsumexp(x)``, the target logit ``x_y`` and ``mean(x)``, with a one-buffer backward.

    Every loss here is a function of these three ``(N,)`` tensors, so autograd works on O(N) values and the
    ``(N, C)`` gradient ``g_lse * softmax(x) + g_y * onehot(y) + g_mean / C`` is written into a single buffer; no
    log-softmax is kept between forward and backward (see benchmarks/losses.py). With ``mean_weight`` (C,) the third
    value is ``x @ mean_weight`` instead (a class-weighted mean).
    """

    @staticmethod
    def forward(ctx, logits, labels, mean_weight=None):
        lse = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(logits, labels, lse, mean_weight)
        mean = logits.mean(dim=-1) if mean_weight is None else logits @ mean_weight
        return lse, logits.gather(1, labels.unsqueeze(1)).squeeze(1), mean

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lse, grad_target, grad_mean):
        logits, labels, lse, mean_weight = ctx.saved_tensors
        grad = (logits - lse.unsqueeze(1)).exp_().mul_(grad_lse.unsqueeze(1))
        if mean_weight is None:
            grad.add_((grad_mean / logits.shape[-1]).unsqueeze(1))
        else:
            grad.addr_(grad_mean, mean_weight)
        grad.scatter_add_(1, labels.unsqueeze(1), grad_target.unsqueeze(1))
        return grad, None, None


def _logit_stats(
    logits: torch.Tensor | LMHeadLogits,
    labels: torch.Tensor,
    valid: torch.Tensor,
    mean_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse, target, mean)`` per row; an :class:`LMHeadLogits` computes them at the ``valid`` rows only."""
    if isinstance(logits, LMHeadLogits):
        return logits.stats(labels, valid, mean_weight)
    return _LogitStats.apply(logits, labels, mean_weight)


class _Targets(NamedTuple):
    """Each flattened item's counted flag, safe label and logit statistics: what every loss here starts from."""

    shape: torch.Size  # the labels' shape (for reduction="none")
    valid: torch.Tensor  # (N,) bool: the label is not ignore_index
    labels: torch.Tensor  # (N,) the labels, 0 at ignored items (safe to index with)
    lse: torch.Tensor  # (N,) logsumexp of the row
    target: torch.Tensor  # (N,) the target logit x_y
    mean: torch.Tensor  # (N,) the mean logit (x @ mean_weight with one)
    num_classes: int

    @property
    def log_p(self) -> torch.Tensor:
        """``log p_y`` per item (meaningless at ignored items)."""
        return self.target - self.lse


def _targets(
    logits: torch.Tensor | LMHeadLogits,
    labels: torch.Tensor,
    ignore_index: int,
    mean_weight: torch.Tensor | None = None,
) -> _Targets:
    """Flatten the logits and labels, mark the counted items and take each row's ``(lse, target, mean)``."""
    shape = labels.shape
    logits, labels = _flatten(logits, labels)
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, 0)
    lse, target, mean = _logit_stats(logits, safe_labels, valid, mean_weight)
    return _Targets(shape, valid, safe_labels, lse, target, mean, logits.shape[-1])


def _class_weight(weight, num_classes: int, like: torch.Tensor, name: str = "weight") -> torch.Tensor | None:
    """Per-class weights as a float32 (C,) tensor on ``like``'s device (``None`` stays ``None``)."""
    if weight is None:
        return None
    weight = torch.as_tensor(weight, dtype=torch.float32, device=like.device)
    if weight.shape != (num_classes,):
        raise ValueError(f"{name} must have one weight per class ({num_classes}), got shape {tuple(weight.shape)}")
    return weight


def focal_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    gamma: float = 2.0,
    alpha: torch.Tensor | list[float] | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Focal loss ``-alpha_y (1 - p_y)^gamma log p_y`` for multi-class logits.

    Lin et al. 2017, "Focal Loss for Dense Object Detection", https://arxiv.org/abs/1708.02002

    With ``gamma=0`` and no ``alpha`` it equals ``F.cross_entropy``; with ``gamma=0`` and ``alpha`` it equals
    ``F.cross_entropy(weight=alpha)``.

    Args:
        logits (`torch.Tensor`): ``(N, C)`` or ``(B, L, C)``.
        labels (`torch.Tensor`): ``(N,)`` or ``(B, L)`` class indices; ``ignore_index`` marks items to skip.
        gamma (`float`, defaults to 2.0): focusing parameter, >= 0.
        alpha (`torch.Tensor` or `list[float]`, *optional*): per-class weights of length C, used as
            ``F.cross_entropy``'s ``weight``: the mean divides by the sum of the weights of the counted items.
        ignore_index (`int`, defaults to -100): label value that contributes nothing.
        reduction (`str`, defaults to "mean"): "mean", "sum" or "none" (per item, 0 at ignored ones).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): if given, returns ``sum / num_items_in_batch``.
    """
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    t = _targets(logits, labels, ignore_index)
    log_pt = t.log_p
    if gamma == 0:
        loss = -log_pt
    else:
        # (1 - p)^gamma on the target only: O(N) work on top of the log-sum-exp.
        loss = -((1.0 - log_pt.exp()).clamp(min=0.0) ** gamma) * log_pt
    if alpha is not None:
        alpha = torch.as_tensor(alpha, dtype=loss.dtype, device=loss.device)
        if alpha.shape != (t.num_classes,):
            raise ValueError(f"alpha must have one weight per class ({t.num_classes}), got shape {tuple(alpha.shape)}")
        weight = alpha[t.labels] * t.valid
    else:
        weight = t.valid.to(loss.dtype)
    loss = torch.where(t.valid, loss * weight, 0.0)
    return _reduce(loss, weight, t.shape, reduction, num_items_in_batch)


def focal_alpha_weights(alpha, label_names: list[str], background: str = "O") -> list[float]:
    """Per-class focal weights from ``--focal_alpha``: one weight per class as given, or one value ``a`` as in the
    focal-loss paper: ``a`` for every class but the background one (``background``, NER's ``O``) and ``1 - a`` for
    it. Raises ``ValueError`` naming the class order when the values do not fit ``label_names``."""
    alpha = [float(a) for a in alpha]
    order = ", ".join(f"{i}={name}" for i, name in enumerate(label_names))
    if len(alpha) == 1:
        if background not in label_names:
            raise ValueError(
                f"focal_alpha with one value weighs the background class {background!r} against the others, and "
                f"the labels have none; give one weight per class, in this order: {order}"
            )
        if not 0.0 <= alpha[0] <= 1.0:
            raise ValueError(f"focal_alpha={alpha[0]} as one value must be in [0, 1]")
        return [1.0 - alpha[0] if name == background else alpha[0] for name in label_names]
    if len(alpha) != len(label_names):
        raise ValueError(
            f"focal_alpha has {len(alpha)} weights for {len(label_names)} classes; give one value, or one weight "
            f"per class in this order: {order}"
        )
    return alpha


def label_smoothing_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    epsilon: float = 0.1,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    weight: torch.Tensor | list[float] | None = None,
) -> torch.Tensor:
    """Cross-entropy against ``(1 - epsilon) * one_hot(y) + epsilon / C``.

    Szegedy et al. 2016, https://arxiv.org/abs/1512.00567; Müller et al. 2019, https://arxiv.org/abs/1906.02629

    Equals ``F.cross_entropy(logits, labels, label_smoothing=epsilon, ignore_index=..., weight=...)`` for every
    reduction; ignored items get no smoothing term either.

    Args:
        logits (`torch.Tensor`): ``(N, C)`` or ``(B, L, C)``.
        labels (`torch.Tensor`): ``(N,)`` or ``(B, L)`` class indices.
        epsilon (`float`, defaults to 0.1): smoothing mass in [0, 1].
        ignore_index (`int`, defaults to -100): label value that contributes nothing.
        reduction (`str`, defaults to "mean"): "mean", "sum" or "none".
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): if given, returns ``sum / num_items_in_batch``
            (with ``weight``: the sum of the weights of the counted items of the whole batch).
        weight (`torch.Tensor` or `list[float]`, *optional*): per-class weights (C,), as ``F.cross_entropy``'s
            ``weight``: item ``i`` costs ``(1 - epsilon) w_{y_i} (-log p_{y_i}) + epsilon / C sum_c w_c (-log p_c)``
            and the mean divides by ``sum_i w_{y_i}``.
    """
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    t, weight = _weighted_targets(logits, labels, ignore_index, weight)
    loss, item_weight = _smoothed_nll(t, epsilon, weight)
    return _reduce(loss, item_weight, t.shape, reduction, num_items_in_batch)


def _weighted_targets(logits, labels, ignore_index: int, weight) -> tuple[_Targets, torch.Tensor | None]:
    """:func:`_targets` whose ``mean`` is ``(w . x) / C`` with per-class ``weight`` (C,), and that weight."""
    num_classes = logits.shape[-1]
    weight = _class_weight(weight, num_classes, logits)
    return _targets(logits, labels, ignore_index, None if weight is None else weight / num_classes), weight


def _smoothed_nll(t: _Targets, epsilon: float, weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per item, the cross-entropy against ``(1 - epsilon) * one_hot(y) + epsilon / C`` (0 at ignored items), and
    each item's share of a mean: ``w_y`` with per-class weights (the ``mean`` of ``t`` is then ``(w . x) / C``)."""
    if weight is None:
        # -log p_y = lse - x_y and -mean_c log p_c = lse - mean(x)
        loss = torch.where(t.valid, t.lse - (1.0 - epsilon) * t.target - epsilon * t.mean, 0.0)
        return loss, t.valid.to(loss.dtype)
    item_weight = torch.where(t.valid, weight[t.labels], 0.0)
    # sum_c w_c (-log p_c) / C = lse * sum(w) / C - (w . x) / C
    smooth = t.lse * (weight.sum() / t.num_classes) - t.mean
    loss = torch.where(t.valid, (1.0 - epsilon) * item_weight * (t.lse - t.target) + epsilon * smooth, 0.0)
    return loss, item_weight


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    weight: torch.Tensor | list[float] | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` in float32 over ``(N, C)`` / ``(B, L, C)`` logits, with ``num_items_in_batch``.

    With per-class ``weight`` (C,) the mean divides by the sum of the weights of the counted items, as
    ``F.cross_entropy(weight=...)`` does; ``num_items_in_batch`` must then be that sum over the whole batch.
    ``label_smoothing > 0`` is :func:`label_smoothing_cross_entropy` with that ``epsilon`` (as ``F.cross_entropy``'s
    ``label_smoothing``).
    """
    kwargs = dict(ignore_index=ignore_index, reduction=reduction, num_items_in_batch=num_items_in_batch, weight=weight)
    if label_smoothing != 0:
        return label_smoothing_cross_entropy(logits, labels, epsilon=label_smoothing, **kwargs)
    if isinstance(logits, LMHeadLogits):  # from the statistics: -log p_y = lse - x_y
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        weight = _class_weight(weight, logits.shape[-1], logits)
        t = _targets(logits, labels, ignore_index)
        item_weight = t.valid.float() if weight is None else torch.where(t.valid, weight[t.labels], 0.0)
        loss = torch.where(t.valid, (t.lse - t.target) * item_weight, 0.0)
        return _reduce(loss, item_weight, t.shape, reduction, num_items_in_batch)
    labels_shape = labels.shape
    logits, labels = _flatten(logits, labels)
    weight = _class_weight(weight, logits.shape[-1], logits)
    if num_items_in_batch is None:
        loss = F.cross_entropy(logits, labels, weight=weight, ignore_index=ignore_index, reduction=reduction)
        return loss.reshape(labels_shape) if reduction == "none" else loss
    loss = F.cross_entropy(logits, labels, weight=weight, ignore_index=ignore_index, reduction="sum")
    return loss / num_items_in_batch


def dft_loss(
    logits: torch.Tensor | LMHeadLogits,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Dynamic fine-tuning: each item's cross-entropy weighted by its own probability, held constant,
    ``-sg(p_y) log p_y``.

    Wu et al. 2025, "On the Generalization of SFT: A Reinforcement Learning Perspective with Reward Rectification",
    https://arxiv.org/abs/2508.05629 (the DFT loss, Eq. 9): the gradient of cross-entropy rescaled per token by the
    probability the model gives it, so that unlikely tokens no longer dominate the update. The value is not a
    probability bound; only its gradient matters.

    Args:
        logits (`torch.Tensor` or `LMHeadLogits`): ``(N, C)`` or ``(B, L, C)`` (see the module docstring).
        labels (`torch.Tensor`): ``(N,)`` or ``(B, L)`` class indices; ``ignore_index`` marks items to skip.
        ignore_index (`int`, defaults to -100): label value that contributes nothing.
        reduction (`str`, defaults to "mean"): "mean" (over counted items), "sum" or "none" (0 at ignored ones).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): if given, returns ``sum / num_items_in_batch``, so
            gradient accumulation and DDP are exact with the Trainer's count.
    """
    t = _targets(logits, labels, ignore_index)
    log_p = t.log_p
    loss = torch.where(t.valid, -log_p.detach().exp() * log_p, 0.0)
    return _reduce(loss, t.valid.to(loss.dtype), t.shape, reduction, num_items_in_batch)


def poly1_loss(
    logits: torch.Tensor | LMHeadLogits,
    labels: torch.Tensor,
    *,
    epsilon: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    weight: torch.Tensor | list[float] | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Poly-1: cross-entropy plus ``epsilon`` times the first polynomial term, ``-log p_y + epsilon * (1 - p_y)``.

    Leng et al. 2022, "PolyLoss: A Polynomial Expansion Perspective of Classification Loss Functions",
    https://arxiv.org/abs/2204.12511 (Eq. 3): cross-entropy is ``sum_j (1 - p_y)^j / j``; Poly-1 raises the weight of
    the first term from 1 to ``1 + epsilon``, so confident items keep a larger gradient (``epsilon > 0``) or a
    smaller one (``-1 <= epsilon < 0``). ``epsilon=0`` is cross-entropy.

    With ``label_smoothing`` ``s`` the target is ``q = (1 - s) one_hot(y) + s / C`` in both terms, as in the paper's
    appendix: the cross-entropy against ``q`` plus ``epsilon * sum_c q_c (1 - p_c) = epsilon * ((1 - s)(1 - p_y) +
    s (1 - 1/C))``. With per-class ``weight`` each item's whole loss is weighted by ``w_y`` (the cross-entropy part
    exactly as ``F.cross_entropy(weight=..., label_smoothing=s)`` weighs it) and the mean divides by ``sum_i w_{y_i}``.

    Args:
        logits (`torch.Tensor` or `LMHeadLogits`): ``(N, C)`` or ``(B, L, C)`` (see the module docstring).
        labels (`torch.Tensor`): ``(N,)`` or ``(B, L)`` class indices; ``ignore_index`` marks items to skip.
        epsilon (`float`, defaults to 1.0): the first term's extra weight, >= -1 (below, the loss rises again as
            ``p_y`` nears 1).
        ignore_index (`int`, defaults to -100): label value that contributes nothing.
        reduction (`str`, defaults to "mean"): "mean" (over counted items), "sum" or "none" (0 at ignored ones).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): if given, returns ``sum / num_items_in_batch``
            (with ``weight``: the sum of the weights of the counted items of the whole batch).
        weight (`torch.Tensor` or `list[float]`, *optional*): per-class weights (C,).
        label_smoothing (`float`, defaults to 0.0): smoothing mass ``s`` in [0, 1].
    """
    if not epsilon >= -1.0:
        raise ValueError(f"epsilon must be >= -1, got {epsilon}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    t, weight = _weighted_targets(logits, labels, ignore_index, weight)
    nll, item_weight = _smoothed_nll(t, label_smoothing, weight)
    # 1 - p_y as -expm1(log p_y): no cancellation when p_y is near 1.
    one_minus_pt = (1.0 - label_smoothing) * -torch.expm1(t.log_p) + label_smoothing * (1.0 - 1.0 / t.num_classes)
    loss = torch.where(t.valid, nll + epsilon * item_weight * one_minus_pt, 0.0)
    return _reduce(loss, item_weight, t.shape, reduction, num_items_in_batch)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    temperature: float = 2.0,
    alpha: float = 0.5,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Knowledge distillation: ``alpha * T^2 * KL(softmax(t / T) || softmax(s / T)) + (1 - alpha) * CE(s, labels)``.

    Hinton et al. 2015, "Distilling the Knowledge in a Neural Network", https://arxiv.org/abs/1503.02531

    The ``T^2`` factor keeps the soft term's gradients about as large at any temperature. Items whose label is
    ``ignore_index`` count in neither term; without ``labels`` every item counts and only the soft term is used
    (weight 1).

    Args:
        student_logits (`torch.Tensor`): ``(N, C)`` or ``(B, L, C)``; gradients flow here.
        teacher_logits (`torch.Tensor`): same shape; treated as constants.
        labels (`torch.Tensor`, *optional*): ``(N,)`` or ``(B, L)`` hard labels for the ``(1 - alpha)`` term.
        temperature (`float`, defaults to 2.0): softening temperature T > 0.
        alpha (`float`, defaults to 0.5): weight of the soft term in [0, 1].
        ignore_index (`int`, defaults to -100): label value that marks items to skip.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): if given, returns ``sum / num_items_in_batch``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ"
        )
    num_classes = student_logits.shape[-1]
    student = student_logits.reshape(-1, num_classes).float()
    teacher = teacher_logits.detach().reshape(-1, num_classes).float()
    if labels is None:
        valid = torch.ones(student.shape[0], dtype=torch.bool, device=student.device)
        safe_labels, hard_weight = None, 0.0
        soft_weight = 1.0
    else:
        labels = labels.reshape(-1)
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, 0)
        soft_weight, hard_weight = alpha, 1.0 - alpha
    log_p_student = (student / temperature).log_softmax(dim=-1)
    log_p_teacher = (teacher / temperature).log_softmax(dim=-1)
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(dim=-1)
    loss = soft_weight * temperature**2 * kl
    if hard_weight > 0:
        nll = -student.log_softmax(dim=-1).gather(1, safe_labels.unsqueeze(1)).squeeze(1)
        loss = loss + hard_weight * nll
    loss = torch.where(valid, loss, 0.0)
    if num_items_in_batch is not None:
        return loss.sum() / num_items_in_batch
    return loss.sum() / valid.sum()


def parse_class_weights(value, name: str = "class_weights") -> list[float] | str | None:
    """Class weights as a user gives them (numbers, strings of numbers, or 'balanced', alone or in a one-item list)
    -> a list of floats, the string ``"balanced"`` or ``None``. Raises ``ValueError`` naming ``name``."""
    if value is None:
        return None
    value = [value] if isinstance(value, str) else list(value)
    if len(value) == 1 and isinstance(value[0], str) and value[0].strip().lower() == "balanced":
        return "balanced"
    try:
        weights = [float(v) for v in value]
    except (TypeError, ValueError):
        raise ValueError(
            f"{name}={value} is not allowed; give one number >= 0 per class (e.g. 1 3 3) or 'balanced'"
        ) from None
    if not weights or not all(0 <= w < float("inf") for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(
            f"{name}={value} is not allowed; give one finite number >= 0 per class, not all 0, or 'balanced'"
        )
    return weights


def balanced_class_weights(labels, num_classes: int, *, ignore_index: int = -100) -> list[float]:
    """Inverse class frequencies ``n_samples / (n_classes * count_c)`` (scikit-learn's "balanced" weights).

    Args:
        labels: a tensor, or an iterable of class ids or of sequences of them (e.g. a dataset's ``labels`` column,
            one list per sentence); ``ignore_index`` entries are not counted.
        num_classes (`int`): C; ids must lie in ``[0, C)``.
        ignore_index (`int`, defaults to -100): the id that marks items without a label.

    Returns:
        `list[float]`: one weight per class. A class that never occurs gets weight 0 (it is never a target).
    """
    if torch.is_tensor(labels):
        flat = labels.reshape(-1).long()
    else:
        flat = torch.as_tensor(list(_flat_ids(labels)), dtype=torch.long)
    flat = flat[flat != ignore_index]
    if flat.numel() and (flat.min() < 0 or flat.max() >= num_classes):
        raise ValueError(
            f"labels must be class ids in [0, {num_classes}) or {ignore_index}; got {flat.min()}..{flat.max()}"
        )
    counts = torch.bincount(flat, minlength=num_classes).double()
    if flat.numel() == 0:
        raise ValueError("balanced class weights need at least one label; the labels hold none")
    weights = torch.where(counts > 0, flat.numel() / (num_classes * counts), 0.0)
    return weights.tolist()


def _flat_ids(values):
    for value in values:
        if torch.is_tensor(value):
            yield from value.reshape(-1).tolist()
        elif isinstance(value, (list, tuple)):
            yield from _flat_ids(value)
        else:
            yield int(value)


# --- R-Drop ---


class _SymmetricKL(torch.autograd.Function):
    """Per row of two float32 ``(N, C)`` logit tensors: ``KL(p_a || p_b) + KL(p_b || p_a)``
    ``= sum_c (p_a - p_b) (log p_a - log p_b)``.

    Saves the two inputs and their log-sum-exps only; the backward recomputes the softmaxes (autograd on the written
    out formula would keep four more ``(N, C)`` tensors between forward and backward).
    """

    @staticmethod
    def forward(ctx, a, b):
        lse_a, lse_b = torch.logsumexp(a, -1, keepdim=True), torch.logsumexp(b, -1, keepdim=True)
        ctx.save_for_backward(a, b, lse_a, lse_b)
        log_a, log_b = a - lse_a, b - lse_b
        diff = log_a - log_b
        return torch.linalg.vecdot(log_a.exp_().sub_(log_b.exp_()), diff)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b, lse_a, lse_b = ctx.saved_tensors
        log_a, log_b = a - lse_a, b - lse_b
        diff = log_a - log_b
        p_a, p_b = log_a.exp_(), log_b.exp_()
        kl_ab = torch.linalg.vecdot(p_a, diff).unsqueeze(-1)
        kl_ba = -torch.linalg.vecdot(p_b, diff).unsqueeze(-1)
        grad = grad.unsqueeze(-1)
        # d/da KL(a||b) = p_a (diff - KL(a||b)); d/da KL(b||a) = p_a - p_b; and symmetrically for b.
        grad_a = (diff - kl_ab + 1).mul_(p_a).sub_(p_b).mul_(grad)
        grad_b = diff.neg_().sub_(kl_ba).add_(1).mul_(p_b).sub_(p_a).mul_(grad)
        return grad_a, grad_b


def rdrop_kl(
    logits_a: torch.Tensor,
    logits_b: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """R-Drop's consistency term: ``(KL(p_a || p_b) + KL(p_b || p_a)) / 2`` per item, at the items whose label is not
    ``ignore_index``, in float32.

    Liang et al. 2021, "R-Drop: Regularized Dropout for Neural Networks", https://arxiv.org/abs/2106.14448, Eq. 2.

    Args:
        logits_a, logits_b (`torch.Tensor`): ``(N, C)`` or ``(B, L, C)``: the two dropout passes over one batch.
        labels (`torch.Tensor`): ``(N,)`` or ``(B, L)``; only where they are ``ignore_index`` does it matter.
        ignore_index (`int`, defaults to -100): label value of the items that count in no term.
        reduction (`str`, defaults to "mean"): "mean" (over counted items), "sum" or "none".
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): if given, returns ``sum / num_items_in_batch``.
    """
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"the two passes' logits differ in shape: {tuple(logits_a.shape)} vs {tuple(logits_b.shape)}")
    labels_shape = labels.shape
    a, labels = _flatten(logits_a, labels)
    b = logits_b.reshape(a.shape).float()
    valid = labels != ignore_index
    kl = torch.where(valid, 0.5 * _SymmetricKL.apply(a, b), 0.0)
    return _reduce(kl, valid.to(kl.dtype), labels_shape, reduction, num_items_in_batch)


def rdrop_loss(
    logits_a: torch.Tensor,
    logits_b: torch.Tensor,
    labels: torch.Tensor,
    *,
    alpha: float,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """R-Drop: ``CE(a) + CE(b) + alpha / 2 * (KL(p_a || p_b) + KL(p_b || p_a))`` per counted item, in float32.

    Liang et al. 2021, "R-Drop: Regularized Dropout for Neural Networks", https://arxiv.org/abs/2106.14448, Eq. 3.
    ``logits_a`` and ``logits_b`` come from two forward passes over the same batch with independent dropout (or one
    pass over the batch concatenated with itself). The mean is over the counted items; with ``num_items_in_batch``
    it is ``sum / num_items_in_batch``, so gradient accumulation is exact. (In TricksTrainer a configured focal or
    label-smoothing loss replaces CE on both passes; see :func:`rdrop_kl` for the second term alone.)

    Args:
        logits_a, logits_b (`torch.Tensor`): ``(N, C)`` or ``(B, L, C)``.
        labels (`torch.Tensor`): ``(N,)`` or ``(B, L)`` class indices; ``ignore_index`` marks items to skip.
        alpha (`float`): weight of the consistency term, >= 0 (the paper uses 0.1 to 5 by task).
        ignore_index (`int`, defaults to -100): label value that contributes nothing.
        reduction (`str`, defaults to "mean"): "mean", "sum" or "none" (per item, 0 at ignored ones).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): if given, returns ``sum / num_items_in_batch``.
    """
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    kwargs = dict(ignore_index=ignore_index, reduction=reduction, num_items_in_batch=num_items_in_batch)
    ce = cross_entropy(logits_a, labels, **kwargs) + cross_entropy(logits_b, labels, **kwargs)
    return ce + alpha * rdrop_kl(logits_a, logits_b, labels, **kwargs)


def multilabel_categorical_crossentropy(
    scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Multilabel categorical cross-entropy ``log(1 + sum_neg e^s) + log(1 + sum_pos e^-s)`` per row, in float32.

    Su Jianlin 2020, https://kexue.fm/archives/7359 (the loss of GlobalPointer): each row (the last dimension) is one
    item whose positive classes should score above 0 and whose negative classes below it, with no threshold to tune
    and no imbalance weights however few positives a row holds. A span head's row is the ``W x W`` spans of one
    sentence for one entity type.

    Args:
        scores (`torch.Tensor`): ``(..., C)`` scores, any float dtype.
        targets (`torch.Tensor`): the same shape: 1 (positive), 0 (negative) or ``ignore_index`` (not a class of this
            row: padding, a span that ends before it starts).
        ignore_index (`int`, defaults to -100): target value of the entries that count in neither sum.
        reduction (`str`, defaults to "mean"): "mean" (over the rows with at least one counted entry), "sum" or "none"
            (per row, shape ``scores.shape[:-1]``; 0 for a row with no counted entry).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): if given, returns ``sum / num_items_in_batch``; an
            item is a row with at least one counted entry, so the count over a whole accumulated (and
            multi-process) batch makes gradient accumulation exact.
    """
    if scores.shape != targets.shape or scores.dim() < 1:
        raise ValueError(
            f"scores of shape {tuple(scores.shape)} do not match targets of shape {tuple(targets.shape)}: expected "
            "the same shape, one row per item in the last dimension"
        )
    counted = targets != ignore_index
    positive = counted & (targets == 1)
    negative = counted & (targets == 0)
    if bool((counted & ~positive & ~negative).any()):
        raise ValueError(f"targets must be 1, 0 or ignore_index={ignore_index}")
    scores = scores.float()
    loss = _log1p_sum_exp(scores, negative) + _log1p_sum_exp(-scores, positive)
    items = counted.any(dim=-1)
    return _reduce(loss, items.to(loss.dtype), loss.shape, reduction, num_items_in_batch)


def _log1p_sum_exp(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log(1 + sum_{mask} e^x)`` over the last dimension: 0 where ``mask`` holds nothing (a finite gradient too)."""
    x = x.masked_fill(~mask, -torch.inf)
    # The result does not depend on the shift m, so it takes no gradient; m >= 0 keeps the "1 +" term finite.
    m = x.amax(dim=-1, keepdim=True).clamp(min=0).detach()
    return m.squeeze(-1) + torch.log(torch.exp(-m).squeeze(-1) + torch.exp(x - m).sum(dim=-1))


class FocalLoss(nn.Module):
    """Module form of :func:`focal_loss`; takes the same keywords."""

    def __init__(self, *, gamma=2.0, alpha=None, ignore_index=-100, reduction="mean"):
        super().__init__()
        self.gamma, self.ignore_index, self.reduction = gamma, ignore_index, reduction
        self.register_buffer("alpha", None if alpha is None else torch.as_tensor(alpha, dtype=torch.float32))

    def forward(self, logits, labels, num_items_in_batch=None):
        return focal_loss(
            logits,
            labels,
            gamma=self.gamma,
            alpha=self.alpha,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            num_items_in_batch=num_items_in_batch,
        )


class LabelSmoothingCrossEntropy(nn.Module):
    """Module form of :func:`label_smoothing_cross_entropy`; takes the same keywords."""

    def __init__(self, *, epsilon=0.1, ignore_index=-100, reduction="mean"):
        super().__init__()
        self.epsilon, self.ignore_index, self.reduction = epsilon, ignore_index, reduction

    def forward(self, logits, labels, num_items_in_batch=None):
        return label_smoothing_cross_entropy(
            logits,
            labels,
            epsilon=self.epsilon,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            num_items_in_batch=num_items_in_batch,
        )
