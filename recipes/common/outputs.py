"""A run's output folder: what a run writes there, an earlier run's results refused or removed, atomic JSON."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from nlp_tricks.data import DataError
from nlp_tricks.runtime.checkpoint import DESCRIPTION_FILES
from nlp_tricks.runtime.lock import lock_output_dir

from .process import is_main_process, logger

# What a recipe run writes into --output_dir (glob patterns): the Trainer's model, tokenizer and state files, the
# recipes' results and predictions, checkpoints, and self-training's rounds.
RUN_OUTPUTS = (
    "all_results.json",
    "test_predictions.*",
    "self_training_results.json",
    "round_*",
    "trainer_state.json",
    "training_args.bin",
    "config.json",
    "README.md",  # the model card of a model with a CRF, a span head or a pooling
    *DESCRIPTION_FILES,
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.*",
    "adapter_config.json",
    "checkpoint-*",
)
# Of those, the ones that make a folder hold results: an earlier run's numbers, predictions, model or checkpoints.
RESULT_OUTPUTS = (
    "all_results.json",
    "test_predictions.*",
    "self_training_results.json",
    "round_*",
    "trainer_state.json",
    "model*.safetensors",
    "pytorch_model*.bin",
    "adapter_model.*",
    "checkpoint-*",
)


def _matches(folder: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The files and folders in ``folder`` that match any of the glob ``patterns``, sorted."""
    return sorted({path for pattern in patterns for path in folder.glob(pattern)})


# The output folders this process locked (prepare_output_dir), released when the recipe ends (run_recipe).
output_dir_locks: list = []


def prepare_output_dir(
    output_dir: str | Path, overwrite: bool, resume: str | bool | None = None, reads: tuple[str | None, ...] = ()
) -> None:
    """Make sure no file of an earlier run can be read as this run's.

    A folder holding an earlier run's results (``RESULT_OUTPUTS``) is refused with a :class:`DataError` (one line,
    exit 1) unless ``overwrite`` (``--overwrite_output_dir``): then everything a run writes (``RUN_OUTPUTS``) is
    removed before the run starts, and nothing else (your own files stay). ``resume``
    (``--resume_from_checkpoint``) continues the run in the folder: its checkpoints stay and its earlier results
    are removed without asking. A folder holding a model the run reads (``reads``: ``--model_name_or_path``, ...)
    is always refused, since replacing its files would remove what the run is about to load. Only the main process
    removes; every process checks.

    First of all the main process locks the folder (created if missing) for this run: one that another run holds
    is refused (``OutputDirBusyError``, one line naming that run) before anything in it is touched.
    """
    if is_main_process():
        lock = lock_output_dir(output_dir)
        if lock is not None:
            output_dir_locks.append(lock)
    folder = Path(output_dir)
    if not folder.is_dir():
        return
    keep_checkpoints = bool(resume)
    results = [
        p for p in _matches(folder, RESULT_OUTPUTS) if not (keep_checkpoints and p.name.startswith("checkpoint-"))
    ]
    if not results:
        return
    _refuse_a_folder_read_from(folder, reads)
    if not overwrite and not resume:
        names = ", ".join(p.name for p in results[:3]) + (", ..." if len(results) > 3 else "")
        only_checkpoints = all(p.name.startswith("checkpoint-") for p in results)
        hint = " (or --resume_from_checkpoint true to continue it)" if only_checkpoints else ""
        raise DataError(
            folder,
            None,
            f"holds the results of an earlier run ({names}); give --overwrite_output_dir to replace them, or "
            f"another --output_dir{hint}",
        )
    if is_main_process():
        _remove_run_outputs(folder, keep_checkpoints)
        logger.warning(
            "%s: removed the outputs of an earlier run (%s)", folder, "resumed" if resume else "overwritten"
        )


def _refuse_a_folder_read_from(folder: Path, reads: tuple[str | None, ...]) -> None:
    """Refuse an output folder that holds (or is) a model this run loads: clearing it would remove that model."""
    for source in reads:
        if (
            source
            and Path(source).exists()
            and folder.resolve() in (Path(source).resolve(), *Path(source).resolve().parents)
        ):
            raise DataError(
                folder,
                None,
                f"holds the model this run loads ({source}) and an earlier run's results; write this run to another "
                "--output_dir",
            )


def _remove_run_outputs(folder: Path, keep_checkpoints: bool) -> None:
    """Remove what a run writes (``RUN_OUTPUTS``) from ``folder``, and nothing else."""
    for path in _matches(folder, RUN_OUTPUTS):
        if keep_checkpoints and path.name.startswith("checkpoint-"):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write ``data`` as JSON through a temporary file and a rename, so a reader never sees a partial file.

    A NaN or an infinity (an undefined metric, such as a correlation of constant predictions) is written as
    ``null``: strict JSON has no such numbers, and Python's bare ``NaN`` breaks other readers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    text = json.dumps(_finite_or_null(data), indent=2, sort_keys=True, allow_nan=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _finite_or_null(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value
