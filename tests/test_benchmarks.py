"""Every benchmark runs (quick shapes) and reports a ratio against its baseline from the same run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_all_quick():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| losses | focal_loss | cross_entropy |" in proc.stdout


@pytest.mark.slow  # a process importing torch: seconds; the default run keeps the benchmarks' own tests
def test_losses_benchmark_quick_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "losses.py"), "--quick", "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert rows["cross_entropy"]["ratio"] == 1.0
    assert set(rows) == {"cross_entropy", "focal_loss", "label_smoothing"}
    assert all(r["median_ms"] > 0 for r in rows.values())


@pytest.mark.slow  # a process importing torch: seconds; the default run keeps the benchmarks' own tests
def test_ema_benchmark_quick_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ema.py"), "--quick", "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["case"], r["baseline"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert rows[("plain", "plain")]["ratio"] == 1.0
    assert {("ema", "plain"), ("classic ema", "plain"), ("EMA.update", "classic update")} <= set(rows)
    assert all(r["median_ms"] > 0 for r in rows.values())


@pytest.mark.slow
def test_crf_benchmark_quick_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "crf.py"), "--quick", "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = [r["case"].split()[0] for r in rows]
    assert cases == ["nll+backward", "viterbi", "ner_step_crf"]
    assert all(r["median_ms"] > 0 and r["ratio"] > 0 for r in rows)


@pytest.mark.slow
def test_span_head_benchmark_quick_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "span_head.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["case"].split()[0] for r in rows] == [
        "ner_step_ce",
        "ner_step_global_pointer",
        "ner_step_efficient_global_pointer",
        "predict_global_pointer",
        "predict_efficient_global_pointer",
    ]
    assert all(r["median_ms"] > 0 and r["ratio"] > 0 for r in rows)


@pytest.mark.slow  # a process importing torch: seconds; the default run keeps the benchmarks' own tests
def test_tricks_overhead_benchmark_quick_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tricks_overhead.py"), "--quick", "--json", "--repeats", "2"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert rows["plain Trainer"]["ratio"] == 1.0 and rows["TricksTrainer, tricks off"]["median_ms"] > 0
