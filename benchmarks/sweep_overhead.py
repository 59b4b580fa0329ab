"""The scheduling overhead per run of a sweep (recipes/sweep.py): local subprocess vs a Ray task, one run at a time.

    python benchmarks/sweep_overhead.py                                # a Ray instance started here
    python benchmarks/sweep_overhead.py --ray_address 127.0.0.1:6379   # a running cluster
    python benchmarks/sweep_overhead.py --runs 5 --no_ray              # the local backend alone (no Ray installed)

Each run is a stand-in recipe (a Python script that writes its ``all_results.json`` and exits), run by the
executor's ``run`` one at a time, each in a fresh folder. A run's overhead is the wall time of ``run([job])`` as the
caller sees it minus the run's own wall time (``wall_seconds`` of its record: the subprocess from start to exit):
for Ray, the task's submission, scheduling and result, the shared-storage check on the node and the result's way
back; for both, the check for a finished run, the log and the record. The first Ray run also starts the node's
worker process; it is reported apart from the median of the others. Ray's own start (``ray.init``:
connecting, or starting an instance here) is once per sweep and reported apart too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import sweep  # noqa: E402

STAND_IN = """\
import json, sys
out = sys.argv[sys.argv.index('--output_dir') + 1]
json.dump({'test_f1': 0.0}, open(out + '/all_results.json', 'w'))
"""


def measure(executor, script: Path, folder: Path, runs: int) -> list[float]:
    overheads = []
    for i in range(runs):
        job = sweep.Job(str(script), folder / f"run{i}", ["--seed", str(i)])
        start = time.perf_counter()
        [outcome] = executor.run([job], folder, "f1")
        elapsed = time.perf_counter() - start
        assert outcome.record is not None, outcome.error
        overheads.append(elapsed - outcome.record["wall_seconds"])
    return overheads


def summary(name: str, overheads: list[float], first_apart: bool) -> dict:
    rest = overheads[1:] if first_apart else overheads
    row = {"backend": name, "runs": len(overheads), "median_s": statistics.median(rest), "max_s": max(rest)}
    if first_apart:
        row["first_s"] = overheads[0]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs per backend (default 20)")
    parser.add_argument("--ray_address", default=None, help="a running Ray cluster (default: start one here)")
    parser.add_argument("--no_ray", action="store_true", help="the local backend only")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    cli = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        script = tmp / "stand_in.py"
        script.write_text(STAND_IN)
        with sweep.LocalExecutor(1, 0, gpus=[]) as local:
            rows.append(summary("local", measure(local, script, tmp / "local", cli.runs), first_apart=False))
        if not cli.no_ray:
            start = time.perf_counter()
            with sweep.RayExecutor(cli.ray_address, jobs=1) as executor:
                started = time.perf_counter() - start
                rows.append(summary("ray", measure(executor, script, tmp / "ray", cli.runs), first_apart=True))
            rows[-1]["ray_start_s"] = started
    if cli.json:
        print(json.dumps(rows))
        return
    print("| backend | runs | overhead per run, median (s) | max (s) | first run (s) | Ray's start (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        first = f"{r['first_s']:.2f}" if "first_s" in r else "-"
        ray_start = f"{r['ray_start_s']:.2f}" if "ray_start_s" in r else "-"
        print(f"| {r['backend']} | {r['runs']} | {r['median_s']:.3f} | {r['max_s']:.3f} | {first} | {ray_start} |")


if __name__ == "__main__":
    main()
