"""Portable, strict, safe checkpoint loading: any state-dict file or folder into any model, on any device."""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Mapping

import torch
from torch import nn

from ..functional.models import CheckpointMismatchError, unwrap_model

__all__ = [
    "load_state_dict_portable",
    "read_state_dict",
    "is_state_dict_file",
    "CheckpointMismatchError",
]

logger = logging.getLogger(__name__)

# Leading key prefixes added by wrappers: DataParallel / DDP (`module.`) and torch.compile (`_orig_mod.`).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
TORCH_SUFFIXES = (".pt", ".bin", ".pth")
STATE_DICT_SUFFIXES = TORCH_SUFFIXES + (".safetensors",)
# What save_pretrained / the Trainer write, in the order transformers prefers them.
WEIGHTS_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# The files of a model folder that describe the model beside its weights and config.json: generation settings,
# tokenizer and processor files.
DESCRIPTION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)
MAX_LISTED = 10


# ---- Reading ---------------------------------------------------------------------------------------------------


def is_state_dict_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a state-dict file :func:`load_state_dict_portable` reads (.pt/.bin/.pth/.safetensors)."""
    return os.path.isfile(path) and str(path).endswith(STATE_DICT_SUFFIXES)


def read_state_dict(source, *, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a state dict from a file, a ``save_pretrained`` / Trainer folder (sharded too) or a mapping.

    The wrappers ``{"model": ...}`` and ``{"state_dict": ...}`` are opened; key prefixes are left as they are (see
    :func:`load_state_dict_portable` for their removal). Torch files load with ``weights_only=True``: a file that
    needs arbitrary unpickling raises ``pickle.UnpicklingError`` and none of its code runs.

    Args:
        source: path to a ``.pt`` / ``.bin`` / ``.pth`` / ``.safetensors`` file or a folder, or a state dict.
        map_location (`str` or `torch.device`, defaults to ``"cpu"``): where the tensors are loaded.
    """
    device = _device(map_location)
    if isinstance(source, Mapping):
        state, where = source, "the state dict passed in"
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            state, where = _read_folder(path, device), path
        elif os.path.isfile(path):
            state, where = _read_file(path, device), path
        else:
            raise FileNotFoundError(f"source={path!r} is neither a file nor a folder")
    else:
        raise TypeError(
            f"source must be a path (file or folder) or a state dict (a mapping), got {type(source).__name__}"
        )
    state = _open_wrappers(state, where)
    if isinstance(source, Mapping):
        state = {k: v.to(device) for k, v in state.items()}
    return state


def _device(map_location) -> torch.device:
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError(
            f"map_location must be a device (a str such as 'cpu' / 'cuda:0', or a torch.device), got "
            f"{type(map_location).__name__}"
        )
    return torch.device(map_location)


def _read_file(path: str, device: torch.device) -> Mapping:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        # safetensors takes "cpu" / "cuda:0" strings; a bare "cuda" means the current device.
        return load_file(path, device=str(device))
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(
            f"Refusing to load {path}: it needs arbitrary unpickling, which can run any code the file carries, and "
            "only tensors and plain containers are allowed (torch.load(weights_only=True)). If you trust the file, "
            "convert it once: torch.save(torch.load(path, weights_only=False)['<key>'].state_dict(), new_path), or "
            f"save it as safetensors. torch said: {str(error).splitlines()[0]}"
        ) from None


def _read_folder(folder: str, device: torch.device) -> dict[str, torch.Tensor]:
    for name in WEIGHTS_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".index.json"):
            return dict(_read_file(path, device))
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(_read_file(os.path.join(folder, shard), device))
        absent = sorted(set(weight_map) - set(state))
        if absent:
            raise CheckpointMismatchError(f"{path} lists {len(absent)} keys its shards do not hold: {_first(absent)}")
        return state
    raise FileNotFoundError(
        f"No model weights in {folder}: looked for {', '.join(WEIGHTS_FILES)}; it holds "
        f"{', '.join(sorted(os.listdir(folder))) or 'nothing'}"
    )


def _open_wrappers(state: Mapping, where: str) -> dict[str, torch.Tensor]:
    """Open ``{"state_dict": sd}`` / ``{"model": sd}`` (nested too) and check that every value is a tensor."""
    while not all(torch.is_tensor(v) for v in state.values()):
        inner = next((state[k] for k in ("state_dict", "model") if isinstance(state.get(k), Mapping)), None)
        if inner is None:
            bad = [k for k, v in state.items() if not torch.is_tensor(v)]
            raise TypeError(
                f"{where} is not a state dict: {len(bad)} values are not tensors ({_first(bad)}), and it has no "
                "'state_dict' or 'model' entry holding one"
            )
        state = inner
    return dict(state)


# ---- Prefixes --------------------------------------------------------------------------------------------------


def _wrapper_prefix(keys) -> str:
    """The chain of wrapper prefixes every key starts with (``""`` if none): ``module._orig_mod.`` etc.

    A wrapper prefixes every key, so only a prefix shared by all keys is one; per key stripping would also eat the
    name of a real submodule called ``module``, and an inner ``encoder.module.weight`` is never touched.
    """
    keys = list(keys)
    prefix = ""
    while keys:
        token = next((t for t in WRAPPER_PREFIXES if all(k.startswith(prefix + t) for k in keys)), None)
        if token is None:
            break
        prefix += token
    return prefix


# ---- Loading ---------------------------------------------------------------------------------------------------


def load_state_dict_portable(
    model: nn.Module, source, *, map_location: str | torch.device = "cpu", strict: bool = True
) -> nn.Module:
    """Load any checkpoint of ``model`` strictly and safely, whatever wrapped it when it was saved, onto one device.

    - ``source``: a ``.pt`` / ``.bin`` / ``.pth`` / ``.safetensors`` file, a ``save_pretrained`` / Trainer
      checkpoint folder (``model.safetensors``, ``pytorch_model.bin`` or their sharded ``*.index.json``), or a state
      dict; ``{"model": ...}`` / ``{"state_dict": ...}`` wrappers are opened.
    - Prefixes: the leading ``module.`` (DataParallel / DDP) and ``_orig_mod.`` (``torch.compile``) that a wrapper
      puts on every key are removed, in any order or nesting, on both sides, so ``model`` may itself be wrapped. Only
      prefixes: ``encoder.module.weight`` keeps its inner ``module.`` (``k.replace("module.", "")`` would not).
    - Strict: any missing key, unexpected key or shape mismatch raises :class:`CheckpointMismatchError` naming the
      first 10 of each with their counts. Keys the model ties (e.g. a decoder tied to the input embeddings; one
      tensor under two names) need only one name in the checkpoint: ``save_pretrained`` writes one. Keys of the
      model's non-persistent buffers (``position_ids`` in older checkpoints) are not weights and are skipped.
    - Safe: torch files load with ``weights_only=True``; one that needs arbitrary unpickling is refused and none of
      its code runs.

    ``strict=False`` is not offered on purpose: it "loads" a model whose unmatched weights silently stay random (a
    renamed head, a forgotten prefix) and the error only shows as bad predictions. Rename keys instead, or load a
    filtered state dict into the submodule that should receive it.

    Args:
        model (`nn.Module`): the model to load into, wrapped or not; it is moved to ``map_location``.
        source: a path (file or folder) or a state dict, as above.
        map_location (`str` or `torch.device`, defaults to ``"cpu"``): the device of the tensors and of the model.
        strict (`bool`, defaults to ``True``): must be ``True`` (see above).

    Returns:
        ``model`` (the object passed in), with the weights loaded, on ``map_location``.
    """
    if strict is not True:
        raise ValueError(
            f"strict={strict!r} is not allowed; load_state_dict_portable only loads strictly (strict=True): a partial "
            "load leaves the unmatched weights random without a trace. Rename the keys or load a filtered state dict "
            "into the submodule instead."
        )
    device = _device(map_location)
    state = read_state_dict(source, map_location=device)
    where = "the state dict passed in" if isinstance(source, Mapping) else os.fspath(source)
    target = unwrap_model(model)
    _load_strict(target, state, where)  # raises before touching the model on any mismatch
    target.to(device)
    return model


def _load_strict(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    expected = module.state_dict(keep_vars=True)
    src_prefix, tgt_prefix = _wrapper_prefix(state), _wrapper_prefix(expected)
    source = {k[len(src_prefix) :]: v for k, v in state.items()}
    target = {k[len(tgt_prefix) :]: k for k in expected}  # bare key -> the model's own key

    # Tied names: one tensor object under several keys of the model.
    by_tensor: dict[int, list[str]] = {}
    for key, value in expected.items():
        by_tensor.setdefault(id(value), []).append(key[len(tgt_prefix) :])
    tied = {k: group for group in by_tensor.values() if len(group) > 1 for k in group}
    skippable = {
        name[len(tgt_prefix) :]
        for name, _ in module.named_buffers()
        if name not in expected  # non-persistent: the model computes it, checkpoints need not (but may) carry it
    }

    missing, unexpected, mismatched, conflicting = [], [], [], []
    for key in target:
        if key not in source and not any(k in source for k in tied.get(key, ())):
            missing.append(target[key])
    for key, value in source.items():
        if key not in target:
            if key not in skippable:
                unexpected.append(src_prefix + key)
        elif value.shape != expected[target[key]].shape:
            shape = tuple(expected[target[key]].shape)
            mismatched.append(f"{target[key]}: checkpoint {tuple(value.shape)} vs model {shape}")
    for group in {tuple(g) for g in tied.values()}:
        present = [k for k in group if k in source]
        if any(not torch.equal(source[present[0]], source[k]) for k in present[1:]):
            conflicting.append(" / ".join(present))

    if missing or unexpected or mismatched or conflicting:
        lines = [f"{where} does not match {type(module).__name__}:"]
        for title, items in [
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches", mismatched),
            ("tied keys with different values", conflicting),
        ]:
            if items:
                lines.append(f"  {title} ({len(items)}): {_first(items)}")
        if src_prefix or tgt_prefix:
            lines.append(f"  (wrapper prefixes removed: checkpoint {src_prefix!r}, model {tgt_prefix!r})")
        lines.append("Only strict loading is offered: a partial load would leave these weights random.")
        raise CheckpointMismatchError("\n".join(lines))

    to_load = {}
    for key, name in target.items():
        donor = key if key in source else next(k for k in tied[key] if k in source)
        to_load[name] = source[donor]
    module.load_state_dict(to_load, strict=True)


def _first(items) -> str:
    items = list(items)
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f", ... (first {MAX_LISTED} of {len(items)})" if len(items) > MAX_LISTED else "")
