"""Sharpness-aware minimisation (SAM) and its adaptive form (ASAM): the update uses the gradient at ``w + e(w)``.

Foret et al. 2021, "Sharpness-Aware Minimization for Efficiently Improving Generalization",
https://arxiv.org/abs/2010.01412: with ``g`` the gradient at the weights ``w``,

    e(w) = rho * g / ||g||                        (the norm over all trained parameters together)

and the optimizer steps from ``w`` with the gradient taken at ``w + e(w)``. ASAM (Kwon et al. 2021, "ASAM: Adaptive
Sharpness-Aware Minimization for Scale-Invariant Learning of Deep Neural Networks", https://arxiv.org/abs/2102.11600)
scales the neighbourhood by the weights, elementwise:

    e(w) = rho * T^2 g / ||T g||,   T = |w| + eta for weight tensors, T = 1 for biases

(the authors' code: ``T`` applies to parameters whose name contains "weight", ``eta = 0.01``; the paper suggests a
larger ``rho`` for ASAM, e.g. 0.5 to 2).

The weights are restored bitwise (a copy of each perturbed tensor is kept while the weights are moved). Under fp16
loss scaling the gradient is unscaled before its norm is taken, and a gradient with an inf or NaN (an overflow step,
which the scaler skips anyway) or with norm 0 leaves the weights where they are.

No Trainer imports here; :class:`~nlp_tricks.TricksTrainer` wires it in with ``--sam_rho`` (and ``--sam_adaptive``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = ["SAM", "validate_sam"]


def validate_sam(rho: float, adaptive: bool, eta: float = 0.01, names=("rho", "adaptive", "eta")) -> None:
    """Raise ``ValueError`` naming the argument (``names``: what the caller calls them) for an invalid setting."""
    rho_name, adaptive_name, eta_name = names
    if not rho >= 0:
        raise ValueError(f"{rho_name}={rho} is not allowed; it must be >= 0 (0: off)")
    if adaptive and rho == 0:
        raise ValueError(f"{adaptive_name}=True needs {rho_name} > 0 (ASAM's neighbourhood size, e.g. 0.5)")
    if not eta >= 0:
        raise ValueError(f"{eta_name}={eta} is not allowed; it must be >= 0")


class SAM:
    """Moves the trained parameters to ``w + e(w)`` from their current gradients, and back.

    Args:
        params: ``model`` (its parameters that require a gradient) or ``(name, parameter)`` pairs; the names decide
            ASAM's weight / bias rule.
        rho (`float`, defaults to 0.05): the neighbourhood's radius.
        adaptive (`bool`, defaults to False): ASAM's elementwise scaling by ``|w| + eta``.
        eta (`float`, defaults to 0.01): ASAM's offset, which keeps zero weights movable.

    Example (one optimizer step over the micro-batches of a step; the ascent uses their whole gradient)::

        sam = SAM(model, rho=0.05)
        clean_loss, sam_loss = sam.step([lambda b=b: model(**b).loss / len(batches) for b in batches])
        optimizer.step()
        optimizer.zero_grad()

    or, by hand: ``loss.backward(); if sam.perturb(): loss_fn().backward(); sam.restore()``.
    """

    def __init__(
        self,
        params: nn.Module | Iterable[tuple[str, nn.Parameter]],
        rho: float = 0.05,
        adaptive: bool = False,
        eta: float = 0.01,
    ):
        validate_sam(rho, adaptive, eta)
        if isinstance(params, nn.Module):
            params = params.named_parameters()
        self.params = [(name, p) for name, p in params if p.requires_grad]
        if not self.params:
            raise ValueError("SAM got no parameter that requires a gradient")
        self.rho = float(rho)
        self.adaptive = bool(adaptive)
        self.eta = float(eta)
        self._backups: list[tuple[nn.Parameter, torch.Tensor]] = []

    def _scale(self, name: str, p: torch.Tensor) -> torch.Tensor | None:
        """ASAM's ``T`` for this parameter, or ``None`` for the identity."""
        if not self.adaptive or "weight" not in name:
            return None
        return p.detach().float().abs().add_(self.eta)

    @torch.no_grad()
    def perturb(self, grad_scale: float | torch.Tensor | None = None) -> bool:
        """Move every parameter that has a gradient to ``w + e(w)`` and drop the gradients (``.grad = None``), so
        that the next backward gives the gradient at the moved weights alone.

        Args:
            grad_scale: the loss scale the gradients carry (fp16 ``GradScaler.get_scale()``); they are divided by it
                before the norm is taken.

        Returns:
            False, with nothing changed (weights and gradients), when there is no gradient or it has norm 0, an inf or
            a NaN.
        """
        if self._backups:
            raise RuntimeError("SAM.perturb() called twice without restore()")
        pairs = [(name, p) for name, p in self.params if p.grad is not None]
        if not pairs:
            return False
        home = pairs[0][1].grad.device
        squares = []
        for name, p in pairs:
            grad = _dense(p.grad).float()
            t = self._scale(name, p)
            squares.append(torch.linalg.vector_norm(grad if t is None else grad * t).pow(2).to(home))
        norm = torch.stack(squares).sum().sqrt()
        if grad_scale is not None:
            norm = norm / grad_scale
        if not bool(torch.isfinite(norm) & (norm > 0)):  # one device sync
            return False
        # e(w) = rho * T^2 g / ||T g||, with g = grad / grad_scale: the scale cancels from g / ||g||. A Python
        # float (the check above synchronised already), so that SAM's step is one fused add per parameter.
        factor = float(self.rho / (norm * (grad_scale if grad_scale is not None else 1.0)))
        for name, p in pairs:
            grad = _dense(p.grad)
            t = self._scale(name, p)
            self._backups.append((p, p.detach().clone()))
            if t is None and grad.dtype == p.dtype:
                p.add_(grad, alpha=factor)
            else:  # one parameter's temporary at a time
                step = grad.float() if t is None else grad.float() * t.pow_(2)
                p.add_(step.to(p.dtype), alpha=factor)
        for _, p in self.params:
            p.grad = None
        # Inside an enclosing autocast region the low-precision copies of the weights are cached: drop them.
        torch.clear_autocast_cache()
        return True

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the weights :meth:`perturb` moved, bitwise."""
        for p, backup in self._backups:
            p.data = backup  # the copy becomes the weight again: no second copy (the classic wrapper does the same)
        self._backups = []
        torch.clear_autocast_cache()

    @property
    def perturbed(self) -> bool:
        """Whether the weights are at ``w + e(w)`` now."""
        return bool(self._backups)

    def step(
        self,
        loss_fns: Sequence[Callable[[], torch.Tensor]],
        backward: Callable[[torch.Tensor], None] | None = None,
        *,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One SAM step over the micro-batches of an optimizer step, leaving the gradient at ``w + e(w)`` in
        ``.grad``.

        Every ``loss_fns[i]`` runs its micro-batch's forward and returns its share of the step's loss; each runs
        twice: at ``w`` (the ascent uses the sum of these gradients: the step's whole gradient) and at ``w + e(w)``
        (:meth:`perturbed_passes`).

        Args:
            backward: backpropagates a loss (default ``loss.backward()``, scaled by ``grad_scaler`` if given).
            no_sync: a context in which a backward does not all-reduce (DDP's ``model.no_sync``): every backward but
                the last runs inside it, so the step all-reduces once, as plain training does; the ascent then uses
                this process's gradient.
            grad_scaler: fp16 ``GradScaler`` (its scale is divided out of the norm).

        Returns:
            ``(clean_loss, sam_loss)``: the summed losses at ``w`` and at ``w + e(w)``, detached; ``sam_loss`` is
            ``None`` when the ascent was skipped (gradient 0, inf or NaN): then ``.grad`` holds the gradient at ``w``.
        """
        if backward is None:
            backward = (lambda loss: grad_scaler.scale(loss).backward()) if grad_scaler else torch.Tensor.backward
        clean = []
        with (no_sync or contextlib.nullcontext)():
            for loss_fn in loss_fns:
                loss = loss_fn()
                backward(loss)
                clean.append(loss.detach())

        def as_pass(loss_fn):
            def run(weight: float) -> torch.Tensor:
                loss = loss_fn()
                backward(loss if weight == 1.0 else loss * weight)
                return loss.detach()

            return run

        sam_loss = self.perturbed_passes(
            [as_pass(fn) for fn in loss_fns],
            no_sync=no_sync,
            grad_scale=grad_scaler.get_scale() if grad_scaler is not None else None,
        )
        return torch.stack(clean).sum(), sam_loss

    def perturbed_passes(
        self,
        passes: Sequence[Callable[[float], torch.Tensor]],
        *,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        grad_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """SAM's second half: move to ``w + e(w)`` from the gradients in ``.grad``, run every pass there, move back.

        ``passes[i](weight)`` runs micro-batch ``i``'s forward and the backward of ``weight * loss`` and returns the
        detached loss. Every pass but the last runs inside ``no_sync``. Returns the summed losses, or ``None`` when
        the ascent was skipped (gradient 0, inf or NaN: ``.grad`` keeps the gradient at ``w``); with ``no_sync`` the
        last pass then still runs once with weight 0, so that every process all-reduces the same number of times.
        """
        if not self.perturb(grad_scale):
            if no_sync is not None:  # the other processes all-reduce once: so must this one
                passes[-1](0.0)
            return None
        losses = []
        try:
            for i, run in enumerate(passes):
                with contextlib.nullcontext() if i == len(passes) - 1 or no_sync is None else no_sync():
                    losses.append(run(1.0))
        finally:
            self.restore()
        return torch.stack(losses).sum()


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.layout != torch.strided else grad
