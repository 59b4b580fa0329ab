"""The torch threads of a recipe's single CPU process (recipes/common/threads.py): the cores free at start, one when
other processes keep the machine busy, and always the user's count where they chose one."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common import threads

LINUX = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")


@pytest.mark.parametrize(
    "cores, busy, expected",
    [
        (2, 0.0, 2),  # a quiet machine: every core
        (2, 0.4, 2),  # 1.6 free rounds to 2
        (2, 0.6, 1),  # 1.4 free rounds to 1
        (2, 2.0, 1),  # every core busy: one thread, never none
        (8, 3.0, 5),
        (4, 1.5, 3),  # 2.5 free rounds half up
    ],
)
def test_threads_are_the_free_cores_rounded_at_least_one(cores, busy, expected):
    assert threads.threads_for(cores, busy) == expected


def test_busy_cores_takes_the_smaller_reading_and_scales_the_load_to_this_process_cores(monkeypatch):
    # 2 usable cores of a 16-core machine whose load average is 12: 2 x 12/16 = 1.5 of ours busy by that reading.
    monkeypatch.setattr(os, "getloadavg", lambda: (12.0, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(threads, "_sampled_busy", lambda seconds: 1.9)
    assert threads.busy_cores(2)[0] == pytest.approx(1.5)
    monkeypatch.setattr(threads, "_sampled_busy", lambda seconds: 0.2)  # the load average lags a job that just ended
    busy, how = threads.busy_cores(2)
    assert busy == pytest.approx(0.2) and "load average 12.00" in how and "0.2 of them busy just now" in how


@LINUX
def test_a_busy_loop_beside_shows_in_the_sampled_busy_time():
    mine = os.sched_getaffinity(0)
    quiet = threads._sampled_busy(0.5)
    assert quiet is not None and 0.0 <= quiet <= len(mine) + 1e-9
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter started
        loaded = threads._sampled_busy(0.5)
    finally:
        loop.kill()
        loop.wait()
    # The loop keeps one core busy all the time (whatever else the shared machine runs).
    assert loaded >= 0.8


@pytest.fixture
def fake_launcher(monkeypatch):
    """A stand-in `accelerate launch` parent process whose environment and command line the test chooses."""
    procs = []

    def start(env: dict, args: list[str], omp: str = "1"):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "launch", *args], env=env)
        procs.append(proc)
        # Until the child has exec'd, /proc shows pytest's own environment and command line (a race under load).
        deadline = time.monotonic() + 30
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        while "launch" not in cmdline.read_bytes().decode(errors="replace").split("\0"):
            assert time.monotonic() < deadline, "the stand-in launcher did not start"
            time.sleep(0.01)
        monkeypatch.setattr(os, "getppid", lambda: proc.pid)
        monkeypatch.setenv("OMP_NUM_THREADS", omp)  # what accelerate sets in the recipe's environment
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
        monkeypatch.delenv("WORLD_SIZE", raising=False)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@LINUX
@pytest.mark.parametrize("busy", [0.0, 5.0])
@pytest.mark.parametrize("launcher_omp", ["1", "2"])  # accelerate's 1, or the physical cores with use_cpu
def test_under_accelerate_launch_the_free_cores_are_used(
    fake_launcher, one_thread, monkeypatch, capsys, busy, launcher_omp
):
    fake_launcher({k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, [], omp=launcher_omp)
    monkeypatch.setattr(threads, "busy_cores", lambda cores: (busy, "load reading"))
    cores = len(os.sched_getaffinity(0))
    expected = cores if busy == 0.0 else 1
    assert threads.choose_threads() == expected
    assert torch.get_num_threads() == expected
    line = capsys.readouterr().err.strip()
    assert line == f"torch threads: {expected} of {cores} cores (load reading; OMP_NUM_THREADS=N chooses)"


@LINUX
@pytest.mark.parametrize(
    "launcher_env, launcher_args, said",
    [
        ({"OMP_NUM_THREADS": "1"}, [], "OMP_NUM_THREADS=1"),
        ({"MKL_NUM_THREADS": "1"}, [], "MKL_NUM_THREADS=1"),
        ({}, ["--num_cpu_threads_per_process", "1"], "--num_cpu_threads_per_process 1"),
        ({}, ["--num_cpu_threads_per_process=1"], "--num_cpu_threads_per_process 1"),
    ],
)
def test_the_users_choice_at_launch_wins(
    fake_launcher, one_thread, monkeypatch, capsys, launcher_env, launcher_args, said
):
    fake_launcher({k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | launcher_env, launcher_args)
    monkeypatch.setattr(threads, "busy_cores", lambda cores: pytest.fail("the user chose: nothing to measure"))
    assert threads.user_choice() == said
    assert threads.choose_threads() is None
    assert torch.get_num_threads() == 1
    assert capsys.readouterr().err == ""  # a bad input's one line stays the only one


def test_without_a_launcher_the_environment_is_the_users(one_thread, monkeypatch, capsys):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads, "has_accelerator", lambda: False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.user_choice() == "OMP_NUM_THREADS=1"
    assert threads.choose_threads() is None and torch.get_num_threads() == 1
    assert capsys.readouterr().err == ""
    # `python recipes/ner.py` with no variable set: torch's own count is replaced by the free cores.
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda cores: (cores, "all busy"))
    assert threads.choose_threads() == 1


def test_gpu_runs_and_launched_jobs_are_left_alone(one_thread, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda cores: pytest.fail("nothing to choose"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert threads.choose_threads() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(threads, "has_accelerator", lambda: True)
    assert threads.choose_threads() is None
    assert torch.get_num_threads() == 1 and capsys.readouterr().err == ""
