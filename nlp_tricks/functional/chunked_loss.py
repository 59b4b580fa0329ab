"""A causal LM's loss from its last hidden state, in chunks of tokens through a linear LM head, never holding the
``(tokens, vocab)`` logits.

:class:`LMHeadLogits` stands for the logits ``linear(hidden, weight, bias) / temperature`` without computing them:
the losses of :mod:`nlp_tricks.functional.losses` that are functions of each item's log-sum-exp, target logit and
mean logit (``cross_entropy``, ``focal_loss``, ``label_smoothing_cross_entropy``, ``dft_loss``, ``poly1_loss``, class
weights included: each loss type whose entry in the loss table says ``chunked``) take it in place of a logits
tensor. Their statistics are computed by :class:`_ChunkedHeadStats` over the positions whose label is not ignored,
``chunk_size`` tokens at a time; its backward recomputes each chunk's logits and writes the gradients of the hidden
states, the weight and the bias chunk by chunk. Memory: one chunk's logits (and its gradient, in place) instead of
the whole batch's, which is several times the logits in float32 for upstream's loss (the logits, their log-softmax,
its gradient).

The idea is that of Liger's fused linear cross-entropy and Apple's cut cross-entropy (Wijmans et al. 2024,
https://arxiv.org/abs/2411.09009), in plain torch and for every loss above.

:class:`HeadInputCapture` takes the hidden states from a model's forward without letting it compute the full logits
(a forward pre-hook on the head), and checks on the one position it lets through that the model's logits are the
head's output as it is (no soft-capping or scaling after the head, which this loss would not reproduce).

No Trainer imports here.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LMHeadLogits", "HeadInputCapture", "chunk_rows", "is_plain_linear", "CHUNK_ELEMENTS"]

#: The number of logits per chunk (rows x vocabulary) when no ``chunk_size`` is given: 32 MiB of float32, so the
#: chunk's logits and their gradient stay a small share of a step's memory at any vocabulary size.
CHUNK_ELEMENTS = 2**23


def chunk_rows(vocab_size: int, chunk_size: int | None = None) -> int:
    """The tokens per chunk: ``chunk_size``, or as many as :data:`CHUNK_ELEMENTS` logits hold (at least 1)."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


@dataclasses.dataclass(frozen=True)
class LMHeadLogits:
    """The logits ``F.linear(hidden, weight, bias) / temperature`` of a linear LM head, never computed whole.

    Pass it where the losses of :mod:`nlp_tricks.functional.losses` take ``logits`` (``cross_entropy``,
    ``focal_loss``, ``label_smoothing_cross_entropy``, ``dft_loss``, ``poly1_loss``): the loss, and its gradients with
    respect to ``hidden``, ``weight`` and ``bias``, equal those on the materialised logits up to float summation
    order.
    ``hidden`` is ``(..., H)`` with the labels' shape before ``H``; dividing by a number divides the temperature.

    Attributes:
        hidden (`torch.Tensor`): the head's input, ``(B, L, H)`` or ``(N, H)``.
        weight (`torch.Tensor`): the head's ``(V, H)`` weight (tied to the input embeddings or not).
        bias (`torch.Tensor`, *optional*): the head's ``(V,)`` bias.
        temperature (`float`, defaults to 1.0): the logits are divided by it (after the head, in its dtype).
        chunk_size (`int`, *optional*): tokens per chunk (default: :data:`CHUNK_ELEMENTS` logits' worth).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    temperature: float = 1.0
    chunk_size: int | None = None

    @property
    def shape(self) -> torch.Size:
        """The shape of the logits it stands for: the hidden states' with the vocabulary last."""
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def __truediv__(self, temperature: float) -> LMHeadLogits:
        return dataclasses.replace(self, temperature=self.temperature * float(temperature))

    def flatten(self) -> LMHeadLogits:
        """The same logits as ``(N, V)`` rows."""
        return dataclasses.replace(self, hidden=self.hidden.reshape(-1, self.hidden.shape[-1]))

    def stats(
        self, labels: torch.Tensor, valid: torch.Tensor, mean_weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row (of :meth:`flatten`'s): ``logsumexp(x)``, the target logit ``x_y`` and ``mean(x)`` (``x @
        mean_weight`` with one), computed only where ``valid`` (0 elsewhere), as ``_LogitStats`` of the losses."""
        rows = self.flatten()
        return _ChunkedHeadStats.apply(
            rows.hidden,
            self.weight,
            self.bias,
            labels.reshape(-1),
            valid.reshape(-1),
            mean_weight,
            self.temperature,
            chunk_rows(self.weight.shape[0], self.chunk_size),
        )


class _ChunkedHeadStats(torch.autograd.Function):
    """``(lse, target, mean)`` of each valid row of ``F.linear(hidden, weight, bias) / temperature`` (float32),
    ``chunk`` rows at a time; the backward recomputes each chunk's logits. Rows that are not valid get 0 and no
    gradient. The logits are computed in the dtype (and autocast state) of the forward, as the model's head would,
    then upcast, as the losses upcast the model's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid, mean_weight, temperature, chunk):
        rows = valid.nonzero().squeeze(1)
        selected = hidden.index_select(0, rows)
        targets = labels.index_select(0, rows)
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.temperature, ctx.chunk, ctx.num_rows = temperature, chunk, hidden.shape[0]
        ctx.hidden_dtype = hidden.dtype
        n = rows.numel()
        out = [torch.zeros(n, dtype=torch.float32, device=hidden.device) for _ in range(3)]
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            x = _chunk_logits(selected[part], weight, bias, temperature)
            out[0][part] = torch.logsumexp(x, dim=-1)
            out[1][part] = x.gather(1, targets[part].unsqueeze(1)).squeeze(1)
            out[2][part] = x.mean(dim=-1) if mean_weight is None else x @ mean_weight
        ctx.save_for_backward(selected, weight, bias, targets, rows, out[0], mean_weight)
        full = [torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device) for _ in range(3)]
        return tuple(f.index_copy_(0, rows, o) for f, o in zip(full, out))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lse, grad_target, grad_mean):
        selected, weight, bias, targets, rows, lse, mean_weight = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_lse, grad_target, grad_mean = (g.index_select(0, rows) for g in (grad_lse, grad_target, grad_mean))
        grad_hidden = grad_weight = grad_bias = None
        if need_hidden:
            grad_hidden = torch.zeros(ctx.num_rows, selected.shape[1], dtype=ctx.hidden_dtype, device=selected.device)
        if need_weight:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if need_bias:
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        device_type, enabled, dtype = ctx.autocast
        chunk = ctx.chunk
        for start in range(0, selected.shape[0], chunk):
            part = slice(start, start + chunk)
            h = selected[part]
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                x = _chunk_logits(h, weight, bias, ctx.temperature, upcast=False)
            compute_dtype = x.dtype
            # d/dx of g_lse * lse + g_y * x_y + g_mean * mean: softmax(x) g_lse + onehot(y) g_y + g_mean / V.
            grad = x.float().sub_(lse[part].unsqueeze(1)).exp_().mul_(grad_lse[part].unsqueeze(1))
            if mean_weight is None:
                grad.add_((grad_mean[part] / grad.shape[1]).unsqueeze(1))
            else:
                grad.addr_(grad_mean[part], mean_weight)
            grad.scatter_add_(1, targets[part].unsqueeze(1), grad_target[part].unsqueeze(1))
            # As autograd through `.float()` and `/ temperature`: the gradient in the head's dtype, then divided.
            grad = grad.to(compute_dtype)
            if ctx.temperature != 1.0:
                grad = grad / ctx.temperature
            if need_hidden:
                grad_hidden.index_copy_(0, rows[part], (grad @ weight.to(compute_dtype)).to(ctx.hidden_dtype))
            if need_weight:
                grad_weight.add_(grad.t() @ h.to(compute_dtype))
            if need_bias:
                grad_bias.add_(grad.sum(0))
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if need_bias:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _chunk_logits(hidden, weight, bias, temperature: float, upcast: bool = True) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    if temperature != 1.0:
        logits = logits / temperature
    return logits.float() if upcast else logits


class HeadInputCapture:
    """While entered, keep the input of a linear LM head and let the head compute the last position only.

    A forward pre-hook on ``head``: the model's forward runs as always, but its logits are ``(B, 1, V)`` instead of
    ``(B, L, V)``; :meth:`logits` then gives the :class:`LMHeadLogits` of the whole input, or ``None`` when the
    model's logits are not the head's output as it is (it soft-caps or scales them: compare that one position), the
    head was not called exactly once, or its input does not have ``labels_shape``.
    """

    def __init__(self, head: nn.Linear):
        self.head = head
        self.hidden: torch.Tensor | None = None
        self.calls = 0
        self._handle = None

    def __enter__(self) -> HeadInputCapture:
        self._handle = self.head.register_forward_pre_hook(self._keep)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _keep(self, module, args):
        self.calls += 1
        self.hidden = args[0]
        return (args[0][..., -1:, :], *args[1:])

    def logits(self, model_logits: torch.Tensor | None, labels_shape: torch.Size) -> LMHeadLogits | None:
        """The whole input's logits as :class:`LMHeadLogits`, or ``None`` (see the class docstring)."""
        hidden = self.hidden
        if self.calls != 1 or hidden is None or hidden.dim() < 2 or hidden.shape[:-1] != labels_shape:
            return None
        if model_logits is None or model_logits.shape != (*hidden.shape[:-2], 1, self.head.weight.shape[0]):
            return None
        with torch.no_grad():
            expected = F.linear(hidden[..., -1:, :], self.head.weight, self.head.bias)
        # The same operation on the same input gives the same numbers; the tolerance only allows another kernel.
        if not torch.allclose(model_logits.float(), expected.float(), rtol=1e-4, atol=1e-5):
            return None
        return LMHeadLogits(hidden, self.head.weight, self.head.bias)


def is_plain_linear(module) -> bool:
    """Whether ``module`` computes ``F.linear(x, weight, bias)`` and nothing else (an ``nn.Linear`` whose forward is
    not overridden, as a quantized or adapter layer's is)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
