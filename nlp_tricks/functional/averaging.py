"""An exponential moving average of a model's weights (EMA), updated in place with one fused lerp per step.

:class:`EMA` keeps a float32 moving average of a model's trainable parameters, updated after every optimizer step with
one fused ``torch._foreach_lerp_``; it swaps in for evaluation and back out bitwise, and saves to / loads from a
safetensors file. Wiring: ``nlp_tricks.runtime.averaging.EMACallback`` (any ``transformers.Trainer``) and the
``ema_decay`` trick of TricksTrainer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .models import CheckpointMismatchError, unwrap_model

__all__ = ["EMA", "ema_decay_at", "validate_ema_decay"]

logger = logging.getLogger(__name__)


# ---- EMA ------------------------------------------------------------------------------------------------------------


def validate_ema_decay(decay: float, name: str = "decay", *, allow_off: bool = False) -> None:
    """Raise ``ValueError`` naming the argument (``name``) unless ``decay`` is in (0, 1) (``[0, 1)`` with 0 = off)."""
    if not ((decay >= 0 if allow_off else decay > 0) and decay < 1):
        allowed = "[0, 1) (0 turns EMA off)" if allow_off else "(0, 1)"
        raise ValueError(f"{name}={decay} is not allowed; it must be in {allowed}, e.g. 0.999")


def ema_decay_at(decay: float, t: int, warmup: bool = True) -> float:
    """The decay of the EMA update that follows ``t`` earlier updates: ``min(decay, (1 + t) / (10 + t))``.

    The warm-up (Tensorflow's ``ExponentialMovingAverage(num_updates=...)``) keeps the first updates from averaging
    mostly the random-ish starting weights: 0.1 at the first update, 0.5 at the ninth, ``decay`` from
    ``t = (10 * decay - 1) / (1 - decay)`` on (989 steps for 0.99, 9,989 for 0.999). Without warm-up it is ``decay``.
    """
    return min(decay, (1.0 + t) / (10.0 + t)) if warmup else decay


class EMA:
    """Exponential moving average of a model's trainable parameters, kept in float32.

    Starts as the weights when it is built; each :meth:`update` (call it after every optimizer step) does::

        ema = decay_t * ema + (1 - decay_t) * w        decay_t = min(decay, (1 + t) / (10 + t))

    with ``t`` the number of earlier updates (0 at the first) and ``decay_t = decay`` when ``warmup=False``. The
    update is one fused ``torch._foreach_lerp_`` over all tensors. Only parameters with ``requires_grad`` when the EMA
    is built are averaged: each tensor once, so tied weights (one tensor under two names) are averaged once under
    their first name; buffers (e.g. BatchNorm statistics) are left alone. The average is float32 whatever the
    parameters' dtype, on the parameters' device: memory is one float32 copy of the trainable parameters.

    Evaluate with the average through :meth:`swapped_in` (or :meth:`swap_in` / :meth:`swap_out`): the raw weights are
    copied aside and copied back afterwards, bitwise. Save / restore with :meth:`state_dict` / :meth:`load_state_dict`
    or the file helpers :meth:`save` / :meth:`load` (safetensors).

    Paper: Polyak & Juditsky 1992 (averaging); the warm-up is TensorFlow's ``ExponentialMovingAverage``.

    Args:
        model (`nn.Module`): the model, wrapped (DDP, DataParallel, ``torch.compile``) or not.
        decay (`float`, defaults to 0.999): the decay in (0, 1); the average spans about ``1 / (1 - decay)`` steps.
        warmup (`bool`, defaults to ``True``): use ``min(decay, (1 + t) / (10 + t))`` instead of ``decay``.

    Example::

        ema = EMA(model, decay=0.999)
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update()
        with ema.swapped_in():
            evaluate(model)  # with the averaged weights; the raw ones are back afterwards
    """

    def __init__(self, model: nn.Module, decay: float = 0.999, *, warmup: bool = True):
        validate_ema_decay(decay)
        self.decay = float(decay)
        self.warmup = bool(warmup)
        # named_parameters() yields each tensor once: a tied weight appears under its first name only.
        named = [(n, p) for n, p in unwrap_model(model).named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to average")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [
                torch.empty_like(p, dtype=torch.float32, memory_format=torch.contiguous_format).copy_(p)
                for p in self.params
            ]
        self._float32 = all(p.dtype == torch.float32 for p in self.params)
        self.num_updates = 0
        self._backup: list[torch.Tensor] | None = None

    def decay_now(self) -> float:
        """The decay the next :meth:`update` uses."""
        return ema_decay_at(self.decay, self.num_updates, self.warmup)

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the current weights: ``ema = decay_t * ema + (1 - decay_t) * w``."""
        if self._backup is not None:
            raise RuntimeError("EMA.update() while the average is swapped in; call swap_out() first")
        weight = 1.0 - self.decay_now()
        # lerp_(ema, w, 1 - d) = ema + (1 - d) * (w - ema): one fused kernel over all tensors.
        if self._float32:
            torch._foreach_lerp_(self.shadow, self.params, weight)
        else:
            torch._foreach_lerp_(self.shadow, [p.float() for p in self.params], weight)
        self.num_updates += 1

    # ---- Swapping ----

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the average into the model's parameters, keeping a copy of the raw weights for :meth:`swap_out`."""
        if self._backup is not None:
            raise RuntimeError("the EMA weights are already swapped in")
        self._backup = [p.detach().clone() for p in self.params]
        torch._foreach_copy_(self.params, self.shadow)

    @torch.no_grad()
    def swap_out(self) -> None:
        """Restore the raw weights :meth:`swap_in` set aside (bitwise: a copy, no arithmetic)."""
        if self._backup is None:
            raise RuntimeError("the EMA weights are not swapped in")
        torch._foreach_copy_(self.params, self._backup)
        self._backup = None

    @contextmanager
    def swapped_in(self) -> Iterator[EMA]:
        """Context manager: the average in the model inside, the raw weights back (bitwise) on exit."""
        self.swap_in()
        try:
            yield self
        finally:
            self.swap_out()

    @torch.no_grad()
    def copy_to(self, model: nn.Module | None = None) -> None:
        """Overwrite the parameters with the average for good (no way back; see :meth:`swapped_in`)."""
        params = self.params if model is None else _match_params(self, model)
        torch._foreach_copy_(params, self.shadow)

    # ---- State ----

    def state_dict(self) -> dict:
        """``{"shadow": {name: float32 tensor}, "num_updates": int, "decay": float, "warmup": bool}``."""
        return {
            "shadow": dict(zip(self.names, self.shadow)),
            "num_updates": self.num_updates,
            "decay": self.decay,
            "warmup": self.warmup,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, where: str = "the EMA state") -> None:
        """Load a :meth:`state_dict`: names and shapes must match this EMA's exactly (an error names any that differ).

        The update count comes from ``state``; ``decay`` / ``warmup`` stay this EMA's (a warning says if they differ).
        """
        shadow = state["shadow"]
        missing = [n for n in self.names if n not in shadow]
        unexpected = [n for n in shadow if n not in set(self.names)]
        mismatched = [
            f"{n}: saved {tuple(shadow[n].shape)} vs model {tuple(s.shape)}"
            for n, s in zip(self.names, self.shadow)
            if n in shadow and shadow[n].shape != s.shape
        ]
        if missing or unexpected or mismatched:
            lines = [f"{where} does not match the model's trainable parameters:"]
            for title, items in [("missing", missing), ("unexpected", unexpected), ("shape mismatches", mismatched)]:
                if items:
                    lines.append(f"  {title} ({len(items)}): {', '.join(items[:10])}")
            raise CheckpointMismatchError("\n".join(lines))
        torch._foreach_copy_(self.shadow, [shadow[n] for n in self.names])
        self.num_updates = int(state["num_updates"])
        saved = (float(state.get("decay", self.decay)), bool(state.get("warmup", self.warmup)))
        if saved != (self.decay, self.warmup):
            logger.warning(
                f"{where} was built with decay={saved[0]}, warmup={saved[1]}; continuing with decay={self.decay}, "
                f"warmup={self.warmup}"
            )

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to a safetensors file (the update count, decay and warm-up in its metadata)."""
        from safetensors.torch import save_file

        metadata = {"format": "pt", "num_updates": str(self.num_updates), "decay": repr(self.decay)}
        metadata["warmup"] = str(self.warmup).lower()
        save_file(dict(zip(self.names, self.shadow)), os.fspath(path), metadata=metadata)

    def load(self, path: str | os.PathLike) -> None:
        """Read a file :meth:`save` wrote (strict names and shapes, see :meth:`load_state_dict`)."""
        from safetensors import safe_open

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist: no EMA state to restore")
        device = self.shadow[0].device
        with safe_open(path, framework="pt", device=str(device)) as f:
            metadata = f.metadata() or {}
            shadow = {name: f.get_tensor(name) for name in f.keys()}
        if "num_updates" not in metadata:
            raise ValueError(f"{path} has no 'num_updates' in its metadata: it was not written by EMA.save()")
        state = {
            "shadow": shadow,
            "num_updates": int(metadata["num_updates"]),
            "decay": float(metadata.get("decay", self.decay)),
            "warmup": metadata.get("warmup", str(self.warmup).lower()) == "true",
        }
        self.load_state_dict(state, where=path)


def _match_params(ema: EMA, model: nn.Module) -> list[torch.Tensor]:
    params = dict(unwrap_model(model).named_parameters())
    absent = [n for n in ema.names if n not in params]
    if absent:
        raise CheckpointMismatchError(f"the model has no parameters named {', '.join(absent[:10])}")
    return [params[n] for n in ema.names]
