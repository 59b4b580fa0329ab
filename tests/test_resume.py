"""Crash-safe resume: kill -9 then resume equals an uninterrupted run; trick_state survives checkpoints; resume picks
the newest complete checkpoint; gradients never leak into the next step."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from nlp_tricks import TricksTrainer
from nlp_tricks.runtime.state import TRAINER_ENTRY, TRICKS_STATE_NAME, load_trick_states
from resume_helpers import killed_in_child, truncate
from scripts import resume_run
from tiny import bert_seq_cls, seq_cls_data, tricks_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "resume_run.py"


# One case per trick setting; extend the list as tricks arrive (adversarial, scheduled sampling). Each case names
# how the newest checkpoint is torn after the kill, and the reason the resume must report for it.
CRASH_CASES = {
    "focal_layer_decay": (
        {"loss_type": "focal", "focal_gamma": 2.0, "layer_decay": 0.8, "head_lr_scale": 5.0, "warmup_ratio": 0.25},
        lambda ckpt: truncate(ckpt / "optimizer.pt"),
        "optimizer.pt is truncated",
    ),
    "label_smoothing_accumulation": (
        {
            "loss_type": "label_smoothing",
            "label_smoothing_factor": 0.1,
            "gradient_accumulation_steps": 2,
            "per_device_train_batch_size": 2,
        },
        lambda ckpt: truncate(ckpt / "model.safetensors"),
        "model.safetensors is truncated",
    ),
    "pgd_focal": (
        {"adversarial": "pgd", "adv_steps": 2, "loss_type": "focal"},
        lambda ckpt: truncate(ckpt / "optimizer.pt"),
        "optimizer.pt is truncated",
    ),
    "scheduled_sampling_fgm": (
        {"scheduled_sampling": "linear", "ss_k": 16, "ss_mode": "sample", "adversarial": "fgm"},
        lambda ckpt: truncate(ckpt / "model.safetensors"),
        "model.safetensors is truncated",
    ),
    "ce_no_trainer_state": (
        {"lr_scheduler_type": "cosine"},
        lambda ckpt: (ckpt / "trainer_state.json").unlink(),
        "trainer_state.json is missing",
    ),
}


def _assert_same_result(reference: Path, resumed: Path, config: dict) -> None:
    want, got = load_file(reference / "final.safetensors"), load_file(resumed / "final.safetensors")
    model = resume_run.make_model(config)
    initial, parameters = model.state_dict(), {n for n, _ in model.named_parameters()}
    assert set(got) == set(want)
    for name in want:
        if name in parameters:  # buffers (BART's final_logits_bias) do not train
            assert not torch.equal(want[name], initial[name]), f"{name} did not train"
        # Same kernels in the same order on one thread: any difference is float32 round-off at most.
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    trick_state = json.loads((resumed / "final_trick_state.json").read_text())
    assert trick_state == json.loads((reference / "final_trick_state.json").read_text())
    # One loss call per forward pass (adversarial: 2 for FGM, K + 1 for PGD): the counter covers the killed part and
    # the resumed part.
    passes = {"none": 1, "fgm": 2, "pgd": config.get("adv_steps", 3) + 1}[config.get("adversarial", "none")]
    assert trick_state["loss_calls"] == resume_run.MAX_STEPS * config.get("gradient_accumulation_steps", 1) * passes


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("case", list(CRASH_CASES))
def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, one_thread, caplog, case):
    config, tear, reason = CRASH_CASES[case]
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    resume_run.run(reference, config)

    status = killed_in_child(lambda: resume_run.run(crashed, config, kill_after_save=6))
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"wait status {status}"
    assert not (crashed / "final.safetensors").exists()
    assert sorted(p.name for p in crashed.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    tear(crashed / "checkpoint-6")  # the newest checkpoint, as a crash in the middle of its save leaves it
    with caplog.at_level(logging.WARNING, logger="nlp_tricks.runtime.resume"):
        resume_run.run(crashed, config, resume=True)
    assert f"Skipping incomplete checkpoint {crashed / 'checkpoint-6'}: {reason}" in caplog.text
    _assert_same_result(reference, crashed, config)


def _run_script(*args, wait=True):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, str(SCRIPT), *map(str, args)]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_kill_9_from_outside_at_any_moment_then_resume_in_a_new_interpreter(tmp_path, one_thread):
    """A separate interpreter killed from outside wherever it is (maybe mid-save), resumed by another interpreter."""
    config, max_steps = {"loss_type": "focal", "layer_decay": 0.8}, 40
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    resume_run.run(reference, config, max_steps=max_steps)
    process = _run_script("--out", crashed, "--config", json.dumps(config), "--max_steps", max_steps, wait=False)
    deadline = time.monotonic() + 300
    while not (crashed / "checkpoint-4" / "trainer_state.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    resumed = _run_script("--out", crashed, "--config", json.dumps(config), "--resume", "--max_steps", max_steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = load_file(reference / "final.safetensors"), load_file(crashed / "final.safetensors")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    assert json.loads((crashed / "final_trick_state.json").read_text()) == json.loads(
        (reference / "final_trick_state.json").read_text()
    )


# ---- trick_state in checkpoints --------------------------------------------------------------------------------


class CountingTrainer(TricksTrainer):
    def compute_tricks_loss(self, logits, labels, num_items_in_batch=None):
        self.trick_state["loss_calls"] = self.trick_state.get("loss_calls", 0) + 1
        return super().compute_tricks_loss(logits, labels, num_items_in_batch=num_items_in_batch)


def _counting_trainer(out, **overrides):
    args = tricks_args(out, max_steps=4, save_strategy="steps", save_steps=2, **overrides)
    return CountingTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=8))


@pytest.mark.parametrize("restore_flag", [False, True])
def test_trick_state_is_saved_with_each_checkpoint_and_restored_on_resume(tmp_path, restore_flag):
    _counting_trainer(tmp_path, restore_callback_states_from_checkpoint=restore_flag).train()
    for step in (2, 4):
        saved = load_trick_states(str(tmp_path / f"checkpoint-{step}" / TRICKS_STATE_NAME))
        assert saved[TRAINER_ENTRY]["trick_state"] == {"loss_calls": step}
    # Resume from step 2 of 4: the counter continues from 2 (a fresh counter would end at 2, not 4).
    trainer = _counting_trainer(tmp_path, restore_callback_states_from_checkpoint=restore_flag)
    trainer.trick_state["stale"] = 99  # replaced by the checkpoint's state
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.trick_state == {"loss_calls": 4}
    saved = load_trick_states(str(tmp_path / "checkpoint-4" / TRICKS_STATE_NAME))
    assert saved[TRAINER_ENTRY]["trick_state"] == {"loss_calls": 4}


def test_resume_true_picks_the_newest_complete_checkpoint_and_a_named_torn_one_raises(tmp_path, caplog):
    _counting_trainer(tmp_path).train()
    truncate(tmp_path / "checkpoint-4" / "optimizer.pt")
    trainer = _counting_trainer(tmp_path)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.trick_state == {"loss_calls": 4}  # resumed at 2 (restored 2) and ran 2 more steps
    assert checkpoint_ok(tmp_path / "checkpoint-4")  # and the resumed run wrote checkpoint-4 anew

    truncate(tmp_path / "checkpoint-4" / "model.safetensors")
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=.*checkpoint-4' is incomplete: model.safetensors"):
        _counting_trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    with pytest.raises(ValueError, match="No complete checkpoint found in output directory"):
        _counting_trainer(tmp_path / "empty").train(resume_from_checkpoint=True)


def checkpoint_ok(folder):
    from nlp_tricks.runtime.resume import checkpoint_problem

    return checkpoint_problem(folder) is None


# ---- Gradient hygiene ------------------------------------------------------------------------------------------

EXCLUDED, FROZEN_LATER = "bert.pooler.dense.weight", "classifier.weight"


class SubsetTrainer(TricksTrainer):
    """An optimizer that does not own one trainable parameter (e.g. a part trained by another optimizer)."""

    def build_optimizer_groups(self, model):
        excluded = model.get_parameter(EXCLUDED)
        groups = super().build_optimizer_groups(model)
        for group in groups:
            group["params"] = [p for p in group["params"] if p is not excluded]
        return groups


class GradientProbe(TrainerCallback):
    """Before each optimizer step: the excluded parameter holds a gradient; after it: every gradient is cleared."""

    def __init__(self, model):
        self.model = model
        self.before, self.leaks = [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grad = self.model.get_parameter(EXCLUDED).grad
        self.before.append(grad is not None and bool(grad.abs().sum() > 0))

    def on_step_end(self, args, state, control, **kwargs):
        for name, p in self.model.named_parameters():
            if p.grad is not None and bool(p.grad.abs().sum() > 0):
                self.leaks.append((state.global_step, name))
        if state.global_step == 2:
            self.model.get_parameter(FROZEN_LATER).requires_grad_(False)


def test_no_gradient_survives_a_step_with_parameter_subsets_and_late_freezing(tmp_path):
    """Upstream's loop calls ``model.zero_grad()`` (all of the model's parameters) after every optimizer step, not
    ``optimizer.zero_grad()`` (only the ones it owns); this documents that TricksTrainer keeps that guarantee."""
    model = bert_seq_cls()
    probe = GradientProbe(model)
    excluded_before = model.get_parameter(EXCLUDED).detach().clone()
    args = tricks_args(tmp_path, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = SubsetTrainer(model=model, args=args, train_dataset=seq_cls_data(n=16), callbacks=[probe])
    frozen_at_2 = {}
    trainer.add_callback(_Snapshot(model, FROZEN_LATER, 2, frozen_at_2))
    trainer.train()
    owned = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(model.get_parameter(EXCLUDED)) not in owned
    assert probe.before == [True] * 4  # without the clearing, this gradient would pile up step after step
    assert probe.leaks == []
    assert torch.equal(model.get_parameter(EXCLUDED), excluded_before)  # not the optimizer's: never updated
    assert torch.equal(model.get_parameter(FROZEN_LATER), frozen_at_2["value"])  # frozen: no update after step 2


class _Snapshot(TrainerCallback):
    def __init__(self, model, name, step, into):
        self.model, self.name, self.step, self.into = model, name, step, into

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.into["value"] = self.model.get_parameter(self.name).detach().clone()


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(layer_decay=0.8), "layer_decay 1.0 -> 0.8"),  # more groups: torch's "different number of groups"
        (dict(head_lr_scale=5.0), "head_lr_scale 10.0 -> 5.0"),  # same groups, other lr: silently the checkpoint's
        (dict(crf=True), "crf=True (new)"),
    ],
)
def test_resume_with_other_group_settings_names_them(tmp_path, change, named):
    from tiny import bert_token_cls, token_cls_data, tricks_args

    settings = dict(max_steps=2, save_strategy="steps", save_steps=2, head_lr_scale=10.0)
    TricksTrainer(
        model=bert_token_cls(), args=tricks_args(tmp_path, **settings), train_dataset=token_cls_data()
    ).train()
    trainer = TricksTrainer(
        model=bert_token_cls(), args=tricks_args(tmp_path, **{**settings, "max_steps": 3, **change}),
        train_dataset=token_cls_data(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="parameter groups differ from the checkpoint's") as error:
        trainer.train(resume_from_checkpoint=True)
    assert named in str(error.value)
    # The same settings resume.
    same = TricksTrainer(
        model=bert_token_cls(),
        args=tricks_args(tmp_path, **{**settings, "max_steps": 3}),
        train_dataset=token_cls_data(),
    )
    same.train(resume_from_checkpoint=True)
    assert same.state.global_step == 3
