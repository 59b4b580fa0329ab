"""Weight averaging: EMA against the average written out by hand, swap-in exactness, resume after kill -9, 2-process
DDP, and checkpoint averaging against the mean of the state dicts (prefixed checkpoints too)."""

import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.cli import main as cli_main
from nlp_tricks.functional.crf import add_crf, load_crf_model
from nlp_tricks.runtime.averaging import (
    AVERAGING_INFO_NAME,
    EMA,
    EMA_STATE_NAME,
    average_checkpoints,
    average_into,
)
from nlp_tricks.runtime.checkpoint import CheckpointMismatchError
from nlp_tricks.runtime.state import TRICKS_STATE_NAME, load_trick_states
from recipe_helpers import launch_ddp_script, ner_files, rank_report, run_in_process, tiny_args
from scripts import resume_run
from tiny import (
    bert_config,
    bert_seq_cls,
    bert_token_cls,
    ema_of,
    needs_crf_loading,
    seq_cls_data,
    token_cls_data,
    tricks_args,
)

from ablation import CONFIGURATIONS

ROOT = Path(__file__).resolve().parents[1]


def hand_ema(initial: dict, trajectory: list[dict], decay: float, warmup: bool) -> dict:
    """The EMA written out: ema_0 = initial weights; ema = d_t * ema + (1 - d_t) * w_t, d_t from the formula."""
    ema = {n: v.double() for n, v in initial.items()}
    for t, weights in enumerate(trajectory):
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        ema = {n: d * ema[n] + (1 - d) * weights[n].double() for n in ema}
    return ema


def trainable(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_ema_close(shadow: dict, reference: dict) -> None:
    assert set(shadow) == set(reference)
    for name, value in reference.items():
        assert shadow[name].dtype == torch.float32
        # lerp (ema + w_frac * (w - ema)) in float32 against the product form in float64: float32 round-off per step.
        torch.testing.assert_close(shadow[name].double(), value, rtol=1e-6, atol=1e-7, msg=name)


# ---- The EMA class --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("warmup", [True, False])
def test_ema_after_sgd_steps_equals_the_hand_average(warmup):
    torch.manual_seed(0)
    model = BertForMaskedLM(bert_config())  # the decoder is tied to the word embeddings
    model.bert.embeddings.token_type_embeddings.weight.requires_grad_(False)  # frozen: not averaged
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    initial, buffers = trainable(model), {n: b.clone() for n, b in model.named_buffers()}
    # decay 0.3: the warm-up (1 + t) / (10 + t) gives 0.1, 0.18, 0.25, then the cap 0.3 from t = 3 on.
    ema = EMA(model, decay=0.3, warmup=warmup)
    trajectory = []
    batch = token_cls_data(n=4)
    inputs = {k: torch.stack([b[k] for b in batch.items]) for k in ("input_ids", "attention_mask", "labels")}
    for _ in range(6):
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        trajectory.append(trainable(model))
    assert ema.num_updates == 6
    assert "bert.embeddings.token_type_embeddings.weight" not in ema.names
    tied = {"bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"}
    assert len(tied & set(ema.names)) == 1  # one tensor, averaged once
    word = "bert.embeddings.word_embeddings.weight"
    assert not torch.equal(trajectory[-1][word], initial[word])
    assert_ema_close(ema.state_dict()["shadow"], hand_ema(initial, trajectory, 0.3, warmup))
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name


def test_ema_of_bfloat16_weights_is_float32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    initial = {n: p.detach().float() for n, p in model.named_parameters()}
    ema = EMA(model, decay=0.9, warmup=False)
    trajectory = []
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        trajectory.append({n: p.detach().float() for n, p in model.named_parameters()})
    assert all(s.dtype == torch.float32 for s in ema.shadow)
    assert_ema_close(ema.state_dict()["shadow"], hand_ema(initial, trajectory, 0.9, False))


def test_swap_in_and_out_restores_the_raw_weights_bitwise_even_on_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # raw weights whose float32 bits an arithmetic round trip would lose
    ema.update()
    raw = trainable(model)
    with pytest.raises(KeyError):
        with ema.swapped_in():
            for (name, p), s in zip(model.named_parameters(), ema.shadow):
                assert torch.equal(p, s), name
            with pytest.raises(RuntimeError, match="swapped in"):
                ema.update()
            raise KeyError("an evaluation that fails")
    for name, p in model.named_parameters():
        assert torch.equal(p, raw[name]), name


def test_ema_state_round_trip_and_strict_load(tmp_path):
    model = bert_seq_cls()
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    ema.save(tmp_path / EMA_STATE_NAME)
    fresh = EMA(bert_seq_cls(), decay=0.9)
    fresh.load(tmp_path / EMA_STATE_NAME)
    assert fresh.num_updates == 1
    for a, b in zip(ema.shadow, fresh.shadow):
        assert torch.equal(a, b)
    other = EMA(bert_seq_cls(num_labels=5), decay=0.9)
    with pytest.raises(CheckpointMismatchError, match=r"classifier.weight: saved \(3, 32\) vs model \(5, 32\)"):
        other.load(tmp_path / EMA_STATE_NAME)


def test_fsdp_and_zero3_are_refused_with_the_setting_named(tmp_path):
    """The EMA's capability flags (fsdp, zero3) as the trainer reads them when it is built: FSDP and DeepSpeed ZeRO-3
    refused, naming the setting; ZeRO-1/2 taken (parameters whole on every process)."""
    trainer = TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path, ema_decay=0.9))

    def engine(fsdp=False, stage=None):
        trainer.is_fsdp_enabled, trainer.is_deepspeed_enabled = fsdp, stage is not None
        plugin = SimpleNamespace(zero_stage=stage)
        trainer.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
        trainer._check_capabilities()

    with pytest.raises(ValueError, match=r"^ema_decay=0\.9 \(evaluated and saved\) is not supported with FSDP: it"):
        engine(fsdp=True)
    with pytest.raises(ValueError, match=r"is not supported with DeepSpeed ZeRO stage 3: it shards the parameters"):
        engine(stage=3)
    engine(stage=2)
    engine()


# ---- Arguments ------------------------------------------------------------------------------------------------------


def test_arguments_defaults_parsing_and_validation(tmp_path):
    assert tricks_args(tmp_path).ema_eval is False
    assert tricks_args(tmp_path, ema_decay=0.99).ema_eval is True
    (parsed,) = HfArgumentParser(TricksArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--ema_decay", "0.99", "--ema_eval", "false", "--ema_warmup", "false"]
    )
    assert (parsed.ema_decay, parsed.ema_eval, parsed.ema_warmup) == (0.99, False, False)
    bad = [
        (dict(ema_decay=1.0), r"ema_decay=1.0 is not allowed"),
        (dict(ema_decay=-0.1), r"ema_decay=-0.1 is not allowed"),
        (dict(ema_eval=True), r"ema_eval=True needs an EMA"),
        (dict(swa_last_k=-1), r"swa_last_k=-1 is not allowed"),
        (dict(swa_last_k=2), r"save_strategy='no'"),
        (dict(swa_last_k=3, save_strategy="steps", save_total_limit=2), r"save_total_limit >= 3"),
        (dict(swa_last_k=2, save_strategy="steps", ema_decay=0.9), r"set ema_eval=False"),
    ]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            tricks_args(tmp_path, **overrides)
    tricks_args(tmp_path, swa_last_k=2, save_strategy="steps", ema_decay=0.9, ema_eval=False)


# ---- In the Trainer -------------------------------------------------------------------------------------------------


class RecordWeights(TrainerCallback):
    """Trainable weights after each optimizer step (on_step_end: after the step, before evaluation)."""

    def __init__(self):
        self.after_step = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after_step.append(trainable(model))


@pytest.mark.parametrize("warmup", [True, False])
def test_trainer_ema_updates_once_per_optimizer_step_under_accumulation(tmp_path, warmup):
    model = bert_seq_cls()
    initial, recorder = trainable(model), RecordWeights()
    args = tricks_args(
        tmp_path, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=3, optim="sgd",
        learning_rate=0.3, ema_decay=0.2, ema_warmup=warmup,  # warm-up 0.1, 0.18, then the cap 0.2
    )  # fmt: skip
    trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=24), callbacks=[recorder])
    trainer.train()
    assert len(recorder.after_step) == 4 and ema_of(trainer).num_updates == 4  # 12 micro-batches, 4 optimizer steps
    assert_ema_close(
        ema_of(trainer).state_dict()["shadow"],
        hand_ema(initial, recorder.after_step, 0.2, warmup),
    )


def _eval_reference(model_state: dict, eval_data, tmp_path):
    """Upstream Trainer on a fresh copy of the model loaded with ``model_state``: eval loss and predictions."""
    copy = bert_seq_cls()
    copy.load_state_dict({**copy.state_dict(), **{n: v.float() for n, v in model_state.items()}})
    args = TrainingArguments(str(tmp_path / "reference"), report_to="none", use_cpu=True, per_device_eval_batch_size=4)
    reference = Trainer(model=copy, args=args)
    return reference.evaluate(eval_data)["eval_loss"], reference.predict(eval_data).predictions


def test_ema_eval_metrics_equal_a_copy_loaded_with_the_hand_average_and_raw_weights_come_back(tmp_path):
    eval_data = seq_cls_data(n=8, seed=1)
    model = bert_seq_cls()
    initial, recorder = trainable(model), RecordWeights()
    common = dict(max_steps=4, optim="sgd", learning_rate=0.5, eval_strategy="steps", eval_steps=2)
    args = tricks_args(tmp_path / "ema", ema_decay=0.7, save_strategy="steps", save_steps=2, **common)
    trainer = TricksTrainer(
        model=model, args=args, train_dataset=seq_cls_data(n=16), eval_dataset=eval_data, callbacks=[recorder]
    )
    trainer.train()

    # Evaluations during training ran on the EMA of that step.
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evals] == [2, 4]
    for entry in evals:
        step = entry["step"]
        want, _ = _eval_reference(hand_ema(initial, recorder.after_step[:step], 0.7, True), eval_data, tmp_path)
        assert entry["eval_loss"] == pytest.approx(want, rel=1e-5)  # float32 round-off of the two averages
    # Training went on with the raw weights: the same trajectory as a run without EMA, bitwise.
    plain = TricksTrainer(
        model=bert_seq_cls(), args=tricks_args(tmp_path / "plain", **common), train_dataset=seq_cls_data(n=16),
        eval_dataset=eval_data,
    )  # fmt: skip
    plain.train()
    raw = trainable(model)
    for name, value in trainable(plain.model).items():
        assert torch.equal(raw[name], value), name
    # The checkpoints hold the raw weights and the EMA of their step.
    saved = load_file(tmp_path / "ema" / "checkpoint-2" / "model.safetensors")
    assert torch.equal(saved["classifier.weight"], recorder.after_step[1]["classifier.weight"])
    saved_ema = load_trick_states(str(tmp_path / "ema" / "checkpoint-2" / TRICKS_STATE_NAME))["EMA"]["shadow"]
    assert_ema_close(saved_ema, hand_ema(initial, recorder.after_step[:2], 0.7, True))

    # evaluate / predict after training: the final EMA, raw weights bitwise back.
    final_ema = hand_ema(initial, recorder.after_step, 0.7, True)
    want_loss, want_predictions = _eval_reference(final_ema, eval_data, tmp_path)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(want_loss, rel=1e-5)
    predictions = torch.as_tensor(trainer.predict(eval_data).predictions)
    torch.testing.assert_close(predictions, torch.as_tensor(want_predictions), rtol=1e-5, atol=1e-6)
    for name, value in trainable(model).items():
        assert torch.equal(raw[name], value), name

    # The final save holds the EMA weights and says so; the in-memory model keeps the raw ones.
    trainer.save_model(str(tmp_path / "final"))
    final = load_file(tmp_path / "final" / "model.safetensors")
    shadow = ema_of(trainer).state_dict()["shadow"]
    for name in shadow:
        assert torch.equal(final[name], shadow[name]), name
    info = json.loads((tmp_path / "final" / AVERAGING_INFO_NAME).read_text())
    assert info == {"weights": "ema", "ema_decay": 0.7, "ema_warmup": True, "updates": 4}
    assert torch.equal(model.classifier.weight, raw["classifier.weight"])


def test_without_ema_eval_the_final_save_is_raw_and_a_stale_marker_goes(tmp_path):
    model = bert_seq_cls()
    args = tricks_args(tmp_path, max_steps=2, ema_decay=0.9, ema_eval=False)
    trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=8))
    trainer.train()
    (tmp_path / AVERAGING_INFO_NAME).write_text("{}")
    trainer.save_model()
    assert torch.equal(load_file(tmp_path / "model.safetensors")["classifier.weight"], model.classifier.weight)
    assert not (tmp_path / AVERAGING_INFO_NAME).exists()


def test_load_best_model_at_end_takes_the_best_checkpoints_ema(tmp_path):
    args = tricks_args(
        tmp_path, max_steps=4, optim="sgd", learning_rate=0.5, ema_decay=0.5, eval_strategy="steps", eval_steps=1,
        save_strategy="steps", save_steps=1, load_best_model_at_end=True, metric_for_best_model="loss",
    )  # fmt: skip
    trainer = TricksTrainer(
        model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=16), eval_dataset=seq_cls_data(n=8, seed=1)
    )
    trainer.train()
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best = min(evals, key=evals.get)
    assert best != 4  # (here: 1) so the final EMA had to be replaced by the best checkpoint's
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best}")
    saved = load_trick_states(str(tmp_path / f"checkpoint-{best}" / TRICKS_STATE_NAME))["EMA"]["shadow"]
    assert ema_of(trainer).num_updates == best
    for name, value in ema_of(trainer).state_dict()["shadow"].items():
        assert torch.equal(value, saved[name]), name


# ---- Resume after kill -9 -------------------------------------------------------------------------------------------


def _killed_in_child(fn) -> int:
    pid = os.fork()
    if pid == 0:  # the child: fn is expected to SIGKILL it; anything else is a failure
        try:
            fn()
        finally:
            os._exit(3)
    return os.waitpid(pid, 0)[1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_kill_9_with_a_torn_newest_checkpoint_resumes_to_the_same_raw_and_ema_weights(tmp_path, caplog):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels in every run: comparable to float32 round-off
    try:
        config = {"ema_decay": 0.8, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}
        reference, crashed = tmp_path / "reference", tmp_path / "crashed"
        resume_run.run(reference, config)
        status = _killed_in_child(lambda: resume_run.run(crashed, config, kill_after_save=6))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"wait status {status}"
        newest = crashed / "checkpoint-6"
        data = (newest / TRICKS_STATE_NAME).read_bytes()
        (newest / TRICKS_STATE_NAME).write_bytes(data[: len(data) // 2])  # torn mid-write
        with caplog.at_level(logging.WARNING, logger="nlp_tricks.runtime.resume"):
            resume_run.run(crashed, config, resume=True)
        assert f"Skipping incomplete checkpoint {newest}: {TRICKS_STATE_NAME} is truncated" in caplog.text
    finally:
        torch.set_num_threads(threads)
    for name in ("final.safetensors", "final_ema.safetensors"):
        want, got = load_file(reference / name), load_file(crashed / name)
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=f"{name}: {key}")
    # The EMA moved away from the start, and counts every optimizer step of both parts of the run.
    initial = resume_run.make_model(config).state_dict()
    ema = load_file(crashed / "final_ema.safetensors")
    assert not torch.equal(ema["classifier.weight"], initial["classifier.weight"])
    from safetensors import safe_open

    with safe_open(crashed / "final_ema.safetensors", "pt") as f:
        assert f.metadata()["num_updates"] == str(resume_run.MAX_STEPS)


def test_resuming_a_checkpoint_without_ema_state_is_an_error_naming_it(tmp_path):
    args = tricks_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=8)).train()
    args = tricks_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, ema_decay=0.9)
    trainer = TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=16))
    with pytest.raises(ValueError, match=f"checkpoint-2' is incomplete: {TRICKS_STATE_NAME} holds no state for EMA"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    with pytest.raises(ValueError, match="No complete checkpoint found"):
        trainer.train(resume_from_checkpoint=True)


# ---- 2-process DDP --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch_ddp_script("ema_ddp.py", tmp_path_factory.mktemp("ema_ddp"))


@pytest.mark.slow  # two processes of accelerate launch: ~30 s on 2 shared cores
def test_ddp_ranks_hold_identical_averages_with_plain_communication(ddp_run):
    plain = rank_report(ddp_run, "plain", 0)
    assert plain["world_size"] == 2 and plain["steps"] == 3
    buckets, rest = divmod(plain["allreduces"], plain["steps"])
    assert buckets >= 1 and rest == 0
    for rank in (0, 1):
        report = rank_report(ddp_run, "ema", rank)
        assert report["allreduces"] == plain["allreduces"], report  # no extra collective for the EMA
        assert report["ema_updates"] == 3 and report["evals"] == 3
    rank0, rank1 = load_file(ddp_run / "ema_rank0.safetensors"), load_file(ddp_run / "ema_rank1.safetensors")
    assert set(rank0) == set(rank1)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    # The average is the one written out by hand from the weights after each step, and training is plain's.
    initial = trainable(bert_token_cls())
    trajectory = [{n: rank0[f"step{k}.{n}"] for n in initial} for k in (1, 2, 3)]
    assert_ema_close({n: rank0[f"ema.{n}"] for n in initial}, hand_ema(initial, trajectory, 0.8, True))
    plain0 = load_file(ddp_run / "plain_rank0.safetensors")
    for name in initial:
        assert torch.equal(rank0[name], plain0[name]), name


# ---- Checkpoint averaging -------------------------------------------------------------------------------------------


def _checkpoints(tmp_path, seeds=(1, 2, 3)):
    """save_pretrained folders of one BertForMaskedLM architecture with different weights (tied decoder)."""
    paths, states = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        model = BertForMaskedLM(bert_config())
        path = tmp_path / f"seed{seed}"
        model.save_pretrained(path)
        paths.append(path)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return paths, states


def _assert_mean(output: Path, states: list[dict], plain: Path) -> None:
    averaged = load_file(output / "model.safetensors")
    # Tied weights saved once under the names save_pretrained itself writes.
    assert set(averaged) == set(load_file(plain / "model.safetensors"))
    for key, value in averaged.items():
        want = torch.stack([s[key].double() for s in states]).mean(0)
        # float32 sum and division against a float64 mean: float32 round-off.
        torch.testing.assert_close(value.double(), want, rtol=1e-6, atol=1e-7, msg=key)


def test_average_of_three_checkpoints_is_the_mean_of_their_state_dicts(tmp_path):
    paths, states = _checkpoints(tmp_path)
    (paths[0] / "vocab.txt").write_text("[PAD]\n")
    output = tmp_path / "avg"
    assert cli_main(["average", *map(str, paths), "--output", str(output)]) == 0
    _assert_mean(output, states, paths[0])
    reloaded = BertForMaskedLM.from_pretrained(output)
    assert reloaded.cls.predictions.decoder.weight is reloaded.bert.embeddings.word_embeddings.weight
    assert (output / "vocab.txt").exists()
    assert json.loads((output / AVERAGING_INFO_NAME).read_text())["checkpoints"] == list(map(str, paths))


def test_dataparallel_and_compile_prefixed_checkpoints_average_with_a_plain_one(tmp_path):
    paths, states = _checkpoints(tmp_path)
    # The state dicts wrapped models write: every key prefixed, both names of the tied weight present.
    torch.manual_seed(2)
    dp = nn.DataParallel(BertForMaskedLM(bert_config()))
    torch.save(dp.state_dict(), tmp_path / "dp.pt")
    torch.manual_seed(3)
    compiled = torch.compile(BertForMaskedLM(bert_config()))
    save_file({k: v.clone() for k, v in compiled.state_dict().items()}, tmp_path / "compiled.safetensors")
    assert all(k.startswith("module.") for k in torch.load(tmp_path / "dp.pt", weights_only=True))
    assert all(k.startswith("_orig_mod.") for k in load_file(tmp_path / "compiled.safetensors"))
    output = average_checkpoints([paths[0], tmp_path / "dp.pt", tmp_path / "compiled.safetensors"], tmp_path / "out")
    _assert_mean(Path(output), states, paths[0])


def test_a_checkpoint_with_other_shapes_is_an_error_naming_them(tmp_path, capsys):
    paths, _ = _checkpoints(tmp_path, seeds=(1,))
    torch.manual_seed(0)
    BertForMaskedLM(bert_config(intermediate_size=40)).save_pretrained(tmp_path / "wider")
    assert cli_main(["average", str(paths[0]), str(tmp_path / "wider"), "--output", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "nlp-tricks average:" in err and "Traceback" not in err
    assert "bert.encoder.layer.0.intermediate.dense.weight: checkpoint (40, 32) vs model (37, 32)" in err
    assert cli_main(["average", str(tmp_path / "absent"), "--output", str(tmp_path / "o")]) == 1
    assert "absent does not exist" in capsys.readouterr().err


def test_average_into_a_live_model(tmp_path):
    paths, states = _checkpoints(tmp_path, seeds=(4, 5))
    model = average_into(BertForMaskedLM(bert_config()), paths)
    key = "bert.encoder.layer.0.output.dense.weight"
    want = (states[0][key] + states[1][key]) / 2
    assert torch.equal(model.bert.encoder.layer[0].output.dense.weight, want)  # the same float32 operations: bitwise


def test_swa_last_k_loads_the_mean_of_the_k_newest_checkpoints(tmp_path):
    model = bert_seq_cls()
    args = tricks_args(tmp_path, max_steps=5, save_strategy="steps", save_steps=1, swa_last_k=3, optim="sgd")
    trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=20))
    trainer.train()
    states = [load_file(tmp_path / f"checkpoint-{s}" / "model.safetensors") for s in (3, 4, 5)]
    for name, value in model.state_dict().items():
        if value.is_floating_point():
            want = torch.stack([s[name].double() for s in states]).mean(0)
            torch.testing.assert_close(value.double(), want, rtol=1e-6, atol=1e-7, msg=name)
    trainer.save_model(str(tmp_path / "final"))
    info = json.loads((tmp_path / "final" / AVERAGING_INFO_NAME).read_text())
    assert info == {"weights": "swa", "checkpoints": ["checkpoint-3", "checkpoint-4", "checkpoint-5"]}


# ---- In a recipe, with the ablation's flags -------------------------------------------------------------------------


@pytest.mark.parametrize("configuration", ["ema", "swa"])
def test_ner_recipe_runs_the_ablation_rows(configuration, tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    flags = [*ner_files(tmp_path), *CONFIGURATIONS[configuration]]
    if configuration == "swa":  # 2 steps here: save after each, average both (the last value of a flag wins)
        flags += ["--save_steps", "1", "--swa_last_k", "2"]
    assert run_in_process("ner", tiny_args(tiny_model, out, *flags), monkeypatch) == 0
    info = json.loads((out / AVERAGING_INFO_NAME).read_text())
    assert info["weights"] == configuration
    if configuration == "swa":
        assert info["checkpoints"] == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((out / "all_results.json").read_text())["test_f1"] >= 0


@pytest.mark.parametrize(
    "field,first,second",
    [
        # Same shapes, other label names (or order): the average would keep the first one's id2label.
        (
            "id2label",
            {},
            {"id2label": {0: "neg", 1: "pos", 2: "neutral"}, "label2id": {"neg": 0, "pos": 1, "neutral": 2}},
        ),
        (
            "problem_type",
            {"problem_type": "single_label_classification"},
            {"problem_type": "multi_label_classification"},
        ),
    ],
)
def test_checkpoints_of_different_models_are_refused_in_one_line(tmp_path, capsys, field, first, second):
    for name, overrides in (("a", first), ("b", second)):
        torch.manual_seed(0)
        BertForSequenceClassification(bert_config(num_labels=3, **overrides)).save_pretrained(tmp_path / name)
    a, b = (
        json.loads((tmp_path / "a" / "config.json").read_text()),
        json.loads((tmp_path / "b" / "config.json").read_text()),
    )
    capsys.readouterr()  # save_pretrained's progress bars
    assert cli_main(["average", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == (
        f"nlp-tricks average: {tmp_path / 'a'} and {tmp_path / 'b'} are different models: their config.json differ in "
        f"{field!r} ({a.get(field)!r} vs {b.get(field)!r}); average checkpoints of one model\n"
    )
    assert not (tmp_path / "o").exists()


def test_checkpoints_of_different_architectures_and_a_crf_in_one_only_are_refused(tmp_path, capsys):
    torch.manual_seed(0)
    BertForTokenClassification(bert_config(num_labels=3)).save_pretrained(tmp_path / "tokens")
    model = BertForTokenClassification(bert_config(num_labels=3))
    add_crf(model)
    model.save_pretrained(tmp_path / "crf")
    BertForMaskedLM(bert_config()).save_pretrained(tmp_path / "mlm")
    assert cli_main(["average", str(tmp_path / "tokens"), str(tmp_path / "mlm"), "--output", str(tmp_path / "o")]) == 1
    assert (
        "differ in 'architectures' (['BertForTokenClassification'] vs ['BertForMaskedLM'])" in capsys.readouterr().err
    )
    assert cli_main(["average", str(tmp_path / "tokens"), str(tmp_path / "crf"), "--output", str(tmp_path / "o")]) == 1
    assert "differ in 'crf' (False vs True)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@needs_crf_loading
def test_checkpoints_with_a_crf_average_into_a_crf_model(tmp_path):
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = BertForTokenClassification(bert_config(num_labels=3))
        add_crf(model)
        with torch.no_grad():
            model.crf.transitions.normal_()
        model.save_pretrained(tmp_path / f"c{seed}")
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    # A CRF model saved again after load_crf_model names its subclass; it is still the same model.
    load_crf_model(tmp_path / "c2").save_pretrained(tmp_path / "c2")
    assert cli_main(["average", str(tmp_path / "c1"), str(tmp_path / "c2"), "--output", str(tmp_path / "o")]) == 0
    averaged = load_crf_model(tmp_path / "o")
    torch.testing.assert_close(
        averaged.crf.transitions, (states[0]["crf.transitions"] + states[1]["crf.transitions"]) / 2
    )
