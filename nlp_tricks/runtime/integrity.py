"""Checkpoints that verify themselves: a manifest of every file's size and CRC-32, written last; a full disk while
saving is one line and leaves no torn ``checkpoint-N``.

The header checks of :func:`~nlp_tricks.resume.checkpoint_problem` catch a file a crash cut short; bytes changed at
the same length (a second run writing into the folder, a bad copy, a disk fault) pass them. The manifest catches
those: :func:`write_manifest` records each file's size and CRC-32 once the checkpoint is complete (after upstream's
``trainer_state.json``), and :func:`manifest_problem` compares them when a run resumes. CRC-32 (``zlib.crc32``) is
the cheapest check the standard library has that catches any accidental change (every burst of up to 32 bits, any
other change but for one in 2^32); it is not a defence against someone forging a file. Its cost: see
``benchmarks/checkpoint_checksum.py`` and docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import zlib

__all__ = [
    "MANIFEST_NAME",
    "NO_SPACE_EXIT_CODE",
    "NoSpaceLeftError",
    "checkpoint_written",
    "file_crc32",
    "final_model_written",
    "is_disk_full",
    "is_temporary_file",
    "manifest_problem",
    "write_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "checkpoint_manifest.json"
# sysexits.h's EX_IOERR, "an error occurred while doing I/O on some file": what the recipes exit with on a full disk.
NO_SPACE_EXIT_CODE = 74
_CHUNK = 8 << 20
# Resume reads a checkpoint's manifest more than once in a process (the recipes check for a complete checkpoint,
# then train() picks it): a file's checksum is kept while its size, time and inode stay the same.
_crc_cache: dict[tuple, str] = {}
# What the files resume reads end with: one of them beside the manifest but not in it was written after the save.
_CHECKPOINT_SUFFIXES = (".safetensors", ".json", ".pt", ".pth", ".bin")
# safetensors' temporary file (the Rust tempfile crate's default name: ".tmp" and 6 letters or digits).
_TEMPORARY = re.compile(r"\.tmp[A-Za-z0-9]{6}")
_CRC32 = re.compile(r"[0-9a-f]{8}")
# What a changed checkpoint's refusal adds: a change the user made on purpose has a way out.
_WAY_OUT = (
    f"; if the change was yours (the weights re-sharded or converted), delete the folder's {MANIFEST_NAME} to resume "
    "from it on the header checks alone"
)


class NoSpaceLeftError(OSError):
    """The disk filled up while a checkpoint was written; ``str()`` is one line naming the file (errno ENOSPC)."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


# ---- Checksums ------------------------------------------------------------------------------------------------


def file_crc32(path: str | os.PathLike) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits (read in 8 MiB chunks)."""
    path = os.fspath(path)
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    cached = _crc_cache.get(key)
    if cached is not None:
        return cached
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    digest = f"{crc:08x}"
    _crc_cache[key] = digest
    return digest


def is_temporary_file(name: str) -> bool:
    """Whether ``name`` is the temporary file of a save that a crash interrupted: safetensors writes each file to
    ``.tmp`` + 6 random characters beside it and renames it when complete (a ``kill -9`` leaves it, as large as the
    weights written so far); the manifest's own is ``.checkpoint_manifest.json.tmp``."""
    return bool(_TEMPORARY.fullmatch(name)) or name.startswith(f".{MANIFEST_NAME}")


def _files(folder: str, *, temporary: bool = False) -> list[str]:
    """Every regular file under ``folder`` (DeepSpeed writes a sub-folder), relative, sorted; not the manifest, and
    not the temporary files of interrupted saves unless ``temporary``."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != MANIFEST_NAME and temporary == is_temporary_file(name):
                found.append(relative)
    return sorted(found)


def write_manifest(folder: str | os.PathLike) -> dict:
    """Record the size and CRC-32 of every file in a complete checkpoint ``folder`` in ``checkpoint_manifest.json``
    (written to a temporary file, flushed to disk, then renamed: it is there whole or not at all). Returns it.

    The temporary files an interrupted save left in the folder (a run killed while writing this checkpoint, which
    its resumed run writes again) are removed first: no save of this one is still writing, so none is needed."""
    folder = os.fspath(folder)
    for relative in _files(folder, temporary=True):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, relative))
    files = {}
    for relative in _files(folder):
        path = os.path.join(folder, relative)
        files[relative] = {"size": os.path.getsize(path), "crc32": file_crc32(path)}
    manifest = {"format": 1, "algorithm": "crc32", "files": files}
    tmp = os.path.join(folder, f".{MANIFEST_NAME}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, MANIFEST_NAME))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return manifest


def manifest_problem(folder: str | os.PathLike) -> str | None:
    """What in ``folder`` differs from its ``checkpoint_manifest.json`` (a file missing, of another size, with
    another CRC-32, or a checkpoint file beside them that it does not list), or ``None`` when all match or there is
    no manifest (a checkpoint written by plain ``Trainer`` or before manifests: the header checks alone apply).

    A manifest that is not one this module writes (unparsable, another format, a path outside the folder, a size or
    checksum of the wrong kind: a damaged or forged file) is a problem too, so resume falls back past it like past
    any other damage. Sizes are compared first (no reading); then every file is read once. A difference ends with
    the way out for a change made on purpose (re-sharded weights): deleting the manifest.
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        entries = _read_manifest(path)
    except (OSError, ValueError) as error:
        return f"{MANIFEST_NAME} is unreadable ({error})"
    problem = _differences(folder, entries)
    return None if problem is None else problem + _WAY_OUT


def _read_manifest(path: str) -> list[tuple[str, int, str]]:
    """``(name, size, crc32)`` of every file a manifest lists, checked to be what :func:`write_manifest` writes;
    ``ValueError`` saying what is not."""
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError('not an object with a "files" object')
    if manifest.get("format") != 1 or manifest.get("algorithm") != "crc32":
        raise ValueError(f"format {manifest.get('format')!r} / {manifest.get('algorithm')!r}, not 1 / 'crc32'")
    entries = []
    for name, entry in manifest["files"].items():
        parts = name.replace("\\", "/").split("/")
        if os.path.isabs(name) or "\0" in name or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{name!r} is not a path inside the folder")
        size, crc = (entry.get("size"), entry.get("crc32")) if isinstance(entry, dict) else (None, None)
        if type(size) is not int or size < 0 or not (isinstance(crc, str) and _CRC32.fullmatch(crc)):
            raise ValueError(f"the entry of {name} is not a size and a CRC-32 ({entry!r})")
        entries.append((name, size, crc))
    return entries


def _differences(folder: str, entries: list[tuple[str, int, str]]) -> str | None:
    for name, size, _ in entries:
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            return f"{name} is missing (listed in {MANIFEST_NAME})"
        actual = os.path.getsize(file)
        if actual != size:
            return f"{name} is {actual} bytes where {MANIFEST_NAME} records {size} (changed after the save)"
    listed = {name for name, _, _ in entries}
    extra = [name for name in _files(folder) if name not in listed and name.endswith(_CHECKPOINT_SUFFIXES)]
    if extra:
        return f"{extra[0]} is not in {MANIFEST_NAME} (written into the folder after the save)"
    for name, _, crc in entries:
        if file_crc32(os.path.join(folder, name)) != crc:
            return f"{name} does not match its CRC-32 in {MANIFEST_NAME} (its bytes changed after the save)"
    return None


# ---- Saving ---------------------------------------------------------------------------------------------------

# How writers that are not Python's own report a full disk: safetensors (Rust: "StorageFull", "os error 28"), torch's
# zip writer ("file write failed", "unexpected pos"), C++ streams ("iostream error"). The last three say only that a
# write failed: they count as a full disk when the disk is (nearly) full.
_FULL_MARKERS = ("no space left on device", "storagefull", "os error 28", "disk quota exceeded", "os error 122")
_WRITE_FAILED_MARKERS = ("file write failed", "unexpected pos", "iostream error", "failed writing")
_NEARLY_FULL_BYTES = 16 << 20


def is_disk_full(error: BaseException, folder: str | os.PathLike | None = None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a full disk or quota, from its errno or its message; a
    failed write without a reason counts when ``folder``'s file system has less than 16 MiB free."""
    seen = set()
    write_failed = False
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error).lower()
        if any(marker in text for marker in _FULL_MARKERS):
            return True
        write_failed = write_failed or any(marker in text for marker in _WRITE_FAILED_MARKERS)
        error = error.__cause__ or error.__context__
    if write_failed and folder is not None:
        with contextlib.suppress(OSError):
            return shutil.disk_usage(_existing(os.fspath(folder))).free < _NEARLY_FULL_BYTES
    return False


def _existing(path: str) -> str:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path or "."


def _last_written(folder: str, error: BaseException, safetensors_files: tuple[str, ...] = ()) -> str:
    """The file being written when ``error`` came: the error's own file name; for safetensors (which removes the
    file it could not finish) the first of ``safetensors_files`` (in the order they are written) missing from
    ``folder``; else the newest file."""
    name = getattr(error, "filename", None)
    if name:
        return os.path.relpath(os.fspath(name), folder) if os.path.isabs(os.fspath(name)) else os.fspath(name)
    present = set(_files(folder)) if os.path.isdir(folder) else set()
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    if any("safetensor" in type(e).__name__.lower() for e in chain):
        if "model.safetensors.index.json" in present:
            return "a model shard (.safetensors)"
        expected = [n for n in safetensors_files if n.endswith(".safetensors")]
        return next((n for n in expected if n not in present), "a .safetensors file")
    newest, newest_time = None, -1
    with contextlib.suppress(OSError):
        for relative in sorted(present):
            mtime = os.stat(os.path.join(folder, relative)).st_mtime_ns
            if mtime >= newest_time:
                newest, newest_time = relative, mtime
    return newest or "?"


def _free_space(folder: str) -> str:
    try:
        free = shutil.disk_usage(_existing(folder)).free
    except OSError:
        return "unknown"
    return f"{free / 1e6:.1f} MB"


@contextlib.contextmanager
def checkpoint_written(trainer, trial=None):
    """Around upstream's ``_save_checkpoint``: after it, :func:`write_manifest` on the process that saves (once
    every process has written its part); a full disk during it removes the unfinished ``checkpoint-N`` and raises
    :class:`NoSpaceLeftError` with one line naming the file (``no space left on device while writing
    checkpoint-6/optimizer.pt``). Other errors pass unchanged.

    A full disk while writing the manifest itself leaves the checkpoint, which is complete without it (resume then
    applies the header checks alone), and raises the same error.
    """
    run_dir = trainer._get_output_dir(trial=trial)
    name = f"checkpoint-{trainer.state.global_step}"
    folder = os.path.join(run_dir, name)
    try:
        yield
    except Exception as error:
        if not is_disk_full(error, folder):
            raise
        weights = "adapter_model.safetensors" if hasattr(trainer.model, "peft_config") else "model.safetensors"
        expected = (weights, *getattr(trainer, "required_checkpoint_files", ()))
        written = _last_written(folder, error, expected)
        if trainer.args.should_save and os.path.isdir(folder):
            shutil.rmtree(folder, ignore_errors=True)
        raise NoSpaceLeftError(
            f"no space left on device while writing {name}/{written} ({_free_space(run_dir)} free); the unfinished "
            f"{name} was removed, so --resume_from_checkpoint true picks the previous complete checkpoint: free "
            "some space (or lower --save_total_limit) and resume",
        ) from error
    if trainer.args.world_size > 1:
        trainer.accelerator.wait_for_everyone()  # each process writes its own files (RNG states, shards)
    if trainer.args.should_save and os.path.isdir(folder):
        try:
            write_manifest(folder)
        except OSError as error:
            if not is_disk_full(error, folder):
                raise
            raise NoSpaceLeftError(
                f"no space left on device while writing {name}/{MANIFEST_NAME} ({_free_space(run_dir)} free); {name} "
                "is complete without its checksums: free some space and resume",
            ) from error


@contextlib.contextmanager
def final_model_written(trainer, output_dir: str | os.PathLike):
    """Around the final model's save (``save_model`` outside a ``checkpoint-N``): a full disk during it removes the
    files this save had written into ``output_dir`` (nothing there then looks like a saved model) and raises
    :class:`NoSpaceLeftError` with one line naming the file. The checkpoints are not touched. Other errors pass
    unchanged."""
    folder = os.fspath(output_dir)
    before = _top_level_files(folder)
    try:
        yield
    except Exception as error:
        if not is_disk_full(error, folder):
            raise
        after = _top_level_files(folder)
        changed = sorted((n for n in after if before.get(n) != after[n]), key=lambda n: after[n][2])
        weights = "adapter_model.safetensors" if hasattr(trainer.model, "peft_config") else "model.safetensors"
        written = _failed_file(error, weights) or (changed[-1] if changed else "?")
        if trainer.args.should_save:
            for name in changed:  # created or rewritten by this save
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, name))
        raise NoSpaceLeftError(
            f"no space left on device while writing the final model, {os.path.join(folder, written)} "
            f"({_free_space(folder)} free); the files of that save were removed and the checkpoints are intact: "
            "free some space and rerun with --resume_from_checkpoint true",
        ) from error


def _failed_file(error: BaseException, weights: str) -> str | None:
    """The file ``error`` names, or the weights for an error of safetensors (which removes the file it could not
    finish, so that it is not among the changed files)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "filename", None):
            return os.path.basename(os.fspath(error.filename))
        if "safetensor" in type(error).__name__.lower() or "storagefull" in str(error).lower():
            return weights
        error = error.__cause__ or error.__context__
    return None


def _top_level_files(folder: str) -> dict[str, tuple]:
    """The files directly in ``folder`` (not its ``checkpoint-N`` folders), each with what a rewrite changes."""
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                stat = entry.stat(follow_symlinks=False)
                found[entry.name] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return found
