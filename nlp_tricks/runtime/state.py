"""The one state store of a run's tricks: ``checkpoint-N/tricks_state.safetensors``, ``{state name: state_dict}``.

Every trick's ``state_dict()`` (counters, schedules, the EMA's tensors, a data stream's position) and the trainer's
own entry (``trainer.trick_state``, the optimizer's group signature) are written into this one file of each
checkpoint, before ``trainer_state.json`` (which the Trainer writes last), so a complete checkpoint holds them.
Checkpoints written before the store existed kept counters in ``trainer_state.json`` (a ``TrickStateCallback``
entry) and the EMA in ``ema_state.safetensors``: :func:`legacy_state` reads those.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "TRICKS_STATE_NAME",
    "TRAINER_ENTRY",
    "save_trick_states",
    "load_trick_states",
    "checkpoint_trick_states",
    "legacy_state",
    "StateEntries",
    "TrickStateView",
    "restore_states",
]

TRICKS_STATE_NAME = "tricks_state.safetensors"
# The trainer's own entry in the store (a trick cannot take this name).
TRAINER_ENTRY = "TricksTrainer"
# Where checkpoints written before the store kept what it holds now.
_LEGACY_CALLBACK = "TrickStateCallback"
_LEGACY_EMA_FILE = "ema_state.safetensors"


def save_trick_states(path: str, states: dict[str, dict]) -> None:
    """Write ``{name: state_dict}`` as one safetensors file: tensors as tensors, the rest as JSON metadata."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(value, key: str):
        if torch.is_tensor(value):
            name = f"{len(tensors)}:{key}"  # unique whatever the keys hold (dots, slashes)
            tensors[name] = value.detach().cpu().contiguous()
            return {"__tensor__": name}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"trick state {key!r}: dict keys must be strings")
            return {k: encode(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(v, f"{key}.{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(
            f"trick state {key!r} holds a {type(value).__name__}; a state_dict may hold tensors, numbers, strings, "
            "None, and lists and dicts of them"
        )

    structure = {name: encode(state, name) for name, state in states.items()}
    save_file(tensors, path, metadata={"structure": json.dumps(structure)})


def load_trick_states(path: str) -> dict[str, dict]:
    """Read :func:`save_trick_states`' file back (tensors on the CPU)."""
    with safe_open(path, framework="pt") as f:
        structure = json.loads(f.metadata()["structure"])
        tensors = {key: f.get_tensor(key) for key in f.keys()}

    def decode(value):
        if isinstance(value, dict):
            if set(value) == {"__tensor__"}:
                return tensors[value["__tensor__"]]
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return {name: decode(state) for name, state in structure.items()}


def checkpoint_trick_states(folder: str) -> dict[str, dict] | None:
    """The store of checkpoint ``folder``, or ``None`` when it has none."""
    path = os.path.join(folder, TRICKS_STATE_NAME)
    return load_trick_states(path) if os.path.isfile(path) else None


def legacy_state(folder: str) -> dict:
    """What a checkpoint written before the store holds of it: ``{"trick_state": {counter: value},
    "optimizer_groups": {...} or None, "ema_file": path or None}`` (empty values where it has nothing)."""
    entry = {}
    try:
        with open(os.path.join(folder, "trainer_state.json")) as f:
            entry = json.load(f).get("stateful_callbacks", {}).get(_LEGACY_CALLBACK) or {}
    except (OSError, ValueError):
        pass
    if isinstance(entry, list):
        entry = entry[0] if entry else {}
    attributes = entry.get("attributes", {}) if isinstance(entry, dict) else {}
    ema_file = os.path.join(folder, _LEGACY_EMA_FILE)
    return {
        "trick_state": dict(attributes.get("trick_state") or {}),
        "optimizer_groups": attributes.get("optimizer_groups"),
        "ema_file": ema_file if os.path.isfile(ema_file) else None,
    }


def store_entries(path: str) -> set[str]:
    """The entry names of a state store file, from its header alone (no tensor is read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return set(json.loads(header.get("__metadata__", {}).get("structure", "{}")))


@dataclass(frozen=True)
class StateEntries:
    """What a run needs of a checkpoint's state store to resume from it (a requirement of
    :func:`~nlp_tricks.runtime.resume.checkpoint_problem`): an entry for each of ``names``; a checkpoint written before
    the store instead needs ``legacy_files`` (when ``legacy`` says every holder can be read from the old layout)."""

    names: tuple[str, ...]
    legacy: bool = False
    legacy_files: tuple[str, ...] = ()

    def problem(self, folder: str) -> str | None:
        path = os.path.join(folder, TRICKS_STATE_NAME)
        if not os.path.isfile(path):
            if self.legacy and all(os.path.isfile(os.path.join(folder, name)) for name in self.legacy_files):
                return None
            return f"{TRICKS_STATE_NAME} is missing (this run needs it to resume)"
        try:
            entries = store_entries(path)
        except (OSError, ValueError, struct.error) as error:
            return f"{TRICKS_STATE_NAME} is unreadable ({error})"
        missing = [name for name in self.names if name not in entries]
        if missing:
            return (
                f"{TRICKS_STATE_NAME} holds no state for {', '.join(missing)} (this run needs it to resume; the "
                "checkpoint was written without that trick)"
            )
        return None


class TrickStateView(dict):
    """``trainer.trick_state``: the trainer's own numbers over the tricks' logged ones, as a plain dict (it
    serialises); what is written into it goes through to the trainer's own store."""

    def __init__(self, own: dict, logged: dict):
        super().__init__({**logged, **own})
        self._own = own

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._own[key] = value

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._own.pop(key, None)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


def restore_states(checkpoint: str, holders: dict, legacy_holders: dict | None = None) -> dict:
    """Load each state holder's entry of ``checkpoint``'s store into it (``holder.load_state_dict``) and return the
    trainer's own numbers. A checkpoint written before the store: each of ``legacy_holders`` (the built-in tricks,
    :class:`~nlp_tricks.tricks.base.BuiltInTrick`) restores from its ``legacy_state(legacy)``; no other holder
    existed then."""
    states = checkpoint_trick_states(checkpoint)
    legacy = legacy_state(checkpoint) if states is None or TRAINER_ENTRY not in states else None
    states = states or {}
    own = dict((states.get(TRAINER_ENTRY) or {}).get("trick_state") or (legacy or {}).get("trick_state") or {})
    legacy_holders = legacy_holders or {}
    for name, holder in holders.items():
        state = states.get(name)
        if state is None and legacy is not None and name in legacy_holders:
            state = legacy_holders[name].legacy_state(legacy)
        if state is not None:
            holder.load_state_dict(state)
    if legacy is not None:  # the trainer's own numbers are the counters no trick claims
        for holder in legacy_holders.values():
            for key in holder.logged_state:
                own.pop(key, None)
    return own
