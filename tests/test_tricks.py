"""The Trick protocol: a user's trick without subclassing, against written-out losses; its state across resume; a
checkpoint written before tricks became objects resumes to the same weights."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from nlp_tricks import Trick, TricksArguments, TricksTrainer
from nlp_tricks.runtime.state import TRICKS_STATE_NAME, load_trick_states, save_trick_states
from nlp_tricks.tricks import BUILT_IN_TRICKS, built_in_tricks
from tiny import bert_seq_cls, bert_token_cls, ema_of, seq_cls_data, token_cls_data, tricks_args

V0 = Path(__file__).parent / "data" / "checkpoint_v0"


class LogitPenalty(Trick):
    """The contract's example: a penalty on the logits, counting its calls."""

    def __init__(self, weight=0.1):
        self.weight = weight
        self.calls = 0

    def adjust_loss(self, trainer, inputs, outputs, loss):
        self.calls += 1
        return loss + self.weight * outputs.logits.pow(2).mean()


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_trick_is_public_and_a_callback():
    from transformers import TrainerCallback

    import nlp_tricks

    assert "Trick" in nlp_tricks.__all__ and issubclass(Trick, TrainerCallback)


def test_adjust_loss_equals_the_written_out_loss(tmp_path):
    model = bert_seq_cls()
    batch = {
        k: torch.stack([seq_cls_data()[i][k] for i in range(4)]) for k in ("input_ids", "attention_mask", "labels")
    }
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path), tricks=[LogitPenalty(0.1)])
    model.train()
    loss = trainer.compute_loss(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = F.cross_entropy(logits, batch["labels"]) + 0.1 * logits.pow(2).mean()  # written out
    torch.testing.assert_close(loss, want)
    # Evaluation computes no penalty (no backward follows it).
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(model, batch), F.cross_entropy(logits, batch["labels"]))


class WrittenOut(Trainer):
    """Upstream Trainer with the penalised loss written out (one micro-batch per step, so a mean is exact)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        return F.cross_entropy(logits, labels) + 0.1 * logits.pow(2).mean()


def test_a_users_trick_trains_like_the_written_out_loss_on_upstream_trainer(tmp_path):
    data = seq_cls_data(n=12)
    base = bert_seq_cls()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    settings = dict(
        output_dir=str(tmp_path / "ref"), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=4, max_steps=3, learning_rate=0.1, optim="sgd", seed=0,
    )  # fmt: skip
    WrittenOut(model=ref, args=TrainingArguments(**settings), train_dataset=data).train()
    penalty = LogitPenalty(0.1)
    settings["output_dir"] = str(tmp_path / "tricks")
    TricksTrainer(model=model, args=TricksArguments(**settings), train_dataset=data, tricks=[penalty]).train()
    assert penalty.calls == 3  # once per plain step
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_adjust_loss_is_exact_under_gradient_accumulation(tmp_path):
    """Batch 4 in one micro-batch equals 2 x 2 accumulated: the term is weighed by each micro-batch's share."""
    data = seq_cls_data(n=12)
    base = bert_seq_cls()
    runs = {}
    for bs, ga in ((4, 1), (2, 2)):
        model = copy.deepcopy(base)
        args = tricks_args(
            tmp_path / f"{bs}x{ga}", per_device_train_batch_size=bs, gradient_accumulation_steps=ga, optim="sgd",
            learning_rate=0.1,
        )  # fmt: skip
        TricksTrainer(model=model, args=args, train_dataset=data, tricks=[LogitPenalty(0.5)]).train()
        runs[(bs, ga)] = _params(model)
    for name, p in runs[(4, 1)].items():
        torch.testing.assert_close(runs[(2, 2)][name], p, msg=name)  # float32 sums in another order


def test_a_trick_that_returns_the_loss_leaves_training_bitwise_plain(tmp_path):
    class Identity(Trick):
        def adjust_loss(self, trainer, inputs, outputs, loss):
            return loss

    data = token_cls_data(n=8)
    base = bert_token_cls()
    runs = []
    for tricks in ((), (Identity(),)):
        model = copy.deepcopy(base)
        args = tricks_args(tmp_path / str(len(tricks)), per_device_train_batch_size=2, gradient_accumulation_steps=2)
        TricksTrainer(model=model, args=args, train_dataset=data, tricks=list(tricks)).train()
        runs.append(_params(model))
    for name, p in runs[0].items():
        assert torch.equal(runs[1][name], p), name


class StepCounter(Trick):
    """A trick with state: counts optimizer steps (a number, a tensor and a nested list) and logs it."""

    def __init__(self):
        self.steps = 0
        self.total = torch.zeros(2)
        self.history: list[int] = []

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.steps += 1
        self.total += 1
        self.history.append(state.global_step)

    def state_dict(self):
        return {"steps": self.steps, "total": self.total.clone(), "nested": {"history": list(self.history)}}

    def load_state_dict(self, state):
        self.steps = state["steps"]
        self.total = state["total"].clone()
        self.history = list(state["nested"]["history"])


def test_a_users_trick_state_survives_resume(tmp_path):
    data = seq_cls_data(n=16)
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=2)
    first = StepCounter()
    TricksTrainer(
        model=bert_seq_cls(), args=tricks_args(tmp_path, **settings), train_dataset=data, tricks=[first]
    ).train()
    saved = load_trick_states(str(tmp_path / "checkpoint-2" / TRICKS_STATE_NAME))["StepCounter"]
    assert saved["steps"] == 2 and torch.equal(saved["total"], torch.full((2,), 2.0))
    resumed = StepCounter()
    trainer = TricksTrainer(
        model=bert_seq_cls(), args=tricks_args(tmp_path, **settings), train_dataset=data, tricks=[resumed]
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.steps == first.steps == 4
    assert torch.equal(resumed.total, first.total) and resumed.history == first.history == [0, 1, 2, 3]
    # A checkpoint without the trick's state cannot resume it: named at once, not after training from scratch.
    (tmp_path / "checkpoint-2" / TRICKS_STATE_NAME).unlink()
    with pytest.raises(ValueError, match=f"{TRICKS_STATE_NAME} is missing"):
        TricksTrainer(
            model=bert_seq_cls(), args=tricks_args(tmp_path, **settings), train_dataset=data, tricks=[StepCounter()]
        ).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_trick_states_file_round_trips_and_refuses_what_it_cannot_write(tmp_path):
    states = {"a": {"x": torch.arange(3), "n": 1.5, "s": "text", "none": None, "l": [1, torch.ones(2)]}}
    path = str(tmp_path / "s.safetensors")
    save_trick_states(path, states)
    back = load_trick_states(path)["a"]
    assert back["n"] == 1.5 and back["s"] == "text" and back["none"] is None and back["l"][0] == 1
    assert torch.equal(back["x"], torch.arange(3)) and torch.equal(back["l"][1], torch.ones(2))
    with pytest.raises(TypeError, match="holds a set"):
        save_trick_states(path, {"a": {"bad": {1, 2}}})


@pytest.mark.skipif(
    transformers.__version__ != json.loads((V0 / "checkpoint-2" / "config.json").read_text())["transformers_version"],
    reason="the fixture's weights are those of the transformers version that wrote it (its Trainer's data order and "
    "RNG handling differ between releases)",
)
def test_a_checkpoint_written_before_tricks_became_objects_resumes_to_the_same_weights(tmp_path, one_thread):
    """tests/data/checkpoint_v0: checkpoint-2 and the final weights (step 4) of a run with dropout, EMA, FGM, R-Drop
    and accumulation 2, written by the code before the Trick protocol; resuming it now gives the same weights."""
    shutil.copytree(V0 / "checkpoint-2", tmp_path / "checkpoint-2")
    settings = dict(
        max_steps=4, save_strategy="steps", save_steps=2, optim="sgd", learning_rate=0.1,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, ema_decay=0.9, adversarial="fgm",
        rdrop_alpha=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = bert_token_cls(hidden_dropout_prob=0.1)
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, **settings), train_dataset=token_cls_data(n=16))
    trainer.train(resume_from_checkpoint=True)
    raw, ema = load_file(V0 / "final_raw.safetensors"), load_file(V0 / "final_ema.safetensors")
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, raw[name], msg=name)
    for i, p in enumerate(ema_of(trainer).shadow):
        torch.testing.assert_close(p, ema[str(i)])


class FirstStepProbe(Trick):
    """Copies the EMA and the trick counters as the first step begins (after the restore at on_train_begin)."""

    def setup(self, trainer):
        self.trainer, self.seen = trainer, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.seen is None:
            ema = ema_of(self.trainer)
            self.seen = (ema.num_updates, [t.clone() for t in ema.shadow], dict(self.trainer.trick_state))


def test_a_checkpoint_written_before_the_state_store_restores_the_ema_and_the_counters(tmp_path):
    """The same fixture, resumed on any transformers version: as the first step begins, the EMA is the one of its old
    file (ema_state.safetensors), restored into the average built at on_train_begin, and the attack's counter is
    trainer_state.json's."""
    from safetensors import safe_open

    shutil.copytree(V0 / "checkpoint-2", tmp_path / "checkpoint-2")
    settings = dict(
        max_steps=3, save_strategy="no", optim="sgd", learning_rate=0.1, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, ema_decay=0.9, adversarial="fgm", rdrop_alpha=0.5,
    )  # fmt: skip
    model, probe = bert_token_cls(hidden_dropout_prob=0.1), FirstStepProbe()
    args = tricks_args(tmp_path, **settings)
    trainer = TricksTrainer(model=model, args=args, train_dataset=token_cls_data(n=16), tricks=[probe])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    with safe_open(V0 / "checkpoint-2" / "ema_state.safetensors", framework="pt") as f:
        saved, updates = {name: f.get_tensor(name) for name in f.keys()}, int(f.metadata()["num_updates"])
    num_updates, shadow, counters = probe.seen
    names = ema_of(trainer).names
    assert num_updates == updates == 2 and sorted(names) == sorted(saved)
    for name, tensor in zip(names, shadow):
        assert torch.equal(tensor, saved[name]), name
    assert counters["adv_skipped"] == 0 and "adv_skipped" not in trainer._own_state


def test_built_in_tricks_follow_the_arguments(tmp_path):
    args = tricks_args(tmp_path, crf=True, ema_decay=0.9, adversarial="pgd")
    names = [type(t).__name__ for t in built_in_tricks(args)]
    assert names == ["CRFTrick", "DistillationTrick", "LossTypeTrick", "AdversarialTrick", "EMATrick"]
    assert [type(t).__name__ for t in built_in_tricks(tricks_args(tmp_path))] == ["DistillationTrick", "LossTypeTrick"]
    # User tricks come before the configured loss (by default), so a user's compute_loss answers first.
    user = LogitPenalty()
    assert built_in_tricks(args, user_tricks=[user])[2] is user
    assert len(BUILT_IN_TRICKS) == len({cls.__name__ for cls in BUILT_IN_TRICKS})


def test_a_users_compute_loss_replaces_the_configured_one(tmp_path):
    class MSE(Trick):
        def compute_loss(self, trainer, logits, labels, num_items_in_batch=None):
            target = F.one_hot(labels, logits.shape[-1]).float()
            return F.mse_loss(logits, target)

    model = bert_seq_cls()
    batch = {
        k: torch.stack([seq_cls_data()[i][k] for i in range(4)]) for k in ("input_ids", "attention_mask", "labels")
    }
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path), tricks=[MSE()])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(
        trainer.compute_loss(model, batch), F.mse_loss(logits, F.one_hot(batch["labels"], 3).float())
    )


def test_tricks_must_be_trick_objects_and_one_takes_the_step(tmp_path):
    with pytest.raises(TypeError, match="takes nlp_tricks.Trick objects, got function"):
        TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path), tricks=[lambda: None])

    class MyStep(Trick):
        def training_step(self, trainer, model, inputs, num_items_in_batch=None):
            return None

    with pytest.raises(ValueError, match="each run the whole training step"):
        TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path, adversarial="fgm"), tricks=[MyStep()])


def test_the_docs_example_runs(tmp_path):
    """docs/tricks.md's "Writing your own trick" example, run as written on a tiny model."""
    text = (Path(__file__).parents[1] / "docs" / "tricks.md").read_text(encoding="utf-8")
    marker = "<!-- the test extracts the next python block and runs it on a tiny model -->"
    code = text.split(marker, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {
        "model": bert_seq_cls(),
        "args": tricks_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2),
        "train_dataset": seq_cls_data(n=16),
    }
    exec(compile(code, "docs/tricks.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 4
    assert [log["penalty_weight"] for log in trainer.state.log_history if "penalty_weight" in log] == [0.1] * 4
    state = load_trick_states(str(tmp_path / "checkpoint-2" / TRICKS_STATE_NAME))
    assert state["LogitPenalty"] == {"weight": 0.1, "steps": 2}


def test_pgd_with_reentrant_checkpointing_is_refused_when_the_trainer_is_built(tmp_path):
    kwargs = dict(
        adversarial="pgd", gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    with pytest.raises(ValueError, match="use_reentrant"):
        TricksTrainer(model=bert_token_cls(), args=tricks_args(tmp_path, **kwargs), train_dataset=token_cls_data())
    kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": False}  # torch's default: PGD trains
    trainer = TricksTrainer(
        model=bert_token_cls(), args=tricks_args(tmp_path, **kwargs), train_dataset=token_cls_data()
    )
    trainer.train()
    assert trainer.state.global_step == 3


def test_the_model_card_lists_the_tricks_and_the_saved_weights(tmp_path):
    args = tricks_args(tmp_path, ema_decay=0.9, adversarial="fgm", loss_type="focal")
    trainer = TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(), tricks=[LogitPenalty()])
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "nlp-tricks" in card and "## Tricks (nlp_tricks)" in card
    for setting in ("loss_type='focal'", "adversarial='fgm'", "ema_decay=0.9 (evaluated and saved)", "LogitPenalty"):
        assert f"- `{setting}`" in card, setting
    assert "The saved weights are the exponential moving average of the weights (ema_decay: 0.9" in card
    assert "updates: 3" in card


def _run_trial(tmp_path, monkeypatch, values: dict, **overrides):
    """One trial as hyperparameter_search runs it (upstream's _hp_search_setup sets the trial's values on args),
    with a stand-in for the search package's trial object."""
    from types import SimpleNamespace

    from transformers.trainer_utils import HPSearchBackend

    monkeypatch.setattr("transformers.integrations.hp_params", lambda trial: trial.params)
    trainer = TricksTrainer(
        model_init=lambda: bert_seq_cls(hidden_dropout_prob=0.1),
        args=tricks_args(tmp_path, **overrides),
        train_dataset=seq_cls_data(n=12),
    )
    trainer.hp_search_backend = HPSearchBackend.OPTUNA
    trainer.hp_space = lambda trial: dict(trial.params)
    trainer.train(trial=SimpleNamespace(number=0, params=values))
    return trainer


def test_a_hyperparameter_search_trial_applies_every_trick_field(tmp_path, monkeypatch):
    trial = {"ema_decay": 0.9, "warmup_ratio": 0.5, "class_weights": ["1", "2", "3"], "rdrop_alpha": 0.5}
    trainer = _run_trial(tmp_path, monkeypatch, trial, max_steps=4)
    assert trainer.args.ema_eval is True and ema_of(trainer) is not None and ema_of(trainer).num_updates == 4
    assert trainer.args.warmup_steps == 0.5  # warmup_ratio mapped as the constructor maps it
    assert trainer.lr_scheduler.get_last_lr()[0] < trainer.args.learning_rate
    names = [type(t).__name__ for t in trainer.tricks]
    assert names == ["RDropTrick", "DistillationTrick", "LossTypeTrick", "EMATrick"]
    torch.testing.assert_close(trainer.tricks[2].class_weights, torch.tensor([1.0, 2.0, 3.0]))
    assert any("loss_kl" in log for log in trainer.state.log_history)


@pytest.mark.parametrize("task", ["token", "sequence"])
def test_a_recorded_loss_term_is_on_the_scale_of_the_logged_loss(tmp_path, task):
    """A term equal to the loss itself, recorded as R-Drop and SMART record theirs: the log shows the Trainer's own
    `loss` under gradient accumulation, the items being tokens (token classification) or examples (sequences)."""

    class CopyOfTheLoss(Trick):
        def adjust_logits_loss(self, trainer, logits, batch, loss):
            trainer.record_loss_term("loss_copy", loss, batch.num_items)
            return loss

    model, data = (bert_token_cls(), token_cls_data(n=8)) if task == "token" else (bert_seq_cls(), seq_cls_data(n=8))
    args = tricks_args(tmp_path, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = TricksTrainer(model=model, args=args, train_dataset=data, tricks=[CopyOfTheLoss()])
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2
    for entry in logs:
        # The recorded metrics are logged rounded to 4 decimals.
        assert entry["loss_copy"] == pytest.approx(entry["loss"], abs=5.1e-5)


def test_a_hyperparameter_search_trial_is_validated(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        _run_trial(tmp_path, monkeypatch, {"loss_type": "label_smoothing"})  # its factor stays 0
