"""Preemption: a signal or --max_time stops training after a whole step with one complete checkpoint, resuming from it
is the uninterrupted run, and a recipe stopped this way does not look finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from transformers import TrainerCallback

from nlp_tricks import TricksTrainer
from nlp_tricks.runtime.preemption import (
    PREEMPTED_EXIT_CODE,
    PreemptionCallback,
    parse_duration,
    set_time_budget,
)
from nlp_tricks.runtime.resume import checkpoint_problem
from nlp_tricks.runtime.state import TRICKS_STATE_NAME
from recipe_helpers import env as recipe_env
from recipe_helpers import launch_ddp_script, ner_files, run_in_process, tiny_args
from tiny import bert_token_cls, token_cls_data, tricks_args

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from preempt_ddp import SendSignal, run_settings  # noqa: E402

from tiny import ema_of  # noqa: E402


@pytest.fixture(autouse=True)
def _no_time_budget_left_behind():
    yield
    set_time_budget(None)  # a recipe run in this process sets the process-wide budget


# ---- Durations --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [("8h45m", 8 * 3600 + 45 * 60), ("30m", 1800), ("90s", 90), ("1d2h", 26 * 3600), ("1.5h", 5400), ("45", 45)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "8x", "h", "45m8h", "-5", "0s", "nan"])
def test_bad_durations_name_the_value_and_the_forms(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


# ---- One process ------------------------------------------------------------------------------------------------

STEPS = 12  # 5 optimizer steps an epoch (20 examples, 2 a micro-batch, 2 micro-batches a step): 7 is mid-epoch


def weights(trainer):
    raw = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    ema = {k: v.detach().clone() for k, v in ema_of(trainer).state_dict()["shadow"].items()}
    return raw, ema


def assert_close(a: dict, b: dict, what: str):
    assert a.keys() == b.keys()
    for key in a:
        # 1e-6: the runs do the same float32 operations in the same order (one thread); only round-off may differ.
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=lambda m, key=key: f"{what} {key}: {m}")


def test_sigterm_mid_step_saves_that_step_and_resume_equals_the_uninterrupted_run(tmp_path, one_thread):
    before = signal.getsignal(signal.SIGTERM)
    reference = run_settings(tmp_path / "reference", STEPS)
    # The signal arrives inside step 7 (between its backward passes and its optimizer step).
    stopped = run_settings(tmp_path / "run", STEPS, send=SendSignal(step=7, signum=signal.SIGTERM))
    assert stopped.preempted == "SIGTERM"
    assert stopped.state.global_step == 7
    assert signal.getsignal(signal.SIGTERM) == before, "the handler of before training is back"
    folders = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint-"))
    assert folders == ["checkpoint-7"]
    assert checkpoint_problem(tmp_path / "run" / "checkpoint-7", (TRICKS_STATE_NAME,)) is None
    state = json.loads((tmp_path / "run" / "checkpoint-7" / "trainer_state.json").read_text())
    assert state["global_step"] == 7
    # No evaluation and no averaging at the stop: the EMA at step 7 is the one saved.
    resumed = run_settings(tmp_path / "run", STEPS, resume=True)
    assert resumed.preempted is None and resumed.state.global_step == STEPS
    raw, ema = weights(resumed)
    raw_ref, ema_ref = weights(reference)
    assert_close(raw, raw_ref, "raw")
    assert_close(ema, ema_ref, "EMA")


def test_a_user_tricks_state_is_in_the_preemption_checkpoint(tmp_path):
    from nlp_tricks import Trick

    class CountForwards(Trick):
        def __init__(self):
            self.count = 0

        def adjust_loss(self, trainer, inputs, outputs, loss):
            self.count += 1
            return loss

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

    def run(out, send=None, resume=None):
        trick = CountForwards()
        args = tricks_args(out, enable_jit_checkpoint=True, max_steps=6)
        trainer = TricksTrainer(
            model=bert_token_cls(),
            args=args,
            train_dataset=token_cls_data(n=24),
            tricks=[trick],
            callbacks=[send] if send else None,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trick.count

    assert run(tmp_path, send=SendSignal(step=3)) == 3
    # One backpropagated forward a step: 6 in all only if the 3 before the stop came back from the checkpoint.
    assert run(tmp_path, resume=True) == 6


def test_upstream_jit_handler_is_replaced_and_only_installed_while_training(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    args = tricks_args(tmp_path, enable_jit_checkpoint=True)
    trainer = TricksTrainer(model=bert_token_cls(), args=args, train_dataset=token_cls_data())
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert "JITCheckpointCallback" not in names and names.count("PreemptionCallback") == 1
    assert signal.getsignal(signal.SIGTERM) == before, "nothing caught before train()"

    seen = {}

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen[state.global_step] = signal.getsignal(signal.SIGTERM)

    trainer.add_callback(Look())
    trainer.train()
    assert seen[1] == trainer.preemption._handle
    assert signal.getsignal(signal.SIGTERM) == before
    assert trainer.preempted is None

    # Without enable_jit_checkpoint nothing is caught.
    off = TricksTrainer(model=bert_token_cls(), args=tricks_args(tmp_path / "off"), train_dataset=token_cls_data())
    assert off.preemption.signals == ()


def test_handlers_come_back_when_training_raises(tmp_path):
    before = signal.getsignal(signal.SIGTERM)

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("boom")

    args = tricks_args(tmp_path, enable_jit_checkpoint=True)
    trainer = TricksTrainer(model=bert_token_cls(), args=args, train_dataset=token_cls_data(), callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_during_the_setup_before_the_first_step_is_not_lost(tmp_path):
    class SignalledWhileLoading(TricksTrainer):
        def get_train_dataloader(self):  # inside train(), before on_train_begin (like a checkpoint being loaded)
            os.kill(os.getpid(), signal.SIGTERM)
            return super().get_train_dataloader()

    args = tricks_args(tmp_path, enable_jit_checkpoint=True, max_steps=5)
    trainer = SignalledWhileLoading(model=bert_token_cls(), args=args, train_dataset=token_cls_data())
    trainer.train()
    assert trainer.preempted == "SIGTERM" and trainer.state.global_step == 1


def test_a_signal_during_the_last_step_still_saves_and_reports_the_stop(tmp_path):
    args = tricks_args(tmp_path, enable_jit_checkpoint=True, max_steps=3)
    trainer = TricksTrainer(
        model=bert_token_cls(),
        args=args,
        train_dataset=token_cls_data(),
        callbacks=[SendSignal(step=3, signum=signal.SIGUSR1)],
    )
    trainer.train()
    # The final evaluation / prediction of a script may not fit in the grace period: the run says it was stopped.
    assert trainer.preempted == "SIGUSR1" and trainer.state.global_step == 3
    assert checkpoint_problem(tmp_path / "checkpoint-3") is None


def test_the_stop_skips_the_due_evaluation_and_keeps_its_checkpoint_beside_the_best(tmp_path):
    args = tricks_args(
        tmp_path,
        enable_jit_checkpoint=True,
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
    )
    trainer = TricksTrainer(
        model=bert_token_cls(),
        args=args,
        train_dataset=token_cls_data(n=40),
        eval_dataset=token_cls_data(n=4, seed=1),
        callbacks=[SendSignal(step=4)],
    )
    trainer.train()
    assert trainer.preempted == "SIGTERM" and trainer.state.global_step == 4
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [2], "no evaluation at the stop"
    # save_total_limit=1 with a best checkpoint: upstream's end of training deletes every other one, not this one.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    assert checkpoint_problem(tmp_path / "checkpoint-4") is None
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")


class FakeClock:
    """``time.time`` / ``time.monotonic`` of the preemption module: a clock that moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now

    def monotonic(self):
        return self.now

    def perf_counter(self):
        return self.now


class TenSecondSteps(TrainerCallback):
    def __init__(self, clock):
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):  # (runs before the PreemptionCallback's)
        self.clock.now += 10.0


def test_max_time_stops_when_the_next_step_and_the_save_would_not_fit(tmp_path, monkeypatch):
    import nlp_tricks.runtime.preemption as preemption

    clock = FakeClock()
    monkeypatch.setattr(preemption, "time", clock)
    args = tricks_args(tmp_path, max_steps=1000)
    trainer = TricksTrainer(
        model=bert_token_cls(), args=args, train_dataset=token_cls_data(n=64), callbacks=[TenSecondSteps(clock)]
    )
    trainer.preemption.deadline = clock.now + 100.0
    trainer.train()
    # Steps of 10 s, no save timed yet: 1 s + 4 bytes a parameter at 100 MB/s (a tiny model: ~1 s), times 1.25.
    # After step k the clock reads 10 k; continuing needs 1.25 * (10 + save) more: k = 8 still fits
    # (80 + 13.76 < 100), k = 9 does not (90 + 13.76 > 100).
    assert trainer.preempted == "max_time" and trainer.state.global_step == 9
    assert checkpoint_problem(tmp_path / "checkpoint-9") is None


class SlowSteps(TrainerCallback):
    """Steps of a known length, so that the time budget's estimate has something to measure."""

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(0.2)


@pytest.mark.slow  # real time: a machine loaded enough to stall for a second breaks its margin
def test_max_time_stops_before_the_deadline_with_a_checkpoint(tmp_path):
    start = time.time()
    deadline = start + 3.0
    args = tricks_args(tmp_path, max_steps=1000)
    trainer = TricksTrainer(
        model=bert_token_cls(), args=args, train_dataset=token_cls_data(n=64), callbacks=[SlowSteps()]
    )
    trainer.preemption.deadline = deadline
    trainer.train()
    ended = time.time()
    assert trainer.preempted == "max_time"
    assert ended < deadline, f"ended {ended - deadline:.2f} s after the deadline"
    step = trainer.state.global_step
    assert 3 <= step < 1000
    assert checkpoint_problem(tmp_path / f"checkpoint-{step}") is None


def test_process_wide_budget_applies_to_every_trainer_and_can_be_cleared(tmp_path):
    try:
        set_time_budget(0.001, start=time.time() - 10)  # already spent: stop after the first step
        args = tricks_args(tmp_path, max_steps=5)
        trainer = TricksTrainer(model=bert_token_cls(), args=args, train_dataset=token_cls_data())
        trainer.train()
        assert trainer.preempted == "max_time" and trainer.state.global_step == 1
    finally:
        set_time_budget(None)
    trainer = TricksTrainer(
        model=bert_token_cls(), args=tricks_args(tmp_path / "free", max_steps=2), train_dataset=token_cls_data()
    )
    trainer.train()
    assert trainer.preempted is None and trainer.state.global_step == 2


def test_works_on_a_plain_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    from nlp_tricks.runtime.preemption import install_preemption

    args = TrainingArguments(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        max_steps=6,
        per_device_train_batch_size=4,
        enable_jit_checkpoint=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=bert_token_cls(), args=args, train_dataset=token_cls_data(), callbacks=[SendSignal(step=2)]
    )
    callback = install_preemption(trainer)
    assert isinstance(callback, PreemptionCallback)
    with callback.signal_handlers():
        trainer.train()
    assert callback.stopped_by == "SIGTERM" and trainer.state.global_step == 2
    assert checkpoint_problem(tmp_path / "checkpoint-2") is None


# ---- Two processes (DDP on CPU, gloo) ------------------------------------------------------------------------------


@pytest.mark.skipif(
    Version(torch.__version__.split("+")[0]) < Version("2.7"),
    reason="torch 2.6 cannot load the RNG state a CPU DDP rank saved (storage tagged cpu:0), on any resume",
)
def test_ddp_signal_to_one_rank_stops_both_after_the_same_step_and_resume_is_exact(tmp_path):
    launch_ddp_script("preempt_ddp.py", tmp_path)
    reports = [json.loads((tmp_path / f"report_rank{r}.json").read_text()) for r in (0, 1)]
    for r, report in enumerate(reports):
        assert report["world_size"] == 2
        assert report["stopped_by"] == "SIGTERM", f"rank {r}"
        assert report["stopped_at"] == 7, f"rank {r}"
        assert report["max_raw_diff"] <= 1e-6 and report["max_ema_diff"] <= 1e-6, report
    assert reports[0]["checkpoints"] == ["checkpoint-7"]
    checkpoint = tmp_path / "run" / "checkpoint-7"
    assert checkpoint_problem(checkpoint, (TRICKS_STATE_NAME,)) is None
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= {p.name for p in checkpoint.iterdir()}


def test_exit_code_is_documented():
    assert f"`{PREEMPTED_EXIT_CODE}`" in (ROOT / "docs" / "checkpoints.md").read_text()


# ---- Recipes ---------------------------------------------------------------------------------------------------


def _ner_args(tiny_model, tmp_path, *extra):
    files = ner_files(tmp_path, validate=False)
    return tiny_args(tiny_model, tmp_path / "out", *files, "--max_steps", "4", "--save_strategy", "no", *extra)


def test_recipe_stopped_by_sigterm_exits_75_looking_unfinished_and_resume_finishes_it(
    tiny_model, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    original = TricksTrainer.__init__

    def with_signal(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.add_callback(SendSignal(step=2))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TricksTrainer, "__init__", with_signal)
        assert run_in_process("ner", _ner_args(tiny_model, tmp_path), monkeypatch) == PREEMPTED_EXIT_CODE
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stopped by")]
    assert lines == ["stopped by SIGTERM at step 2; rerun with --resume_from_checkpoint true"]
    written = {p.name for p in out.iterdir()}
    assert written == {"checkpoint-2"}, "no final model, state, results or predictions"
    assert checkpoint_problem(out / "checkpoint-2") is None

    resumed = _ner_args(tiny_model, tmp_path, "--resume_from_checkpoint", "true")
    assert run_in_process("ner", resumed, monkeypatch) == 0
    assert (out / "all_results.json").is_file() and (out / "test_predictions.txt").is_file()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4]


def test_recipe_max_time_spent_stops_after_the_first_step(tiny_model, tmp_path, monkeypatch, capsys):
    # The budget counts from the start of this (pytest) process: a millisecond is spent before training begins.
    args = _ner_args(tiny_model, tmp_path, "--max_time", "0.001s")
    assert run_in_process("ner", args, monkeypatch) == PREEMPTED_EXIT_CODE
    assert "stopped by --max_time at step 1; rerun with --resume_from_checkpoint true" in capsys.readouterr().err
    assert not (tmp_path / "out" / "all_results.json").exists()


def test_recipe_bad_max_time_is_one_parser_error(tiny_model, tmp_path, monkeypatch, capsys):
    assert run_in_process("ner", _ner_args(tiny_model, tmp_path, "--max_time", "8x"), monkeypatch) == 2
    err = capsys.readouterr().err
    assert "--max_time: '8x' is not a duration" in err and "Traceback" not in err


@pytest.mark.slow  # a recipe subprocess with two data-loader workers: ~35 s on 2 shared cores
def test_signal_to_the_whole_process_group_spares_the_data_loader_workers(tiny_model, tmp_path):
    """SLURM and terminals signal the process group: the workers must not die before the main process saves."""
    args = _ner_args(tiny_model, tmp_path, "--max_steps", "100000", "--dataloader_num_workers", "2")
    cmd = [sys.executable, str(ROOT / "recipes" / "ner.py"), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=recipe_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = []
    for line in proc.stdout:  # training has begun (and the workers run) once a step's loss is logged
        output.append(line)
        if "'loss'" in line:
            os.killpg(proc.pid, signal.SIGTERM)
            break
    output += proc.stdout.readlines()
    assert proc.wait(timeout=300) == PREEMPTED_EXIT_CODE, "".join(output)[-3000:]
    stop = [line for line in output if line.startswith("stopped by SIGTERM at step ")]
    assert len(stop) == 1, "".join(output)[-3000:]
    step = int(stop[0].split()[5].rstrip(";"))
    assert checkpoint_problem(tmp_path / "out" / f"checkpoint-{step}") is None


def test_self_training_stopped_exits_75_without_results(tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "raw.txt").write_text("john works at acme\nmary ran in paris\n")
    args = _ner_args(tiny_model, tmp_path, "--task", "ner", "--unlabeled_file", str(tmp_path / "raw.txt"))
    args += ["--max_time", "0.001s"]
    assert run_in_process("self_training", args, monkeypatch) == PREEMPTED_EXIT_CODE
    err = capsys.readouterr().err
    assert "stopped by --max_time at step 1; self-training does not resume: rerun it" in err
    assert not (tmp_path / "out" / "self_training_results.json").exists()
