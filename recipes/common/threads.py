"""How many torch threads a recipe's CPU process uses: the cores that are free when it starts, unless the user chose.

torch's threads meet at a barrier after every operation, so one thread that shares its core with another process
holds up the others: beside two busy loops on a 2-core machine, a training step of the NER demo took 7.7 s on one
thread and 35.9 s on two (docs/recipes.md). A run that finds the machine busy therefore uses fewer threads, one when
every core is taken; a quiet machine gets every core, which ``accelerate launch`` alone would not give (it sets
``OMP_NUM_THREADS=1`` for one CPU process).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch

from .process import is_main_process

# The environment variables through which torch takes a thread count at start.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def choose_threads() -> int | None:
    """Set torch's thread count for a single CPU process from the cores free now, and say so in one line on stderr;
    the count set, or ``None`` where it was left as it was (silently).

    Left alone: a GPU run, a launched job of several processes (the launcher shares the cores out), and a count the
    user chose: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` in the environment they started the run from, or
    ``accelerate launch --num_cpu_threads_per_process``. A ``torch.set_num_threads`` in the user's own code (a
    ``--trick`` module) runs after this and wins too. Otherwise the count is the cores this process may run on less
    those other processes keep busy (:func:`busy_cores`), rounded, at least 1.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or has_accelerator():
        return None
    if user_choice() is not None:  # the user's count, as they set it: nothing to say
        return None
    cores = usable_cores()
    busy, how = busy_cores(cores)
    threads = threads_for(cores, busy)
    torch.set_num_threads(threads)
    _say(f"torch threads: {threads} of {cores} cores ({how}; OMP_NUM_THREADS=N chooses)")
    return threads


def threads_for(cores: int, busy: float) -> int:
    """The threads for ``cores`` usable cores of which other processes keep ``busy`` busy: the free ones, rounded
    half up, between 1 and ``cores``."""
    return max(1, min(cores, math.floor(cores - busy + 0.5)))


def busy_cores(cores: int, seconds: float = 0.5) -> tuple[float, str]:
    """How many of this process's ``cores`` other processes keep busy, and how that was read (for the log line).

    The smaller of two readings: the 1-minute load average (scaled to these cores where the machine has more), which
    still counts a job that ended seconds ago, and the cores' busy time over the next ``seconds`` (Linux
    ``/proc/stat``; this process sleeps meanwhile), which a burst of a second inflates. A machine that other jobs
    keep busy shows in both.
    """
    readings, parts = [], []
    try:
        load = os.getloadavg()[0]
        readings.append(cores * min(1.0, load / (os.cpu_count() or cores)))
        parts.append(f"load average {load:.2f}")
    except (AttributeError, OSError):  # Windows has no load average
        pass
    sampled = _sampled_busy(seconds)
    if sampled is not None:
        readings.append(sampled)
        parts.append(f"{sampled:.1f} of them busy just now")
    if not readings:
        return 0.0, "no load reading on this system"
    return min(readings), ", ".join(parts)


def _sampled_busy(seconds: float) -> float | None:
    """The busy time of this process's cores over ``seconds``, in cores (Linux), or ``None``."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = os.sched_getaffinity(0)

    def read() -> dict[int, tuple[int, int]]:
        times = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in mine:
                values = [int(v) for v in fields[:8]]
                times[int(name[3:])] = (values[3] + values[4], sum(values))  # idle + iowait, all
        return times

    try:
        before = read()
        time.sleep(seconds)
        after = read()
    except (OSError, ValueError, IndexError):
        return None
    busy = 0.0
    for cpu in before.keys() & after.keys():
        total = after[cpu][1] - before[cpu][1]
        if total > 0:
            busy += 1.0 - (after[cpu][0] - before[cpu][0]) / total
    return busy


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def user_choice() -> str | None:
    """How the user chose the thread count (``OMP_NUM_THREADS=2``), or ``None`` where they did not.

    Under ``accelerate launch`` the variable is in this process's environment either way (the launcher sets it to
    1, or to the physical cores with ``use_cpu``), so the launcher's own environment and command line are read
    instead (Linux); where they cannot be read, the variable counts as the user's.
    """
    started = launcher()
    if started is None:
        return next((f"{name}={os.environ[name]}" for name in THREAD_VARIABLES if name in os.environ), None)
    environment, command = started
    for item in environment:
        name, _, value = item.partition("=")
        if name in THREAD_VARIABLES:
            return f"{name}={value}"
    for i, arg in enumerate(command):
        if arg.startswith("--num_cpu_threads_per_process"):
            value = arg.partition("=")[2] or (command[i + 1] if i + 1 < len(command) else "")
            return f"--num_cpu_threads_per_process {value}"
    return None


def launcher() -> tuple[list[str], list[str]] | None:
    """The environment and command line of the ``accelerate launch`` that started this process; ``None`` when it was
    not started that way. A launcher that cannot be read (not Linux) passes on the environment as it was given."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ:
        return None
    try:
        parent = Path(f"/proc/{os.getppid()}")
        environment = parent.joinpath("environ").read_bytes().decode(errors="replace").split("\0")
        command = parent.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return (environment, command) if launch_index(command) is not None else None


def launch_index(command: list[str]) -> int | None:
    """Where ``launch`` is in a launcher's command line (``accelerate launch``, ``python -m
    accelerate.commands.launch``, ``accelerate-launch``), or ``None``."""
    for i, item in enumerate(command):
        if item == "launch" or item.endswith(("accelerate.commands.launch", "accelerate-launch")):
            return i
    return None


def has_accelerator() -> bool:
    """A GPU (or another device torch knows: XPU, MPS, ...) is there."""
    if torch.cuda.is_available():
        return True
    is_available = getattr(getattr(torch, "accelerator", None), "is_available", None)
    return bool(is_available is not None and is_available())


def _say(line: str) -> None:
    if is_main_process():
        print(line, file=sys.stderr, flush=True)
