"""Run the benchmarks in benchmarks/ (all but data_scale.py, below), each side by side with its baseline in one
run; print one table (and one for the rows of exactness.py).

    python benchmarks/run_all.py            # the full runs the docs quote (about 20 minutes on 2 CPU cores)
    python benchmarks/run_all.py --quick    # tiny shapes, seconds each: checks that each of them runs

Each benchmark script prints its rows as JSON with ``--json``: ``benchmark``, ``case``, ``baseline``, ``ratio``
(time of ``case`` / time of ``baseline``, measured in the same run) and ``median_ms``. Ratios are what to
compare across machines; absolute times are labelled with the machine they come from. ``exactness.py`` times
nothing: its rows (``relative``: how far one step moves when the batch is split) get a table of their own.
``preemption_flag.py`` runs
as 2 processes (``accelerate launch --multi_gpu``: gloo on CPUs). ``data_scale.py`` is not run here: it times
whole recipe processes over files of up to 480,000 rows and reads their peak memory; run it on its own
(docs/recipes.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# Not a side-by-side timing in one run (see the module docstring).
NOT_RUN = {"data_scale"}
# Measures a cross-process all-reduce: launched as 2 processes.
TWO_PROCESSES = {"preemption_flag"}


def machine_label() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {device}, torch {torch.__version__}"


def two_process_launch() -> list[str]:
    """``-m accelerate.commands.launch`` with 2 processes on one machine, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    return launch + ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: seconds per benchmark")
    parser.add_argument("--only", default=None, help="comma-separated benchmark file stems to run")
    args = parser.parse_args(argv)

    # _timing.py and other underscored files are helpers, not benchmarks.
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != "run_all.py" and not p.name.startswith("_"))
    scripts = [p for p in scripts if p.stem not in NOT_RUN]
    if args.only:
        scripts = [p for p in scripts if p.stem in args.only.split(",")]
    rows, failed = [], []
    for script in scripts:
        command = [str(script), "--json"] + (["--quick"] if args.quick else [])
        env = None
        if script.stem in TWO_PROCESSES:
            command = [*two_process_launch(), *command]
            if torch.cuda.device_count() < 2:  # one GPU cannot hold two NCCL ranks: the two processes use the CPU
                env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        command = [sys.executable, *command]
        print(f"[run_all] {' '.join(command)}", file=sys.stderr, flush=True)
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            failed.append(script.stem)
            print(proc.stderr[-2000:], file=sys.stderr)
            continue
        rows.extend(json.loads(proc.stdout.strip().splitlines()[-1]))

    quick = " (--quick: tiny shapes, a smoke test; the ratios are overhead-dominated, not representative)"
    print(f"Machine: {machine_label()}{quick if args.quick else ''}\n")
    timed = [r for r in rows if "ratio" in r]
    print("| benchmark | case | baseline | time / baseline | median ms |")
    print("|---|---|---|---|---|")
    for r in timed:
        print(f"| {r['benchmark']} | {r['case']} | {r['baseline']} | {r['ratio']:.2f}x | {r['median_ms']:.1f} |")
    splits = [r for r in rows if "relative" in r]
    if splits:
        print("\n| benchmark | case | split | max abs diff / step | measured |")
        print("|---|---|---|---|---|")
        for r in splits:
            print(f"| {r['benchmark']} | {r['case']} | {r['split']} | {r['relative']:.1e} | {r['measured']} |")
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
