"""Where a sweep's runs run: this machine (``local``) or a Ray cluster (``ray``); one executor for every runner.

A sweep (``recipes/ablation.py``, ``recipes/kfold.py``) is a list of independent runs, each
``python <recipe>.py --output_dir <run_dir> --overwrite_output_dir true <flags>`` in a subprocess (:func:`run_one`),
its log in ``<run_dir>/ablation_log.txt`` and its record (flags, results, wall time, peak memory, ``node``: where it
ran) in ``<run_dir>/ablation_run.json``. A run that finished with the same flags is not run again, so an interrupted
sweep resumes on either backend; a run that fails loses no other: the sweep runs the rest, then names the failed
ones with the end of their logs.

- ``--backend local``: ``--jobs`` runs at a time on this machine. With GPUs visible (``CUDA_VISIBLE_DEVICES``, else
  every device torch counts), each run that runs at the same time gets its own ``--gpus_per_run`` of them (default 1;
  0.5: two runs share a GPU) through ``CUDA_VISIBLE_DEVICES``, and ``--jobs`` defaults to as many runs as fit. Without
  GPUs ``--jobs`` defaults to 1 and each run gets the runner's threads (``OMP_NUM_THREADS``).
- ``--backend ray``: each run is a Ray task reserving ``--gpus_per_run`` GPUs (default 1 when the cluster has GPUs)
  and ``--cpus_per_run`` CPUs (default 1), submitted to the cluster at ``--ray_address`` (default: a Ray instance
  started on this machine for the sweep and stopped after it) and spread over its nodes. The task runs the same
  command with the sweep's environment (the GPUs are the ones Ray gave the task) in the sweep's working folder; a
  task whose node is lost is run again by Ray on another node. The output folder (and the recipe, the data and the
  Python environment) must be at the same path on every node, on storage they all see: a node that cannot see or
  write it is refused in one line and the sweep stops.

Threads of each run (``OMP_NUM_THREADS``): ``--cpus_per_run`` when given, else the variable as it is set, else the
runner's default (local) or the task's CPUs (ray).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import NamedTuple

BACKENDS = ("local", "ray")
# Variables that belong to the node a run lands on, not to the driver: on Ray the task's own values are kept.
NODE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HOSTNAME")
RECORD = "ablation_run.json"
LOG = "ablation_log.txt"


class SweepError(Exception):
    """A sweep that cannot start or go on as asked (flags, the cluster, shared storage): one line for the user."""


class RunFailed(RuntimeError):
    """A run that ended without results; the message holds its exit status and the end of its log."""

    def __init__(self, message: str, wall: float = 0.0):
        super().__init__(message)
        self.wall = wall


class Job(NamedTuple):
    """A run of a sweep; the runners' own job types (``ablation.PlannedRun``, ``kfold.FoldJob``) carry these fields
    and more. ``env``: the run's environment (None: this process's); the executor adds its threads and GPUs."""

    script: str
    run_dir: Path
    flags: list[str]
    env: dict | None = None


class Outcome(NamedTuple):
    """One run of a sweep: its record (``ablation_run.json``), or None and why it failed."""

    job: object
    record: dict | None
    error: str | None = None


# ---- One run ------------------------------------------------------------------------------------------------------


def finished_record(run_dir: Path, flags: list[str]) -> dict | None:
    """The record of a run in ``run_dir`` that finished with ``flags``, or None (never run, failed, other flags)."""
    record_path = Path(run_dir) / RECORD
    if (Path(run_dir) / "all_results.json").is_file() and record_path.is_file():
        record = json.loads(record_path.read_text())
        if record.get("flags") == flags:
            return record
    return None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies (a lost Ray worker leaves no run
    behind writing into a folder that Ray's retry of the task is about to use)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_one(
    script: str,
    run_dir: Path,
    flags: list[str],
    env: dict | None = None,
    node: str | None = None,
    die_with_parent: bool = False,
    where: str | None = None,
    label: str = "ablation",
) -> dict:
    """Run ``script`` once (unless it finished with these flags); return its record: results, time, memory, node.

    Args:
        env: the run's environment (default this process's; the executors give each run its threads and GPUs).
        node: where it runs, written into the record (default this machine's host name; Ray: the node id).
        die_with_parent: the run is killed when this process dies (Linux; the Ray backend's tasks).
        where: how a failure names the place it ran (default ``node``).
        label: the tag of the lines it prints (``[ablation]``; the k-fold run's ``[kfold]``).
    """
    run_dir = Path(run_dir)
    results_path = run_dir / "all_results.json"
    record_path = run_dir / RECORD
    record = finished_record(run_dir, flags)
    if record is not None:
        return record
    if results_path.is_file() and record_path.is_file():
        print(f"[{label}] {run_dir}: finished with other flags, running it again", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    node = node or socket.gethostname()
    # The runner owns run_dir: what an earlier attempt left there (other flags, a crash) is replaced.
    command = [sys.executable, script, "--output_dir", str(run_dir), "--overwrite_output_dir", "true", *flags]
    print(f"[{label}] {' '.join(command)}", flush=True)
    preexec = _die_with_parent if die_with_parent and sys.platform.startswith("linux") else None
    start = time.perf_counter()
    with open(run_dir / LOG, "w") as log:
        log.write(f"[sweep] running on {node} ({socket.gethostname()})\n")
        log.flush()
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env or os.environ.copy(), preexec_fn=preexec
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not results_path.is_file():
        tail = (run_dir / LOG).read_text(errors="replace").strip().splitlines()[-5:]
        message = f"{run_dir}: the run failed (exit {proc.returncode}, on {where or node}); the end of its log:\n"
        raise RunFailed(message + "\n".join(tail), wall)
    results = json.loads(results_path.read_text())
    state_path = run_dir / "trainer_state.json"
    steps = json.loads(state_path.read_text()).get("global_step") if state_path.is_file() else None
    record = {
        "flags": flags,
        "run_dir": str(run_dir),
        "results": results,
        "wall_seconds": wall,
        "train_seconds_per_step": results.get("train_runtime", wall) / steps if steps else None,
        "peak_memory_mb": usage.ru_maxrss / 1024,  # Linux: KiB
        "node": node,
    }
    record_path.write_text(json.dumps(record, indent=2))
    return record


def run_job(job) -> dict:
    """Run one job (anything with ``script``, ``run_dir``, ``flags`` and ``env``) by :func:`run_one`."""
    return run_one(job.script, job.run_dir, job.flags, env=job.env)


# ---- Flags --------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, what: str = "runs") -> None:
    """``--backend``, ``--jobs``, ``--gpus_per_run``, ``--cpus_per_run``, ``--ray_address`` on a runner's parser."""
    group = parser.add_argument_group("where the runs run (see recipes/sweep.py)")
    group.add_argument(
        "--backend",
        default="local",
        choices=BACKENDS,
        help=f"local: {what} in processes on this machine; ray: each one a Ray task on the cluster at --ray_address",
    )
    group.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"{what} at a time (default: local, as many as the GPUs fit with --gpus_per_run, 1 without GPUs; ray, "
        "as many as the cluster fits)",
    )
    group.add_argument(
        "--gpus_per_run",
        type=float,
        default=None,
        help="GPUs each run gets (CUDA_VISIBLE_DEVICES locally, num_gpus on Ray): a whole number, or 1/n to share a "
        "GPU between n runs, or 0 for none (default 1 where there are GPUs, else 0)",
    )
    group.add_argument(
        "--cpus_per_run",
        type=int,
        default=None,
        help="CPU threads of each run (OMP_NUM_THREADS) and, on Ray, the CPUs its task reserves (default: local, "
        "OMP_NUM_THREADS as set, else the runner's share; ray, 1)",
    )
    group.add_argument(
        "--ray_address",
        default=None,
        help="--backend ray: the cluster's head (HOST:PORT as `ray start --head` prints it, or 'auto': the cluster "
        "`ray start` started on this machine); default: a Ray instance started on this machine for the sweep",
    )


def check_arguments(args) -> str | None:
    """What is wrong with the executor flags (one line naming the flag), or None."""
    if args.jobs is not None and args.jobs < 1:
        return f"--jobs {args.jobs}: it must be >= 1"
    if args.gpus_per_run is not None and (args.gpus_per_run < 0 or not math.isfinite(args.gpus_per_run)):
        return f"--gpus_per_run {args.gpus_per_run:g}: it must be >= 0"
    if args.cpus_per_run is not None and args.cpus_per_run < 1:
        return f"--cpus_per_run {args.cpus_per_run}: it must be >= 1"
    if args.ray_address and args.backend != "ray":
        return f"--ray_address {args.ray_address}: only with --backend ray"
    return None


def make_executor(args, default_threads: Callable[[int], int], run: Callable = run_job) -> LocalExecutor | RayExecutor:
    """The executor the flags ask for. ``default_threads(runs at a time)``: a local run's ``OMP_NUM_THREADS`` when
    neither ``--cpus_per_run`` nor the variable says; ``run``: how the local backend runs one job (tests run it in
    this process). Raises :class:`SweepError`."""
    if args.backend == "ray":
        return RayExecutor(args.ray_address, args.gpus_per_run, args.cpus_per_run, args.jobs)
    return LocalExecutor(args.jobs, args.gpus_per_run, args.cpus_per_run, default_threads=default_threads, run=run)


# ---- Progress -----------------------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _metric_text(record: dict | None, metric: str | None) -> str:
    if record is None or not metric:
        return ""
    results = record.get("results", {})
    for key in (f"test_{metric}", f"eval_{metric}", f"predict_{metric}"):
        if isinstance(results.get(key), int | float):
            return f", {key} {results[key]:.4f}"
    return ""


class Progress:
    """One line per finished run (the run, its wall time and metric, where it ran, runs done and left, an estimate
    of the time left) and a tqdm bar of the whole sweep on stderr."""

    def __init__(self, total: int, finished_before: int, metric: str | None, out: Path, label: str = "sweep"):
        from tqdm.auto import tqdm

        self.total, self.metric, self.out = total, metric, out
        self.done = self.before = finished_before
        self.start = time.perf_counter()
        self.lock = threading.Lock()
        self.write = tqdm.write
        if finished_before:
            print(
                f"[sweep] {finished_before} of {total} runs finished earlier with the same flags: not run again",
                flush=True,
            )
        self.bar = tqdm(
            total=total, initial=finished_before, unit="run", desc=label, file=sys.stderr, dynamic_ncols=True
        )
        self.bar.set_postfix_str(f"{total - finished_before} left", refresh=False)

    def name(self, job) -> str:
        try:
            return str(Path(job.run_dir).relative_to(self.out))
        except ValueError:
            return str(job.run_dir)

    def finished(self, job, record: dict | None, wall: float, where: str | None = None) -> None:
        with self.lock:
            self.done += 1
            left = self.total - self.done
            ran = self.done - self.before
            estimate = (time.perf_counter() - self.start) / ran * left
            what = f"{wall:.1f} s{_metric_text(record, self.metric)}" if record else f"FAILED after {wall:.1f} s"
            place = f" on {where}" if where else ""
            eta = f", about {_duration(estimate)} left" if left else ""
            self.write(f"[sweep] {self.name(job)}: {what}{place} ({self.done}/{self.total} done, {left} left{eta})")
            sys.stdout.flush()
            self.bar.set_postfix_str(f"{left} left", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def failure_report(outcomes: list[Outcome], out: Path) -> str:
    """The failed runs of a sweep, each with the end of its log; also written to ``out/failed_runs.txt``."""
    failed = [o for o in outcomes if o.record is None]
    lines = [f"{len(failed)} of {len(outcomes)} runs failed; the others are kept, so a rerun runs only these:"]
    for outcome in failed:
        lines += ["  " + line for line in (outcome.error or "").splitlines()]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failed_runs.txt").write_text(text + "\n")
    return text


def forget_failures(out: Path) -> None:
    (out / "failed_runs.txt").unlink(missing_ok=True)


# ---- Local --------------------------------------------------------------------------------------------------------


def visible_gpus() -> list[str]:
    """The GPUs a run may be given: ``CUDA_VISIBLE_DEVICES``'s entries, else every device torch counts."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_slots(gpus: list[str], gpus_per_run: float) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each run that fits at once: groups of ``gpus_per_run`` GPUs, or each GPU
    ``1 / gpus_per_run`` times (interleaved, so two runs take two GPUs before sharing one)."""
    if gpus_per_run >= 1:
        if gpus_per_run != int(gpus_per_run):
            raise SweepError(f"--gpus_per_run {gpus_per_run:g}: a whole number of GPUs, or 1/n to share one")
        n = int(gpus_per_run)
        if n > len(gpus):
            raise SweepError(f"--gpus_per_run {n}: {len(gpus)} GPU(s) visible ({','.join(gpus) or 'none'})")
        return [",".join(gpus[i * n : (i + 1) * n]) for i in range(len(gpus) // n)]
    share = round(1 / gpus_per_run)
    if abs(share * gpus_per_run - 1) > 1e-6:
        raise SweepError(f"--gpus_per_run {gpus_per_run:g}: below 1 it must be 1/n (0.5, 0.25, ...)")
    return [gpu for _ in range(share) for gpu in gpus]


def finished_outcomes(jobs: list) -> tuple[list[Outcome | None], list[int]]:
    """``(outcomes, todo)``: the :class:`Outcome` of each job that finished with its flags (``None`` for the
    others), and the indices of those still to run."""
    outcomes: list[Outcome | None] = [None] * len(jobs)
    todo = []
    for i, job in enumerate(jobs):
        record = finished_record(job.run_dir, job.flags)
        if record is None:
            todo.append(i)
        else:
            outcomes[i] = Outcome(job, record)
    return outcomes, todo


class LocalExecutor:
    """Runs on this machine, ``jobs`` at a time, each with its own GPUs where there are GPUs (see the module)."""

    def __init__(
        self,
        jobs: int | None = None,
        gpus_per_run: float | None = None,
        cpus_per_run: int | None = None,
        gpus: list[str] | None = None,
        default_threads: Callable[[int], int] = lambda jobs: 1,
        run: Callable = run_job,
    ):
        self.gpus = visible_gpus() if gpus is None else list(gpus)
        self.gpus_per_run = (1.0 if self.gpus else 0.0) if gpus_per_run is None else gpus_per_run
        if self.gpus_per_run > 0 and not self.gpus:
            raise SweepError(
                f"--gpus_per_run {self.gpus_per_run:g}: no GPU visible here (CUDA_VISIBLE_DEVICES, "
                "torch.cuda.device_count()); 0 runs on the CPU"
            )
        self.slots = gpu_slots(self.gpus, self.gpus_per_run) if self.gpus_per_run > 0 else []
        fit = len(self.slots) or None
        self.jobs = jobs or fit or 1
        if fit is not None and self.jobs > fit:
            raise SweepError(
                f"--jobs {self.jobs}: {fit} run(s) fit at a time on {len(self.gpus)} GPU(s) with --gpus_per_run "
                f"{self.gpus_per_run:g} (a smaller --gpus_per_run, e.g. 0.5, shares a GPU between runs)"
            )
        self.cpus_per_run = cpus_per_run
        self.default_threads = default_threads
        self.run_fn = run

    def describe(self) -> str:
        gpus = f", {self.gpus_per_run:g} GPU each" if self.slots else ""
        return f"{self.jobs} at a time on this machine{gpus}"

    def environment(self, job, slot: str | None) -> dict:
        """The environment run ``job`` gets in GPU slot ``slot`` (None: no GPUs to give out)."""
        env = dict(job.env) if getattr(job, "env", None) is not None else os.environ.copy()
        if self.cpus_per_run is not None:
            env["OMP_NUM_THREADS"] = str(self.cpus_per_run)
        elif "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, self.default_threads(self.jobs)))
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot
        elif self.gpus:  # --gpus_per_run 0 on a machine with GPUs: the run sees none
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def run(self, jobs: list, out: Path, metric: str | None = None, label: str = "sweep") -> list[Outcome]:
        """Every job (a NamedTuple with :class:`Job`'s fields); an :class:`Outcome` each, in ``jobs``' order."""
        outcomes, todo = finished_outcomes(jobs)
        progress = Progress(len(jobs), len(jobs) - len(todo), metric, Path(out), label)
        slots: queue.Queue = queue.Queue()
        for slot in self.slots:
            slots.put(slot)

        def one(i: int) -> None:
            job = jobs[i]
            slot = slots.get() if self.slots else None
            start = time.perf_counter()
            try:
                run_job = job._replace(env=self.environment(job, slot))
                outcomes[i] = Outcome(job, self.run_fn(run_job))
            except RunFailed as err:
                outcomes[i] = Outcome(job, None, str(err))
            finally:
                if slot is not None:
                    slots.put(slot)
            record = outcomes[i].record
            progress.finished(job, record, record["wall_seconds"] if record else time.perf_counter() - start)

        try:
            if self.jobs == 1:  # one at a time: in this thread (a job run in this process may install signal handlers)
                for i in todo:
                    one(i)
            else:
                with ThreadPoolExecutor(max_workers=self.jobs) as pool:
                    for future in as_completed([pool.submit(one, i) for i in todo]):
                        future.result()
        finally:
            progress.close()
        return outcomes

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- Ray ----------------------------------------------------------------------------------------------------------


def check_shared_storage(marker: str, token: str, run_dir: Path, where: str) -> str | None:
    """Why this node cannot use the sweep's output folder (one line), or None: it must see the marker the driver
    wrote there (the same storage, not a folder of the same name) and be able to write the run's folder."""
    try:
        seen = Path(marker).read_text() == token
    except OSError:
        seen = False
    if not seen:
        return (
            f"{where} does not see {Path(marker).parent} as the driver wrote it: the output folder must be on storage "
            "every node sees, at the same path"
        )
    probe = run_dir / f".write_check_{uuid.uuid4().hex}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        return (
            f"{where} cannot write {run_dir} ({err.strerror or err}): the output folder must be writable by every node"
        )
    return None


def run_on_node(script: str, run_dir: str, flags: list[str], env: dict, cwd: str, marker: str, token: str) -> dict:
    """The body of a Ray task: on the node Ray chose, the run by :func:`run_one` in the sweep's working folder, with
    the sweep's environment and the node's own GPUs. A dict: ``record``, or ``error`` (the run failed), or
    ``refused`` (this node cannot use the output folder), and ``where``."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    where = f"node {node[:8]} ({socket.gethostname()})"
    try:
        os.chdir(cwd)
    except OSError as err:
        return {"refused": f"{where} cannot enter the sweep's working folder {cwd} ({err.strerror})", "where": where}
    refused = check_shared_storage(marker, token, Path(run_dir), where)
    if refused:
        return {"refused": refused, "where": where}
    env = {**env, **{key: os.environ[key] for key in NODE_VARIABLES if key in os.environ}}
    if not ray.get_runtime_context().get_accelerator_ids().get("GPU"):
        env["CUDA_VISIBLE_DEVICES"] = ""  # a task without GPUs: Ray leaves the variable alone, the run sees none
    start = time.perf_counter()
    try:
        record = run_one(script, Path(run_dir), flags, env=env, node=node, die_with_parent=True, where=where)
    except RunFailed as err:
        return {"error": str(err), "where": where, "wall": err.wall}
    except OSError as err:
        return {"error": f"{run_dir}: {err} (on {where})", "where": where, "wall": time.perf_counter() - start}
    return {"record": record, "where": where}


def _unreachable(address: str | None) -> str | None:
    """Why nothing answers at a ``HOST:PORT`` address (Ray itself retries a wrong one for minutes), or None."""
    if not address or address in ("auto", "local") or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return "expected HOST:PORT (as `ray start --head` prints it), 'auto', or ray://HOST:PORT"
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as err:
        reason = err.strerror or str(err)
        return f"nothing answers there ({reason}); a cluster's head listens where `ray start --head --port {port}` ran"
    return None


class RayExecutor:
    """Runs as Ray tasks on a cluster (see the module); ``close`` disconnects (and stops an instance it started)."""

    def __init__(
        self,
        address: str | None = None,
        gpus_per_run: float | None = None,
        cpus_per_run: int | None = None,
        jobs: int | None = None,
    ):
        try:
            import ray
        except ImportError:
            raise SweepError('--backend ray: Ray is not installed (pip install "nlp-tricks[ray]")') from None
        import logging

        self.ray = ray
        self.address = address
        unreachable = _unreachable(address)
        if unreachable:
            raise SweepError(f"--ray_address {address}: {unreachable}")
        try:
            # "local": a fresh instance for this sweep, never a cluster that happens to run here.
            ray.init(
                address=address or "local",
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except (ConnectionError, ValueError, RuntimeError) as err:
            # Ray's own cause (a refused token, a version mismatch) says more than "failed to connect".
            cause = err.__cause__ or err
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise SweepError(f"--ray_address {address}: no Ray cluster to connect to ({first})") from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        has_gpus = any(n["Resources"].get("GPU", 0) > 0 for n in nodes)
        self.gpus_per_run = (1.0 if has_gpus else 0.0) if gpus_per_run is None else gpus_per_run
        self.cpus_per_run = 1 if cpus_per_run is None else cpus_per_run
        self.explicit_cpus = cpus_per_run is not None
        self.jobs = jobs
        if not any(
            n["Resources"].get("CPU", 0) >= self.cpus_per_run and n["Resources"].get("GPU", 0) >= self.gpus_per_run
            for n in nodes
        ):
            offered = "; ".join(
                f"{n['Resources'].get('CPU', 0):g} CPU, {n['Resources'].get('GPU', 0):g} GPU" for n in nodes
            )
            self.close()
            raise SweepError(
                f"--cpus_per_run {self.cpus_per_run} --gpus_per_run {self.gpus_per_run:g}: no node of the Ray "
                f"cluster has that much (its nodes: {offered or 'none'})"
            )
        # The task's code travels with it, so the nodes need this file at no particular path.
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        self.task = ray.remote(num_cpus=self.cpus_per_run, num_gpus=self.gpus_per_run, scheduling_strategy="SPREAD")(
            run_on_node
        )

    def describe(self) -> str:
        nodes = sum(1 for n in self.ray.nodes() if n.get("Alive"))
        limit = f", at most {self.jobs} at a time" if self.jobs else ""
        return f"Ray tasks on {nodes} node(s), {self.cpus_per_run} CPU and {self.gpus_per_run:g} GPU each{limit}"

    def environment(self, job) -> dict:
        """The driver's side of a run's environment: the job's (or this process's) without the node's variables."""
        env = dict(job.env) if getattr(job, "env", None) is not None else os.environ.copy()
        for key in NODE_VARIABLES:
            env.pop(key, None)
        if self.explicit_cpus or "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(self.cpus_per_run)
        return env

    def run(self, jobs: list, out: Path, metric: str | None = None, label: str = "sweep") -> list[Outcome]:
        """Every job as a Ray task (those that finished with the same flags are not submitted); an :class:`Outcome`
        each, in ``jobs``' order. Raises :class:`SweepError` when a node cannot use the output folder."""
        ray = self.ray
        out = Path(out)
        outcomes, todo = finished_outcomes(jobs)
        out.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        marker = out / f".sweep_{token}"
        marker.write_text(token)
        progress = Progress(len(jobs), len(jobs) - len(todo), metric, out, label)
        pending: dict = {}
        submitted_at: dict = {}
        waiting = list(todo)

        def submit() -> None:
            while waiting and (self.jobs is None or len(pending) < self.jobs):
                i = waiting.pop(0)
                job = jobs[i]
                ref = self.task.remote(
                    str(job.script), str(job.run_dir), list(job.flags), self.environment(job), os.getcwd(),
                    str(marker.resolve()), token,
                )  # fmt: skip
                pending[ref] = i
                submitted_at[i] = time.perf_counter()

        try:
            submit()
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                i = pending.pop(ref)
                job = jobs[i]
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as err:  # the task itself was lost (after Ray's own retries)
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    result = {"error": f"{job.run_dir}: the Ray task was lost ({type(err).__name__}: {first})"}
                if "refused" in result:
                    raise SweepError(result["refused"])
                record = result.get("record")
                outcomes[i] = Outcome(job, record, result.get("error"))
                wall = record["wall_seconds"] if record else result.get("wall", time.perf_counter() - submitted_at[i])
                progress.finished(job, record, wall, result.get("where"))
                submit()
        finally:
            for ref in pending:  # a refusal or an interrupt: nothing keeps running for a sweep that stopped
                ray.cancel(ref, force=True)
            progress.close()
            marker.unlink(missing_ok=True)
        return outcomes

    def close(self) -> None:
        if self.ray.is_initialized():
            self.ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
