"""One run per output folder: an OS lock on a file inside it, held while the run writes there.

Two runs writing into one ``output_dir`` mix their files: a ``checkpoint-N`` with one run's model and optimizer
beside the other's scheduler passes every completeness check, and resuming from it trains with a schedule neither
run had. :func:`lock_output_dir` takes an exclusive ``fcntl.flock`` on ``<output_dir>/_nlp_tricks.lock``; a second
run (any process, on any machine that shares the folder over a file system with working ``flock``, as NFS has) is
refused with one line naming the holder: its pid, host, start time and command, which the holder writes into the
file. The operating system drops the lock when the holding process ends, however it ends (``kill -9`` included),
so a crashed run never leaves the folder locked; the file itself is removed when the lock is released normally.

The name starts with ``_`` because upstream's ``push_to_hub`` uploads an output folder without ``_*`` files.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import json
import logging
import os
import socket
import sys
import time

import torch

__all__ = [
    "LOCK_NAME",
    "NotDistributedError",
    "OutputDirBusyError",
    "OutputDirLock",
    "hold_output_dir",
    "holds_output_dir",
    "lock_output_dir",
    "not_distributed_problem",
]

logger = logging.getLogger(__name__)

LOCK_NAME = "_nlp_tricks.lock"

# The locks this process holds, by the folder's real path: a recipe takes the lock and then its trainer's train()
# takes it again (flock conflicts with a second open file of the same process, so the second taker reuses the first).
_held: dict[str, OutputDirLock] = {}

# Command-line values never written into the lock file (others can read it; a token must not be there).
_SECRET_FLAGS = ("token", "password", "secret", "api_key")


class OutputDirBusyError(RuntimeError):
    """Another process holds the lock of the output folder; the message is one line naming it."""


class NotDistributedError(RuntimeError):
    """The processes were launched as one job (a process group of several is initialized) but the
    ``TrainingArguments`` run each of them alone; the message is one line saying what to pass."""


def not_distributed_problem(args) -> str | None:
    """Why the processes of a launched job would each train alone, or ``None``: a process group of several is
    initialized, but ``args`` (``TrainingArguments``) are not distributed. ``accelerate launch --multi_gpu`` on a
    machine without GPUs does that unless ``use_cpu=True``: transformers then sets up every process as a single one
    (``ParallelMode.NOT_PARALLEL``, world size 1), so each trains on all the data and writes into the same folder."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    processes = torch.distributed.get_world_size()
    if processes <= 1 or args.world_size > 1:
        return None
    mode = getattr(args.parallel_mode, "value", args.parallel_mode)
    return (
        f"rank {torch.distributed.get_rank()} of a launched job of {processes} processes: the process group is "
        f"initialized, but the TrainingArguments are not distributed (parallel mode {mode!r}, world size "
        f"{args.world_size}), so each process would train alone on all the data; without GPUs pass use_cpu=True "
        "(recipes: --use_cpu true)"
    )


class OutputDirLock:
    """An exclusive lock on one output folder, held by this process (see :func:`lock_output_dir`).

    Re-entrant within the process: each :func:`lock_output_dir` of the same folder adds one hold, and each
    :meth:`release` removes one; the last release unlocks the folder and removes the lock file (and the folder, if
    the lock created it and nothing else was written there).
    """

    def __init__(self, folder: str, fd: int, created: bool = False):
        self.folder = folder
        self.created = created  # the lock created the folder: removed again if the run left it empty
        self.path = os.path.join(folder, LOCK_NAME)
        self.fd: int | None = fd
        self.pid = os.getpid()
        self.holds = 1

    @property
    def held(self) -> bool:
        return self.fd is not None and self.pid == os.getpid()

    def release(self) -> None:
        """Drop one hold; the last one unlocks the folder and removes the lock file."""
        if not self.held:
            return
        self.holds -= 1
        if self.holds > 0:
            return
        _held.pop(self.folder, None)
        # Removed while still locked: a process that opened the old file sees it gone after it locks it, and retries.
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)  # closing the last descriptor drops the flock
        self.fd = None
        if self.created:
            with contextlib.suppress(OSError):  # not empty: the run wrote into it
                os.rmdir(self.folder)

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_output_dir(output_dir: str | os.PathLike) -> OutputDirLock | None:
    """Lock ``output_dir`` (created if missing) for this process, or raise :class:`OutputDirBusyError` naming the
    process that holds it.

    Never waits: a held lock is refused at once. Returns ``None`` (with a warning) on a file system without
    ``flock`` (some Lustre / CIFS mounts) or a folder this process cannot write to: the run goes on unprotected.
    Call :meth:`OutputDirLock.release` (or use the lock as a context manager) when the run stops writing; a process
    that ends drops it anyway.
    """
    folder = os.path.realpath(os.fspath(output_dir))
    existing = _held.get(folder)
    if existing is not None and existing.held:
        existing.holds += 1
        return existing
    created = not os.path.isdir(folder)
    path = os.path.join(folder, LOCK_NAME)
    import fcntl  # not on Windows; imported here so that the module imports there

    while True:
        try:
            os.makedirs(folder, exist_ok=True)  # again on a retry: a holder that created it removes it when done
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            # A folder this process may not write to: nothing of the run can be written there to protect either.
            logger.warning(f"{output_dir}: cannot create its lock file ({error.strerror}); it is not locked")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputDirBusyError(
                f"{output_dir} is in use by another run ({holder}); wait for it to end, or give this run another "
                "--output_dir"
            ) from None
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                logger.warning(
                    f"{output_dir}: its file system does not support flock ({error.strerror}); a second run on this "
                    "folder will not be refused"
                )
                return None
            raise
        # The holder before us may have removed the file after we opened it: lock the file that is there now.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(_holder_record()).encode() + b"\n")
    lock = OutputDirLock(folder, fd, created)
    _held[folder] = lock
    return lock


@contextlib.contextmanager
def hold_output_dir(trainer, output_dir: str | os.PathLike | None = None):
    """Within: ``output_dir`` (default: ``trainer.args.output_dir``) is locked by the main process (process index
    0) for a trainer's run; every process raises the same :class:`OutputDirBusyError` if another run holds it.

    Only the main process takes the lock (under DDP the others share its run); it tells the others the outcome in
    one all-reduce, so none of them waits on a lock or trains on without it. The processes of a launched job whose
    arguments are not distributed (each would be a main process of its own) raise :class:`NotDistributedError` on
    every process first, before any of them takes the lock.
    """
    problem = not_distributed_problem(trainer.args)
    if problem is not None:
        raise NotDistributedError(problem)
    folder = os.fspath(trainer.args.output_dir if output_dir is None else output_dir)
    lock = error = None
    if trainer.args.process_index == 0:
        try:
            lock = lock_output_dir(folder)
        except OutputDirBusyError as busy:
            error = busy
    refused = error is not None
    if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.args.world_size > 1:
        flag = torch.tensor([int(refused)], dtype=torch.int32, device=trainer.args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        refused = bool(flag.item())
    if refused:
        raise error or OutputDirBusyError(f"{folder} is in use by another run (the main process names it)")
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def holds_output_dir(train):
    """Decorate a Trainer's ``train(self, resume_from_checkpoint=None, trial=None, ...)``: the run's folder (a
    hyperparameter-search trial's own) is locked by :func:`hold_output_dir` for the whole call, from the choice of
    the checkpoint to resume to the last save."""

    @functools.wraps(train)
    def locked_train(self, resume_from_checkpoint=None, trial=None, *args, **kwargs):
        with hold_output_dir(self, self._get_output_dir(trial=trial)):
            return train(self, resume_from_checkpoint, trial, *args, **kwargs)

    return locked_train


def _holder_record() -> dict:
    started = time.time()
    try:
        import psutil

        started = psutil.Process().create_time()
    except Exception:  # psutil missing or the process table unreadable: when the lock was taken
        pass
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds"),
        "command": _redacted(sys.argv),
    }


def _redacted(argv: list[str]) -> list[str]:
    out, hide_next = [], False
    for arg in argv:
        name = arg.split("=", 1)[0].lower()
        secret = name.startswith("-") and any(word in name for word in _SECRET_FLAGS)
        if hide_next:
            out.append("***")
        elif secret and "=" in arg:
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
        hide_next = secret and "=" not in arg
    return out


def _read_holder(fd: int) -> str:
    """The holder's record as words; it writes it right after locking, so an empty file is read again briefly."""
    for _ in range(20):
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 1 << 16)
        if data.strip():
            try:
                record = json.loads(data)
                command = " ".join(record.get("command") or [])
                return (
                    f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')}: "
                    f"{command or '(no command recorded)'}"
                )
            except ValueError:
                pass
        time.sleep(0.05)
    return "its details are not written in the lock file"
