"""`recipes/sweep.py`, the executor of the ablation and k-fold runners, without training: stand-in runs (a script
that writes the environment it got as its results) on the local backend with a faked GPU count, its failures and
progress lines, and the shared-storage check of the Ray backend (the Ray backend on a real cluster: test_sweep_ray.py).
"""

import re
import sys

import pytest

import sweep

# A run: sleeps a little (so runs overlap), then writes what it was given; exit 3 when asked to fail.
STAND_IN = """\
import json, os, sys, time
out = sys.argv[sys.argv.index('--output_dir') + 1]
start = time.time()
time.sleep(0.3)
if '--fail' in sys.argv:
    print('something went wrong here')
    sys.exit(3)
env = {k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'OMP_NUM_THREADS')}
json.dump({'env': env, 'start': start, 'end': time.time(), 'test_f1': 0.25}, open(out + '/all_results.json', 'w'))
"""


def stand_in_jobs(tmp_path, n, fail=()):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return [
        sweep.Job(str(script), tmp_path / "out" / f"run{i}", ["--seed", str(i), *(["--fail"] if i in fail else [])])
        for i in range(n)
    ]


def overlapping(records):
    """Pairs of runs whose processes ran at the same time."""
    spans = [(r["results"]["start"], r["results"]["end"]) for r in records]
    return [
        (a, b) for a in range(len(spans)) for b in range(a) if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
    ]


def test_local_backend_gives_each_concurrent_run_its_own_gpus(tmp_path, monkeypatch, capsys):
    """4 GPUs faked through CUDA_VISIBLE_DEVICES, 2 per run: 2 runs at a time by default, each process seeing its
    own pair; runs that overlap in time never share a GPU, and both pairs are used."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    executor = sweep.LocalExecutor(gpus_per_run=2, default_threads=lambda jobs: 8 // jobs)
    assert executor.jobs == 2  # as many runs as fit
    outcomes = executor.run(stand_in_jobs(tmp_path, 6), tmp_path / "out", "f1")
    records = [o.record for o in outcomes]
    assert all(records)
    seen = [r["results"]["env"]["CUDA_VISIBLE_DEVICES"] for r in records]
    assert sorted(set(seen)) == ["4,5", "6,7"]
    pairs = overlapping(records)
    assert pairs, "no two runs ran at the same time"
    for a, b in pairs:
        assert seen[a] != seen[b], f"runs {a} and {b} ran at once on {seen[a]}"
    # Threads: the runner's share (8 cores / 2 runs) when neither --cpus_per_run nor OMP_NUM_THREADS says.
    assert {r["results"]["env"]["OMP_NUM_THREADS"] for r in records} == {"4"}
    assert {r["node"] for r in records} == {sweep.socket.gethostname()}
    # Progress: one line per run, with its metric, and the count of runs done and left.
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[sweep] run")]
    assert len(lines) == 6 and all(", test_f1 0.2500" in line for line in lines)
    assert sorted(re.search(r"\((\d)/6 done, (\d) left", line).groups() for line in lines) == [
        (str(k), str(6 - k)) for k in range(1, 7)
    ]


@pytest.mark.parametrize(
    "gpus, gpus_per_run, jobs, expected",
    [
        (["0", "1"], 0.5, None, ["0", "1", "0", "1"]),  # two runs per GPU, both GPUs before sharing one
        (["0", "1", "2"], 2, None, ["0,1"]),  # the GPU left over is not half a run
        (["0", "1"], 1, 1, ["0", "1"]),  # --jobs 1: one run at a time, the slots as they are
    ],
)
def test_gpu_slots_written_out(gpus, gpus_per_run, jobs, expected):
    executor = sweep.LocalExecutor(jobs, gpus_per_run, gpus=gpus)
    assert executor.slots == expected and executor.jobs == (jobs or len(expected))


def test_local_backend_refuses_what_does_not_fit_and_hides_gpus_at_zero(tmp_path):
    with pytest.raises(sweep.SweepError, match=r"--jobs 3: 2 run\(s\) fit at a time on 2 GPU\(s\)"):
        sweep.LocalExecutor(3, 1, gpus=["0", "1"])
    with pytest.raises(sweep.SweepError, match="--gpus_per_run 1: no GPU visible"):
        sweep.LocalExecutor(None, 1, gpus=[])
    with pytest.raises(sweep.SweepError, match="--gpus_per_run 0.3: below 1 it must be 1/n"):
        sweep.LocalExecutor(None, 0.3, gpus=["0"])
    with pytest.raises(sweep.SweepError, match="--gpus_per_run 1.5: a whole number"):
        sweep.LocalExecutor(None, 1.5, gpus=["0", "1"])
    job = sweep.Job("x.py", tmp_path, [], {"OMP_NUM_THREADS": "2"})
    # --gpus_per_run 0 where there are GPUs: the run sees none. No GPUs at all: CUDA_VISIBLE_DEVICES left alone.
    assert sweep.LocalExecutor(2, 0, gpus=["0"]).environment(job, None) == {
        "OMP_NUM_THREADS": "2",
        "CUDA_VISIBLE_DEVICES": "",
    }
    assert sweep.LocalExecutor(2, None, gpus=[]).environment(job, None) == {"OMP_NUM_THREADS": "2"}
    # --cpus_per_run wins over the variable.
    assert sweep.LocalExecutor(2, None, 3, gpus=[]).environment(job, None) == {"OMP_NUM_THREADS": "3"}


def test_a_failed_run_loses_no_other(tmp_path, capsys):
    """Run 1 of 3 fails: the other two finish with their records, the failed one's outcome holds its exit status
    and the end of its log, and the report (also in failed_runs.txt) names it; a rerun runs only it."""
    jobs = stand_in_jobs(tmp_path, 3, fail={1})
    out = tmp_path / "out"
    outcomes = sweep.LocalExecutor(2, gpus=[]).run(jobs, out, "f1")
    assert [o.record is not None for o in outcomes] == [True, False, True]
    error = outcomes[1].error
    assert f"run1: the run failed (exit 3, on {sweep.socket.gethostname()})" in error and "went wrong here" in error
    report = sweep.failure_report(outcomes, out)
    assert report.startswith("1 of 3 runs failed") and "something went wrong here" in report
    assert (out / "failed_runs.txt").read_text() == report + "\n"
    assert "[sweep] run1: FAILED after" in capsys.readouterr().out
    finished = {i: (jobs[i].run_dir / "ablation_run.json").stat().st_mtime_ns for i in (0, 2)}
    fixed = [
        job._replace(flags=[f for f in job.flags if f != "--fail"]) if i == 1 else job for i, job in enumerate(jobs)
    ]
    again = sweep.LocalExecutor(2, gpus=[]).run(fixed, out, "f1")
    assert all(o.record for o in again)
    assert "2 of 3 runs finished earlier with the same flags" in capsys.readouterr().out
    assert {i: (jobs[i].run_dir / "ablation_run.json").stat().st_mtime_ns for i in (0, 2)} == finished


def test_shared_storage_check_names_the_node_and_the_folder(tmp_path):
    marker = tmp_path / ".sweep_abc"
    marker.write_text("abc")
    assert sweep.check_shared_storage(str(marker), "abc", tmp_path / "run", "node 1") is None
    # Another machine's folder of the same name holds no marker, or another sweep's.
    assert "node 1 does not see" in sweep.check_shared_storage(str(marker), "xyz", tmp_path / "run", "node 1")
    missing = sweep.check_shared_storage(str(tmp_path / "nowhere" / ".sweep_abc"), "abc", tmp_path, "node 1")
    assert "must be on storage every node sees" in missing and "\n" not in missing
    (tmp_path / "file").write_text("")
    unwritable = sweep.check_shared_storage(str(marker), "abc", tmp_path / "file" / "run", "node 2")
    assert unwritable.startswith(f"node 2 cannot write {tmp_path / 'file' / 'run'}") and "\n" not in unwritable


def test_ray_backend_without_ray_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(
        sweep.SweepError, match=r'--backend ray: Ray is not installed \(pip install "nlp-tricks\[ray\]"\)'
    ):
        sweep.RayExecutor()


def test_executor_flags_are_checked_in_one_line(tmp_path, capsys):
    import ablation

    for flags, message in [
        (["--jobs", "0"], "--jobs 0: it must be >= 1"),
        (["--gpus_per_run", "-1"], "--gpus_per_run -1: it must be >= 0"),
        (["--cpus_per_run", "0"], "--cpus_per_run 0: it must be >= 1"),
        (["--ray_address", "h:1"], "--ray_address h:1: only with --backend ray"),
        (["--backend", "slurm"], "--backend: invalid choice: 'slurm'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            ablation.main(["--recipe", "ner", "--output_dir", str(tmp_path / "o"), *flags])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # A fold without a test split: the progress line shows its validation metric.
    assert sweep._metric_text({"results": {"eval_f1": 0.5}}, "f1") == ", eval_f1 0.5000"


def test_a_ray_address_where_nothing_answers_is_one_line_at_once():
    """Ray retries a wrong address for minutes; the executor asks the port first (no Ray needed for that)."""
    import socket

    from recipe_helpers import free_port

    assert "nothing answers there" in sweep._unreachable(f"127.0.0.1:{free_port()}")
    assert "expected HOST:PORT" in sweep._unreachable("head-node")
    assert sweep._unreachable("auto") is None and sweep._unreachable(None) is None
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert sweep._unreachable(f"127.0.0.1:{listening.getsockname()[1]}") is None
