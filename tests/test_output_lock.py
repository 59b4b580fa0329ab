"""One run per output folder: a second run is refused with one line naming the first (pid, host, start, command),
before it touches anything; kill -9 of the holder never leaves the folder locked."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nlp_tricks import TricksTrainer
from nlp_tricks.runtime.lock import LOCK_NAME, OutputDirBusyError, lock_output_dir
from recipe_helpers import env, ner_files, run_in_process, tiny_args
from tiny import bert_seq_cls, seq_cls_data, tricks_args

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import sys
from nlp_tricks.runtime.lock import lock_output_dir
lock_output_dir(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of ``tmp_path / "out"`` (its command line carries a secret flag)."""
    out = tmp_path / "out"
    command = [sys.executable, "-c", HOLDER, str(out), "--hub_token", "hf_secret"]
    proc = subprocess.Popen(command, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield out, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _assert_names_the_holder(message: str, proc) -> None:
    assert "\n" not in message
    assert f"is in use by another run (pid {proc.pid} on {socket.gethostname()}, started 20" in message
    assert "--hub_token ***" in message and "hf_secret" not in message


def test_trainer_is_refused_while_another_process_holds_the_folder(holder):
    out, proc = holder
    trainer = TricksTrainer(model=bert_seq_cls(), args=tricks_args(out, max_steps=1), train_dataset=seq_cls_data())
    with pytest.raises(OutputDirBusyError) as info:
        trainer.train()
    _assert_names_the_holder(str(info.value), proc)
    assert trainer.state.global_step == 0

    proc.send_signal(signal.SIGKILL)  # the OS drops the lock of a killed process: the folder is free again
    proc.wait()
    assert (out / LOCK_NAME).exists()  # left by the killed holder; taking it over is what matters
    trainer.train()
    assert trainer.state.global_step == 1
    assert not (out / LOCK_NAME).exists()  # released (and removed) when train() ends


def test_recipe_is_refused_before_it_touches_the_folder(holder, tiny_model, tmp_path, monkeypatch, capsys):
    out, proc = holder
    (out / "checkpoint-2").mkdir()
    (out / "all_results.json").write_text("{}")
    before = sorted(p.name for p in out.iterdir())
    args = tiny_args(tiny_model, out, *ner_files(tmp_path), "--overwrite_output_dir", "true")
    assert run_in_process("ner", args, monkeypatch) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "is in use by another run" in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    _assert_names_the_holder(lines[0], proc)
    assert sorted(p.name for p in out.iterdir()) == before, "--overwrite_output_dir removed another run's files"


def test_the_lock_is_reentrant_within_a_process_and_released_by_the_last_holder(tmp_path):
    first = lock_output_dir(tmp_path / "out")
    second = lock_output_dir(tmp_path / "out" / ".." / "out")  # the same folder by another path
    assert second is first
    record = json.loads((tmp_path / "out" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    second.release()
    assert (tmp_path / "out" / LOCK_NAME).exists()
    first.release()
    assert not (tmp_path / "out").exists()  # the lock created the folder and nothing else was written there
    lock_output_dir(tmp_path / "out").release()  # free to take again


def test_recipe_releases_the_lock_when_it_ends(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert run_in_process("ner", tiny_args(tiny_model, out, *ner_files(tmp_path)), monkeypatch) == 0
    assert (out / "all_results.json").is_file() and not (out / LOCK_NAME).exists()
    lock_output_dir(out).release()


@pytest.mark.slow  # two recipe processes at once: ~1 min on 2 shared cores
def test_two_recipe_runs_started_together_one_is_refused(tiny_model, tmp_path):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, *ner_files(tmp_path), "--max_steps", "40", "--save_steps", "10")
    command = [sys.executable, str(ROOT / "recipes" / "ner.py"), *args]
    procs = [
        subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], [err[-2000:] for _, err in results]
    refused = next(err for code, err in results if code == 1)
    winner = next(p for p, (code, _) in zip(procs, results) if code == 0)
    assert f"is in use by another run (pid {winner.pid} " in refused and "Traceback" not in refused
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 40


# ---- A launched job whose arguments are not distributed --------------------------------------------------------


def test_a_process_group_of_several_with_arguments_of_one_is_refused_before_the_lock(tmp_path, monkeypatch):
    """What `accelerate launch --multi_gpu --num_processes 2` on CPUs without use_cpu=True gives every process: a
    process group of 2, arguments of world size 1 (each process would train alone on all the data, in one folder)."""
    import torch.distributed as dist

    from nlp_tricks.runtime.lock import NotDistributedError

    trainer = TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path / "out", max_steps=1),
                            train_dataset=seq_cls_data())  # fmt: skip
    assert trainer.args.world_size == 1
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with pytest.raises(NotDistributedError) as info:
        trainer.train()
    assert str(info.value) == (
        "rank 1 of a launched job of 2 processes: the process group is initialized, but the TrainingArguments are not "
        "distributed (parallel mode 'not_parallel', world size 1), so each process would train alone on all the data; "
        "without GPUs pass use_cpu=True (recipes: --use_cpu true)"
    )
    assert trainer.state.global_step == 0 and not (tmp_path / "out" / LOCK_NAME).exists()


@pytest.mark.slow  # a 2-process launch of a recipe: ~35 s on 2 shared cores
def test_a_cpu_launch_of_two_processes_without_use_cpu_is_one_line_on_every_rank(tiny_model, tmp_path):
    """Formerly rank 1 died with an OutputDirBusyError traceback (rank 0 held the folder as a run of its own) and
    rank 0 was killed by the launcher."""
    from recipe_helpers import launch

    out = tmp_path / "out"
    proc = launch("ner", tiny_args(tiny_model, out, *ner_files(tmp_path), "--use_cpu", "false"), launcher="ddp2")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "the TrainingArguments are not distributed" in line]
    assert sorted(line.split(" of a launched job")[0] for line in lines) == ["rank 0", "rank 1"], proc.stderr[-3000:]
    assert all(line.endswith("without GPUs pass use_cpu=True (recipes: --use_cpu true)") for line in lines)
    assert "OutputDirBusyError" not in proc.stderr and "[rank" not in proc.stderr  # no rank's traceback
    assert not (out / "all_results.json").exists() and not list(out.glob("checkpoint-*"))
