"""Crash-safe resume: which ``checkpoint-N`` folders are complete, and the tricks' state carried inside them."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zipfile
from collections.abc import Sequence

from .checkpoint import ADAPTER_FILES, TORCH_SUFFIXES, WEIGHTS_FILES, _first
from .integrity import manifest_problem

__all__ = [
    "CheckpointResumeError",
    "checkpoint_problem",
    "checkpoint_to_resume",
    "get_last_complete_checkpoint",
    "optimizer_groups_problem",
    "weight_file_problem",
]

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointResumeError(ValueError):
    """The checkpoint to resume from cannot be used (named and incomplete, none complete, optimizer groups of other
    settings); ``str()`` is one line naming it and what is wrong."""


# ---- Checkpoint folders ----------------------------------------------------------------------------------------


def checkpoint_problem(folder: str | os.PathLike, required: Sequence[str] = ()) -> str | None:
    """What makes a Trainer checkpoint folder unusable for resuming, or ``None`` when it is complete.

    Complete means: ``trainer_state.json`` (the Trainer writes it last) parses; model weights are present
    (``model.safetensors``, ``pytorch_model.bin``, their sharded indexes with every shard, an adapter, or a
    DeepSpeed / FSDP layout); and every weight, optimizer, scheduler, scaler and RNG file in the folder is intact:
    a safetensors file as long as its header promises, a torch file with a readable zip directory whose members lie
    inside the file. These checks read headers only, so they take milliseconds on any model size; a crash truncates
    files, which they catch. Bytes changed at the same length pass them: where the folder holds the
    ``checkpoint_manifest.json`` that TricksTrainer writes last, every file must also have the size and CRC-32 it
    records (:func:`~nlp_tricks.runtime.integrity.manifest_problem`: every file is read once). ``required`` names
    further files the run needs (e.g. a trick's state, such as the EMA's ``ema_state.safetensors``).
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return "not a folder"
    names = set(os.listdir(folder))
    if TRAINER_STATE_NAME not in names:
        return f"{TRAINER_STATE_NAME} is missing (the Trainer writes it last, so the save did not finish)"
    for name in required:
        if hasattr(name, "problem"):  # a requirement on a file's content (the tricks' state store)
            problem = name.problem(folder)
            if problem is not None:
                return problem
        elif name not in names:
            return f"{name} is missing (this run needs it to resume)"
    for name in sorted(names):
        path = os.path.join(folder, name)
        problem = weight_file_problem(path) if os.path.isfile(path) else None
        if problem:
            return f"{name} is {problem}"
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in names:
            with open(os.path.join(folder, index)) as f:
                shards = set(json.load(f).get("weight_map", {}).values())
            absent = sorted(shards - names)
            if absent:
                return f"{index} lists shards that are missing: {_first(absent)}"
    has_weights = any(n in names for n in WEIGHTS_FILES + ADAPTER_FILES)
    distributed_layout = "latest" in names or any(n.startswith("pytorch_model_fsdp") for n in names)
    if not (has_weights or distributed_layout):
        return f"no model weights ({', '.join(WEIGHTS_FILES)})"
    return manifest_problem(folder)


def get_last_complete_checkpoint(output_dir: str | os.PathLike, required: Sequence[str] = ()) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output_dir`` that :func:`checkpoint_problem` finds complete (with the
    ``required`` files).

    Newer folders that are incomplete (a crash while saving) are skipped with a warning naming them and what is
    wrong. ``None`` if there is no complete one.
    """
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(output_dir)
        if (m := CHECKPOINT_RE.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        problem = checkpoint_problem(path, required)
        if problem is None:
            return path
        logger.warning(f"Skipping incomplete checkpoint {path}: {problem}")
    return None


def weight_file_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with one file of a checkpoint or model folder, from its header alone (milliseconds at any
    size): a ``.safetensors`` file shorter than its header promises, a torch file (``.pt`` / ``.bin`` / ``.pth``)
    whose zip directory is gone or whose members run past its end, a ``.json`` file that does not parse; ``None``
    when it looks whole or is of another kind."""
    path = os.fspath(path)
    if path.endswith(".json"):
        return _json_problem(path)
    if path.endswith(".safetensors"):
        return _safetensors_problem(path)
    if path.endswith(TORCH_SUFFIXES):
        return _torch_zip_problem(path)
    return None


def checkpoint_to_resume(
    resume_from_checkpoint: str | os.PathLike | bool | None,
    output_dir: str | os.PathLike,
    required: Sequence[str] = (),
) -> str | os.PathLike | bool | None:
    """What ``train(resume_from_checkpoint=...)`` resumes from: ``True`` becomes the newest complete checkpoint of
    ``output_dir`` (:func:`get_last_complete_checkpoint`), a named one must be complete; else
    :class:`CheckpointResumeError`. Anything else passes unchanged."""
    if resume_from_checkpoint is True:
        newest = get_last_complete_checkpoint(output_dir, required)
        if newest is None:
            raise CheckpointResumeError(f"No complete checkpoint found in output directory ({output_dir})")
        return newest
    if isinstance(resume_from_checkpoint, (str, os.PathLike)):
        problem = checkpoint_problem(resume_from_checkpoint, required)
        if problem is not None:
            raise CheckpointResumeError(
                f"resume_from_checkpoint={os.fspath(resume_from_checkpoint)!r} is incomplete: {problem}"
            )
    return resume_from_checkpoint


def _json_problem(path: str) -> str | None:
    try:
        with open(path) as f:
            json.load(f)
    except (OSError, ValueError) as error:
        return f"unreadable JSON ({error})"
    return None


def _safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                return f"truncated ({size} bytes, shorter than its {header_len}-byte header)"
            header = json.loads(f.read(header_len))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError, AttributeError) as error:
        return f"unreadable ({type(error).__name__}: {error})"
    if 8 + header_len + end != size:
        return f"truncated ({size} bytes, its header promises {8 + header_len + end})"
    return None


def _torch_zip_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (OSError, zipfile.BadZipFile) as error:
        # The zip directory sits at the end of the file: a truncated file loses it.
        return f"truncated or unreadable ({size} bytes; not a complete torch file: {error})"
    if not infos:
        return "an empty archive"
    if any(info.header_offset + info.compress_size > size for info in infos):
        return f"truncated ({size} bytes; its members extend past the end)"
    return None


# ---- Optimizer groups ------------------------------------------------------------------------------------------


def optimizer_groups_problem(checkpoint: str | os.PathLike, current: dict, saved: dict | None) -> str | None:
    """Why the optimizer state of ``checkpoint`` does not fit the groups this run builds (``current``, from
    :func:`~nlp_tricks.runtime.param_groups.group_signature`), naming the settings that differ; ``None`` when it fits.

    ``saved`` is the signature the checkpoint recorded (``None``: none, as in a plain ``Trainer`` checkpoint: then
    the group sizes in its ``optimizer.pt`` are compared). Upstream loads the checkpoint's optimizer state into the new
    groups: a different number of groups raises torch's "different number of parameter groups", and the same number
    with other learning-rate scales or weight decay silently keeps the checkpoint's.
    """
    if saved is None:
        return _unrecorded_groups_problem(checkpoint, current)
    if not saved or json.loads(json.dumps(current["groups"])) == saved["groups"]:
        return None
    old, new = saved.get("settings", {}), current["settings"]
    changes = [f"{name} {old[name]!r} -> {new[name]!r}" for name in new if name in old and old[name] != new[name]]
    changes = [c for c in changes if not c.startswith(("tricks ", "group_rules "))]
    if "tricks" in old and old["tricks"] != new["tricks"]:
        removed = [t for t in old["tricks"] if t not in new["tricks"]]
        added = [t for t in new["tricks"] if t not in old["tricks"]]
        changes += [f"{t} (in the checkpoint, not now)" for t in removed] + [f"{t} (new)" for t in added]
    what = "; ".join(changes) if changes else "the model's parameters differ"
    return (
        f"the optimizer's parameter groups differ from the checkpoint's ({len(saved['groups'])} there, "
        f"{len(current['groups'])} now) because of: {what}. Resume with the checkpoint's settings, or start a new run "
        "(--overwrite_output_dir) to train with the new ones"
    )


def _unrecorded_groups_problem(checkpoint: str | os.PathLike, current: dict) -> str | None:
    """For a checkpoint that recorded no group signature (plain ``Trainer``): its optimizer's group sizes and weight
    decays against this run's."""
    path = os.path.join(checkpoint, "optimizer.pt")
    if not os.path.isfile(path):
        return None
    import torch

    try:
        groups = torch.load(path, map_location="cpu", weights_only=True).get("param_groups", [])
    except Exception:  # unreadable here: upstream's own load reports it
        return None
    theirs = [(len(g.get("params", [])), g.get("weight_decay")) for g in groups]
    ours = [(row[3], row[2]) for row in current["groups"]]
    if theirs == ours:
        return None
    rules = current["settings"].get("group_rules", [])
    return (
        f"the checkpoint's optimizer has {len(theirs)} parameter groups of {[n for n, _ in theirs]} parameters "
        f"(written with upstream's groups: by plain Trainer, or with no group rule on), but this run builds "
        f"{len(ours)} of {[n for n, _ in ours]}"
        + (f" because of {', '.join(rules)}" if rules else "")
        + ". Resume with the checkpoint's settings, or start a new run (--overwrite_output_dir)"
    )
