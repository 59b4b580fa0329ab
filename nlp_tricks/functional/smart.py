"""SMART's smoothness-inducing adversarial regulariser on the embedding output (virtual adversarial training).

Jiang et al. 2020, "SMART: Robust and Efficient Fine-Tuning for Pre-trained Natural Language Models through
Principled Regularized Optimization", https://arxiv.org/abs/1911.03437, Algorithm 1. For a batch with embedding
outputs ``x`` (the output of ``model.get_input_embeddings()``, as for FGM / PGD) and logits ``f(x)``:

    delta ~ N(0, sigma^2)                                           (the random start, sigma = noise_std)
    repeat steps times:                                             (T_x in the paper)
        g     = d/d delta  l_s(f(x), f(x + delta))                  (f(x) held fixed)
        delta = clip(delta + step_size * g / ||g||_inf, -epsilon, epsilon)   (||.||_inf per example)
    R     = l_s(f(x), f(x + delta))                                 (delta held fixed; gradient through both)

with ``l_s(P, Q) = KL(P || Q) + KL(Q || P)`` per item (per example, or per labelled token) on the softmaxes, averaged
over the items like the loss (:func:`nlp_tricks.losses.rdrop_kl` gives half of it). The training loss becomes
``loss + alpha * R``. The Bregman proximal point optimizer of the paper's Algorithm 1 is not part of this: the
regulariser works with any optimizer, as mt-dnn's ``SmartPerturbation`` is used.

How the embedding output is perturbed: :meth:`SMART.capture` records the embedding outputs of the forward it
wraps (after every other hook on the module: NEFTune's noise, an FGM perturbation), and the extra forwards of
:meth:`SMART.loss` replace each call's output by the recorded one plus ``delta``, with the module's other forward
hooks set aside for those forwards (no attack or noise hook sees them). The ascent forwards use the recorded outputs
detached and ask autograd for the gradient of ``delta`` only (no weight gradient is computed); the last forward is part
of the training graph, so ``R``'s gradient reaches the weights, the embeddings included.

No Trainer imports here; :class:`~nlp_tricks.TricksTrainer` wires it in with ``--smart_alpha``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .adversarial import embedding_modules
from .losses import rdrop_kl

__all__ = ["SMART", "symmetric_kl", "validate_smart"]


def validate_smart(
    alpha: float,
    epsilon: float,
    step_size: float,
    steps: int,
    noise_std: float = 1e-5,
    names=("alpha", "epsilon", "step_size", "steps", "noise_std"),
) -> None:
    """Raise ``ValueError`` naming the argument (``names``: what the caller calls them) for an invalid setting."""
    alpha_name, eps_name, size_name, steps_name, noise_name = names
    if not alpha >= 0:
        raise ValueError(f"{alpha_name}={alpha} is not allowed; it must be >= 0 (0: off)")
    if not epsilon > 0:
        raise ValueError(f"{eps_name}={epsilon} is not allowed; it must be > 0")
    if not step_size > 0:
        raise ValueError(f"{size_name}={step_size} is not allowed; it must be > 0")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"{steps_name}={steps} is not allowed; it must be an integer >= 1")
    if not noise_std >= 0:
        raise ValueError(f"{noise_name}={noise_std} is not allowed; it must be >= 0")


def symmetric_kl(
    logits_p: torch.Tensor,
    logits_q: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """SMART's ``l_s = KL(p || q) + KL(q || p)`` per item, at the items whose label is not ``ignore_index`` (every
    item when ``labels`` is None), in float32; ``reduction`` and ``num_items_in_batch`` as for the losses."""
    if labels is None:
        labels = torch.zeros(logits_p.shape[:-1], dtype=torch.long, device=logits_p.device)
    half = rdrop_kl(
        logits_p,
        logits_q,
        labels,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
    )
    return 2 * half


def _per_example(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


class SMART:
    """SMART's smoothness term around the embedding outputs of one forward (see the module docstring).

    Args:
        model (`nn.Module`): the model (unwrapped).
        epsilon (`float`, defaults to 1e-5): the radius of the perturbation, elementwise (the ``inf``-norm ball).
        step_size (`float`, defaults to 1e-3): eta, the size of one ascent step (on the ``inf``-normalised gradient).
        steps (`int`, defaults to 1): the ascent steps (T_x in the paper).
        noise_std (`float`, defaults to 1e-5): sigma of the Gaussian random start.
        target (`str`, *optional*): the name (or unique name suffix) of the embedding module; default
            ``model.get_input_embeddings()``, plus every embedding module that looks up the same weight.

    The defaults are the paper's (sigma = 1e-5, eta = 1e-3, epsilon = 1e-5, T_x = 1).

    Example::

        smart = SMART(model)
        with smart.capture():
            logits = model(**batch).logits
        loss = F.cross_entropy(logits, labels) + 1.0 * smart.loss(lambda: model(**batch).logits, logits)
        loss.backward()
    """

    def __init__(
        self,
        model: nn.Module,
        epsilon: float = 1e-5,
        step_size: float = 1e-3,
        steps: int = 1,
        noise_std: float = 1e-5,
        target: str | None = None,
    ):
        validate_smart(1.0, epsilon, step_size, steps, noise_std)
        self.model = model
        self.module, self.modules = embedding_modules(model, target)
        self.epsilon = float(epsilon)
        self.step_size = float(step_size)
        self.steps = int(steps)
        self.noise_std = float(noise_std)
        self._captured: list[torch.Tensor] = []
        self._handles: list = []

    # ---- Recording the clean forward's embedding outputs ------------------------------------------------------------

    def _record(self, module: nn.Module, args: tuple, output: torch.Tensor):
        if torch.is_grad_enabled():  # a forward outside the loss's graph (scheduled sampling's pass 1) is not x
            self._captured.append(output)

    def start_capture(self) -> None:
        """Record the embedding outputs of the forwards from now on (after the module's other hooks, registered
        earlier); :meth:`loss` stops it."""
        self.stop_capture()
        self._captured = []
        self._handles = [module.register_forward_hook(self._record) for module in self.modules]

    @property
    def capturing(self) -> bool:
        """Whether a forward's embedding outputs are being recorded (between :meth:`start_capture` and
        :meth:`loss`)."""
        return bool(self._handles)

    def stop_capture(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def capture(self) -> Iterator[SMART]:
        """Within the block, record the embedding outputs ``x`` of the forward :meth:`loss` regularises."""
        self.start_capture()
        try:
            yield self
        finally:
            self.stop_capture()

    # ---- The forwards at x + delta ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _replacing(self, outputs: list[torch.Tensor]) -> Iterator[None]:
        """Within the block, the k-th call of the embedding module returns ``outputs[k]``; its other forward hooks
        are set aside, so that no attack, noise or recording hook sees these forwards."""
        cursor = [0]

        def replace(module, args, output):
            k = cursor[0]
            if k >= len(outputs) or outputs[k].shape != output.shape:
                raise RuntimeError(
                    "the embedding module was called differently in SMART's forward than in the regularised forward; "
                    "the forward must be the same"
                )
            cursor[0] = k + 1
            return outputs[k]

        saved = []
        for module in self.modules:
            saved.append(module._forward_hooks)
            module._forward_hooks = OrderedDict()
            module.register_forward_hook(replace)
        try:
            yield
        finally:
            for module, hooks in zip(self.modules, saved):
                module._forward_hooks = hooks
        if cursor[0] != len(outputs):
            raise RuntimeError("SMART's forward called the embedding module fewer times than the regularised forward")

    def loss(
        self,
        forward: Callable[[], torch.Tensor],
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        num_items_in_batch: torch.Tensor | int | None = None,
        grad_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The smoothness term ``R`` (without ``alpha``) of the forward recorded by :meth:`capture`.

        Args:
            forward: runs the model's forward on the same batch and returns its logits; called ``steps + 1`` times
                (its embedding outputs are replaced by ``x + delta``).
            logits: the recorded forward's logits ``f(x)`` (their graph is kept: ``R``'s gradient flows through them).
            labels: the items that count (those not ``ignore_index``); ``None``: every item.
            num_items_in_batch: if given, ``R`` is a sum over the items divided by it (as the losses).
            grad_scale: fp16 loss scale applied to the ascent's divergence so its gradient does not underflow (the
                direction does not depend on it).

        Returns:
            ``R``, or ``None`` when an ascent gradient had an inf or a NaN (e.g. fp16 overflow): no term this time.
        """
        self.stop_capture()
        captured, self._captured = self._captured, []
        if not captured:
            raise RuntimeError(
                f"the regularised forward did not call the embedding module ({type(self.module).__name__}) inside "
                "SMART.capture(); name the module the forward uses with target= (adv_target)"
            )
        clean = logits.detach()
        deltas = [torch.randn(x.shape, dtype=torch.float32, device=x.device) * self.noise_std for x in captured]
        detached = [x.detach() for x in captured]
        for _ in range(self.steps):
            leaves = [delta.requires_grad_() for delta in deltas]
            with torch.enable_grad(), self._replacing([x + d.to(x.dtype) for x, d in zip(detached, leaves)]):
                divergence = symmetric_kl(clean, forward(), labels, ignore_index=ignore_index, reduction="sum")
            if grad_scale is not None:
                divergence = divergence * grad_scale
            grads = torch.autograd.grad(divergence, leaves, allow_unused=True)
            updated, finite = [], []
            for delta, grad in zip(deltas, grads):
                grad = torch.zeros_like(delta) if grad is None else grad.float()
                finite.append(torch.isfinite(grad).all())
                peak = _per_example(grad).abs().amax(1)
                step = torch.where(peak > 0, self.step_size / peak, 0.0).view(-1, *[1] * (grad.dim() - 1))
                updated.append((delta.detach() + grad * step).clamp_(-self.epsilon, self.epsilon))
            if not bool(torch.stack(finite).all()):
                return None
            deltas = updated
        with self._replacing([x + d.to(x.dtype) for x, d in zip(captured, deltas)]):
            perturbed = forward()
        return symmetric_kl(
            logits, perturbed, labels, ignore_index=ignore_index, num_items_in_batch=num_items_in_batch
        )
