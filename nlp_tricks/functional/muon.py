"""Muon for the hidden matrices and AdamW for the rest, as one ``torch.optim.Optimizer``.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) orthogonalises each 2-D weight's momentum with
a Newton-Schulz iteration; it is meant for the hidden layers' matrices, while embeddings, output heads and 1-D
parameters stay on AdamW. :class:`MuonWithAdamW` holds a ``torch.optim.Muon`` (torch >= :data:`MUON_SINCE`) for the
parameter groups marked ``"optimizer": "muon"`` and another optimizer (AdamW, or any ``torch.optim.Optimizer``
class) for every other group, and shows them as one optimizer: ``param_groups`` (the inner optimizers' own group
dicts, so a learning-rate scheduler or gradient clipping acts on both), ``step``, ``zero_grad``, ``state_dict`` /
``load_state_dict``. Muon's updates are scaled to AdamW's RMS by default (``adjust_lr_fn="match_rms_adamw"``, Liu et
al. 2025, https://arxiv.org/abs/2502.16982), so a group's AdamW learning rate and weight decay carry over.

Which parameters are Muon's is a group rule of the ``muon`` trick (``nlp_tricks/tricks/muon.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["MUON", "MUON_SINCE", "MuonWithAdamW", "muon_missing"]

#: The torch release that added ``torch.optim.Muon``.
MUON_SINCE = "2.9"
#: The value of a parameter group's ``"optimizer"`` key that puts the group on Muon.
MUON = "muon"


def muon_missing(what: str = "Muon") -> str | None:
    """Why ``torch.optim.Muon`` cannot be used here (one line naming the torch version that has it), or ``None``."""
    if hasattr(torch.optim, "Muon"):
        return None
    return (
        f"{what} needs torch.optim.Muon, which torch {MUON_SINCE} added (installed: torch {torch.__version__}); "
        f"pip install 'torch>={MUON_SINCE}'"
    )


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` for the groups marked ``"optimizer": "muon"``, ``adamw`` for the others, as one optimizer.

    The groups keep their keys (``lr``, ``weight_decay``, ``lr_scale``, ``label``); the AdamW groups come first in
    ``param_groups`` (group 0 is what upstream logs as ``learning_rate``). State dicts nest the inner optimizers'
    (``{"adamw": ..., "muon": ...}``), so resuming restores each optimizer's state exactly.

    Args:
        params: parameter groups (dicts); a group with ``"optimizer": "muon"`` holds 2-D tensors only (without an
            ``lr`` or ``weight_decay`` of its own it takes ``adamw``'s keyword arguments, as the other groups do).
        adamw (`tuple[type, dict]`, defaults to ``(torch.optim.AdamW, {})``): the optimizer class for every other
            group and its keyword arguments (the Trainer's ``--optim``: ``get_optimizer_cls_and_kwargs``).
        muon_lr_scale (`float`, defaults to 1.0): Muon's groups train at this multiple of their group's ``lr`` (a
            ``muon_lr`` of its own: ``muon_lr / learning_rate``); their ``lr_scale`` is multiplied alike.
        **muon_kwargs: ``torch.optim.Muon``'s other arguments (``momentum``, ``nesterov``, ``ns_steps``, ...);
            ``adjust_lr_fn`` defaults to ``"match_rms_adamw"``.

    Raises:
        RuntimeError: torch has no ``torch.optim.Muon`` (it names the version that has it).
    """

    def __init__(
        self,
        params: Iterable[dict],
        *,
        adamw: tuple[type, dict] | None = None,
        muon_lr_scale: float = 1.0,
        **muon_kwargs,
    ):
        problem = muon_missing("MuonWithAdamW")
        if problem is not None:
            raise RuntimeError(problem)
        groups = [dict(group) for group in params]
        if not groups or not all(isinstance(group, dict) for group in groups):
            raise ValueError("MuonWithAdamW takes parameter groups (dicts), at least one")
        cls, kwargs = adamw or (torch.optim.AdamW, {})
        # A group without its own lr / weight decay takes the other optimizer's, as its groups do.
        shared = {key: kwargs[key] for key in ("lr", "weight_decay") if key in kwargs}
        muon_groups = [self._muon_group({**shared, **g}, muon_lr_scale) for g in groups if g.get("optimizer") == MUON]
        other_groups = [g for g in groups if g.get("optimizer") != MUON]
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        if other_groups:
            self.optimizers["adamw"] = cls(other_groups, **kwargs)
        if muon_groups:
            muon_kwargs = {"adjust_lr_fn": "match_rms_adamw", **muon_kwargs}
            self.optimizers["muon"] = torch.optim.Muon(muon_groups, **muon_kwargs)
        super().__init__(self.param_groups, defaults={})

    @staticmethod
    def _muon_group(group: dict, muon_lr_scale: float) -> dict:
        if muon_lr_scale != 1.0:
            group["lr_scale"] = group.get("lr_scale", 1.0) * muon_lr_scale
            if "lr" in group:
                group["lr"] = group["lr"] * muon_lr_scale
        return group

    # The groups and the state are the inner optimizers' own, read through each time: a scheduler that sets
    # group["lr"] here sets it there, also after an inner load_state_dict replaced the group dicts (accelerate's
    # prepare and every resume do).
    @property
    def param_groups(self) -> list[dict]:
        return [
            group for optimizer in self.__dict__.get("optimizers", {}).values() for group in optimizer.param_groups
        ]

    @param_groups.setter
    def param_groups(self, value: list) -> None:
        if value:  # torch's __init__ sets [] first
            raise AttributeError("MuonWithAdamW's groups are its inner optimizers'; use add_param_group")

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.__dict__.get("optimizers", {}).values() for p, s in optimizer.state.items()}

    @state.setter
    def state(self, value) -> None:
        if value:  # torch's __init__ sets an empty defaultdict
            raise AttributeError("MuonWithAdamW's state is its inner optimizers'; use load_state_dict")

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (to Muon with ``"optimizer": "muon"``, else to the other optimizer)."""
        key = "muon" if param_group.get("optimizer") == MUON else "adamw"
        inner = self.optimizers.get(key)
        if inner is None:
            raise ValueError(f"MuonWithAdamW was built without {key} groups; it cannot take one now")
        if not any(group is param_group for group in inner.param_groups):  # torch's __init__ passes each group
            inner.add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers.values():
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: optimizer.state_dict() for name, optimizer in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(
                f"the optimizer state holds {sorted(state_dict)}, this MuonWithAdamW {sorted(self.optimizers)}"
            )
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state_dict[name])
