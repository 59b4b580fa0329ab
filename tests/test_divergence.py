"""The divergence guard: a non-finite loss, gradient norm or weight stops training at that step with one line and
nothing that looks finished; up to N such steps can be skipped instead; a step the fp16 grad scaler skips is not
divergence; metrics files stay valid JSON."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from nlp_tricks import Trick, TricksArguments, TricksTrainer
from nlp_tricks.runtime.divergence import (
    DIVERGED_EXIT_CODE,
    NONFINITE_SKIPPED,
    TrainingDivergedError,
    nonfinite_parameters,
)
from nlp_tricks.runtime.resume import checkpoint_problem, get_last_complete_checkpoint
from recipe_helpers import CLS_ROWS, ner_files, run_in_process, tiny_args, write_csv
from tiny import bert_seq_cls, seq_cls_data, tricks_args

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def _finite(path: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(path).values())


class LossTimes(Trick):
    """Multiplies the loss by ``factor`` at the given optimizer steps (1-based): NaN makes every gradient NaN, inf
    makes them inf / NaN as an fp16 overflow does, 0 makes them zero."""

    def __init__(self, steps, factor):
        self.steps, self.factor = set(steps), factor

    def adjust_loss(self, trainer, inputs, outputs, loss):
        return loss * self.factor if trainer.state.global_step + 1 in self.steps else loss


def _upstream_run(tmp_path, **overrides) -> Trainer:
    """Plain transformers.Trainer on the same model, data and settings (no guard)."""
    kwargs = dict(tricks_args(tmp_path, **overrides).to_dict())
    fields = set(TrainingArguments.__dataclass_fields__)
    args = TrainingArguments(**{k: v for k, v in kwargs.items() if k in fields and not k.startswith("_")})
    trainer = Trainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data())
    trainer.train()
    return trainer


# ---- Stop ------------------------------------------------------------------------------------------------------


def test_nan_run_stops_at_the_first_nan_step_keeping_the_last_good_checkpoint(tmp_path):
    settings = dict(learning_rate=1e30, max_steps=STEPS, save_strategy="steps", save_steps=1)
    reference = _upstream_run(tmp_path / "upstream", **settings)
    logged = [e for e in reference.state.log_history if "grad_norm" in e]
    first_nan = next(e["step"] for e in logged if not math.isfinite(e["grad_norm"]))
    assert first_nan < STEPS
    # Upstream trains on: every later checkpoint holds NaN weights and looks complete.
    late = tmp_path / "upstream" / f"checkpoint-{STEPS}"
    assert checkpoint_problem(late) is None and not _finite(late / "model.safetensors")

    out = tmp_path / "guarded"
    trainer = TricksTrainer(model=bert_seq_cls(), args=tricks_args(out, **settings), train_dataset=seq_cls_data())
    with pytest.raises(TrainingDivergedError) as info:
        trainer.train()
    message = str(info.value)
    assert info.value.step == first_nan
    assert "\n" not in message
    assert message.startswith(f"training diverged at step {first_nan}: the loss is nan")
    assert "--learning_rate (now 1e+30)" in message and "--max_grad_norm" in message
    # Nothing of the NaN step: the checkpoints before it, each finite; resume picks the last of them.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in range(1, first_nan)]
    last_good = out / f"checkpoint-{first_nan - 1}"
    assert get_last_complete_checkpoint(out) == str(last_good)
    assert _finite(last_good / "model.safetensors")
    # The NaN step's gradients were dropped: the weights are those upstream had after the step before it.
    want = load_file(tmp_path / "upstream" / f"checkpoint-{first_nan - 1}" / "model.safetensors")
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)


def _overflowing_run(out, **overrides) -> TricksTrainer:
    """One SGD step at lr 3e38 from a finite loss (scaled by 1000, so some gradients exceed 1) makes some weights
    infinite."""
    settings = dict(optim="sgd", learning_rate=3e38, max_grad_norm=0.0, max_steps=2)
    settings.update(overrides)
    args = tricks_args(out, **settings)
    return TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(), tricks=[LossTimes({1}, 1e3)])


def test_finite_loss_that_overflows_the_weights_is_never_saved(tmp_path):
    unguarded = _overflowing_run(tmp_path / "off", save_strategy="steps", save_steps=1, stop_on_nonfinite=False)
    unguarded.train()
    assert math.isfinite(unguarded.state.log_history[0]["loss"])
    assert not _finite(tmp_path / "off" / "checkpoint-1" / "model.safetensors")

    out = tmp_path / "guarded"
    trainer = _overflowing_run(out, save_strategy="steps", save_steps=1)
    with pytest.raises(TrainingDivergedError, match=r"^training diverged at step 1: the weights are not finite"):
        trainer.train()
    assert not list(out.glob("checkpoint-*"))


def test_weights_are_checked_at_the_end_of_training(tmp_path):
    """No save during training: the last step's infinite weights still make the run diverged (no final model)."""
    trainer = _overflowing_run(tmp_path, max_steps=1)
    with pytest.raises(TrainingDivergedError, match="the weights are not finite at the end of training"):
        trainer.train()


def test_off_trains_on_as_upstream(tmp_path):
    args = tricks_args(tmp_path, learning_rate=1e30, max_steps=STEPS, stop_on_nonfinite=False)
    trainer = TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data())
    trainer.train()
    assert trainer.state.global_step == STEPS and nonfinite_parameters(trainer.model)


def test_nonfinite_parameters_names_them():
    model = bert_seq_cls()
    assert nonfinite_parameters(model) == []
    with torch.no_grad():
        model.classifier.bias[1] = float("nan")
        model.bert.pooler.dense.weight[0, 0] = float("-inf")
    assert nonfinite_parameters(model) == ["bert.pooler.dense.weight", "classifier.bias"]


# ---- Skip ------------------------------------------------------------------------------------------------------


def _skipping_run(tmp_path, factor, steps, **overrides):
    settings = dict(
        optim="sgd", learning_rate=0.5, max_grad_norm=0.0, max_steps=5, train_sampling_strategy="sequential"
    )
    settings.update(overrides)
    trainer = TricksTrainer(
        model=bert_seq_cls(),
        args=tricks_args(tmp_path, **settings),
        train_dataset=seq_cls_data(n=20),
        tricks=[LossTimes(steps, factor)],
    )
    trainer.train()
    return trainer


def test_skipped_steps_leave_the_weights_as_a_zero_gradient_sgd_step_does(tmp_path):
    """Plain SGD (no momentum, no decay) leaves a weight exactly as it is for a zero gradient: a run whose steps 2
    and 4 have NaN losses, skipped, must end where the run with zero losses at those steps ends."""
    skipped = _skipping_run(tmp_path / "nan", float("nan"), {2, 4}, max_nonfinite_steps=2)
    zeroed = _skipping_run(tmp_path / "zero", 0.0, {2, 4})
    want = zeroed.model.state_dict()
    for name, value in skipped.model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    logged = [e[NONFINITE_SKIPPED] for e in skipped.state.log_history if "loss" in e]
    assert logged == [0, 1, 1, 2, 2]


def test_skipped_steps_take_no_optimizer_step(tmp_path):
    """AdamW counts the steps it applies (its `step` state): 5 steps with 2 skipped apply 3."""
    trainer = _skipping_run(tmp_path, float("nan"), {1, 3}, optim="adamw_torch", max_nonfinite_steps=2)
    counts = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert counts == {3}
    assert not nonfinite_parameters(trainer.model)


def test_one_more_nonfinite_step_than_allowed_stops(tmp_path):
    with pytest.raises(TrainingDivergedError, match=r"^training diverged at step 4: the loss is nan"):
        _skipping_run(tmp_path, float("nan"), {1, 2, 4}, max_nonfinite_steps=2)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(max_nonfinite_steps=-1), r"^max_nonfinite_steps=-1 is not allowed; it must be >= 0"),
        (dict(max_nonfinite_steps=2, stop_on_nonfinite=False), r"^max_nonfinite_steps=2 needs stop_on_nonfinite"),
    ],
)
def test_bad_settings_name_the_field(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        TricksArguments(output_dir=str(tmp_path), **settings)


# ---- fp16 ------------------------------------------------------------------------------------------------------


def test_a_step_the_grad_scaler_skips_is_not_divergence(tmp_path):
    """An inf loss at step 2 (an fp16 overflow): the scaler skips that step and halves its scale; training goes on."""
    args = tricks_args(tmp_path, optim="sgd", learning_rate=0.5, max_steps=STEPS)
    trainer = TricksTrainer(
        model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(), tricks=[LossTimes({2}, float("inf"))]
    )
    # Accelerate builds its fp16 scaler on CUDA only: the same code path on the CPU.
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    trainer.train()
    assert trainer.state.global_step == STEPS
    assert trainer.accelerator.scaler.get_scale() == 2.0**11  # torch's backoff_factor 0.5, once
    assert not nonfinite_parameters(trainer.model)


# ---- Recipes ---------------------------------------------------------------------------------------------------


def _recipe_data(recipe: str, tmp_path) -> list[str]:
    if recipe == "ner":
        return ner_files(tmp_path)
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    write_csv(tmp_path / "test.csv", CLS_ROWS[:3])
    test = str(tmp_path / "test.csv")
    return ["--train_file", str(tmp_path / "train.csv"), "--validation_file", test, "--test_file", test]


@pytest.mark.parametrize(
    "recipe, extra", [("ner", ()), ("ner", ("--crf", "true")), ("classification", ())], ids=["ner", "crf", "cls"]
)
def test_recipe_nan_run_exits_3_with_one_line_and_nothing_that_looks_finished(
    tiny_model, tmp_path, monkeypatch, capsys, recipe, extra
):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, *_recipe_data(recipe, tmp_path), "--max_steps", "4", "--save_steps", "1", *extra)
    args[args.index("--learning_rate") + 1] = "1e30"
    assert run_in_process(recipe, args, monkeypatch) == DIVERGED_EXIT_CODE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "diverged" in line]
    assert len(lines) == 1, err[-3000:]
    match = re.match(r"training diverged at step (\d+): the (loss|weights) ", lines[0])
    assert match, lines[0]
    step = int(match.group(1))
    kept = {f"checkpoint-{s}" for s in range(1, step)}
    assert {p.name for p in out.iterdir()} == kept, "no model, results, predictions or non-finite checkpoint"
    if kept:
        assert get_last_complete_checkpoint(out) == str(out / f"checkpoint-{step - 1}")
    assert all(_finite(out / name / "model.safetensors") for name in kept)


def test_exit_code_is_documented():
    docs = (ROOT / "docs" / "checkpoints.md").read_text() + (ROOT / "docs" / "recipes.md").read_text()
    assert f"`{DIVERGED_EXIT_CODE}`" in docs


def test_results_json_has_no_bare_nan(tmp_path):
    from common import write_json_atomic

    def refuse(constant):
        raise ValueError(f"bare {constant} in the file")

    write_json_atomic(tmp_path / "r.json", {"eval_loss": float("nan"), "x": [1.0, float("inf")], "ok": 0.5})
    data = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert data == {"eval_loss": None, "x": [1.0, None], "ok": 0.5}
