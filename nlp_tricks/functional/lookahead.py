"""Lookahead (Zhang et al. 2019, https://arxiv.org/abs/1907.08610): slow weights that follow the trained ("fast")
weights every ``k`` optimizer steps, in plain torch.

Every ``k`` steps of the inner optimizer::

    slow = slow + alpha * (fast - slow)        (float32)
    fast = slow                                (training goes on from the slow weights)

The slow weights start as the weights before the first step. The inner optimizer's state (AdamW's moments) is kept
across a sync, as in the paper's experiments. Wiring: the ``lookahead_k`` trick of TricksTrainer
(``nlp_tricks/tricks/lookahead.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["SlowWeights", "lookahead_sync", "validate_lookahead"]


def validate_lookahead(k: int, alpha: float, k_name: str = "k", alpha_name: str = "alpha", allow_off=False) -> None:
    """Raise ``ValueError`` naming the argument unless ``k`` is an int >= 1 (>= 0 with 0 = off) and ``alpha`` is in
    (0, 1]."""
    if isinstance(k, bool) or not isinstance(k, int) or k < (0 if allow_off else 1):
        allowed = "an integer >= 0 (0 turns Lookahead off)" if allow_off else "an integer >= 1"
        raise ValueError(f"{k_name}={k!r} is not allowed; it must be {allowed}, e.g. 5")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"{alpha_name}={alpha} is not allowed; it must be in (0, 1], e.g. 0.5")


@torch.no_grad()
def lookahead_sync(slow: Sequence[torch.Tensor], fast: Sequence[torch.Tensor], alpha: float) -> None:
    """Lookahead's outer step, in place: ``slow = slow + alpha * (fast - slow)``, then ``fast = slow`` (cast to the
    fast weights' dtype). ``slow`` are float32 tensors shaped as ``fast``."""
    for s, f in zip(slow, fast, strict=True):
        s.add_(alpha * (f.float() - s))
        f.copy_(s)


class SlowWeights:
    """Lookahead's slow weights over named parameters: call :meth:`step` after every optimizer step.

    Args:
        params: ``(name, parameter)`` pairs (each tensor once), the weights the optimizer updates.
        k (`int`): the optimizer steps between two syncs (>= 1).
        alpha (`float`): the slow weights' step towards the fast ones, in (0, 1].

    Example::

        slow = SlowWeights(model.named_parameters(), k=5, alpha=0.5)
        for batch in loader:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            slow.step()  # every 5th call: slow += 0.5 * (fast - slow); fast = slow
    """

    def __init__(self, params: Iterable[tuple[str, torch.Tensor]], k: int, alpha: float):
        validate_lookahead(k, alpha)
        self.k, self.alpha = k, float(alpha)
        named = list(params)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.slow = [
                torch.empty_like(p, dtype=torch.float32, memory_format=torch.contiguous_format).copy_(p)
                for p in self.params
            ]
        self.count = 0  # optimizer steps taken since the slow weights were made (syncs: count // k)

    def step(self) -> bool:
        """Count one optimizer step; on every ``k``-th, sync (:func:`lookahead_sync`). Returns whether it synced."""
        self.count += 1
        if self.count % self.k:
            return False
        lookahead_sync(self.slow, self.params, self.alpha)
        return True

    def state_dict(self) -> dict:
        return {"count": self.count, "slow": dict(zip(self.names, self.slow))}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s value; the parameter names and shapes must be this object's."""
        saved = state["slow"]
        missing = [n for n in self.names if n not in saved]
        unexpected = [n for n in saved if n not in self.names]
        if missing or unexpected:
            raise ValueError(
                f"the saved Lookahead slow weights do not fit these parameters: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        for name, slow in zip(self.names, self.slow):
            if saved[name].shape != slow.shape:
                raise ValueError(
                    f"the saved Lookahead slow weight {name!r} has shape {tuple(saved[name].shape)}, the parameter "
                    f"{tuple(slow.shape)}"
                )
            slow.copy_(saved[name])
        self.count = int(state["count"])
