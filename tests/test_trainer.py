"""TricksTrainer: losses wired into compute_loss, exact gradient accumulation, training runs, config validation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainingArguments, default_data_collator

from nlp_tricks import TricksArguments, TricksTrainer
from tiny import bart_lm, bert_seq_cls, bert_token_cls, seq2seq_data, seq_cls_data, token_cls_data, tricks_args

LOSS_SETTINGS = {
    "ce": {},
    "focal": {"loss_type": "focal", "focal_gamma": 2.0, "focal_alpha": [0.5, 1.0, 2.0, 1.0, 0.25]},
    "label_smoothing": {"loss_type": "label_smoothing", "label_smoothing_factor": 0.2},
    "ce_temperature": {"temperature": 2.0},
}


def _batch(dataset):
    return default_data_collator([dataset[i] for i in range(len(dataset))])


@pytest.mark.parametrize(
    "make_model,make_data", [(bert_seq_cls, seq_cls_data), (bert_token_cls, token_cls_data), (bart_lm, seq2seq_data)]
)
def test_ce_equals_the_models_own_loss(tmp_path, make_model, make_data):
    model = make_model()
    batch = _batch(make_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path))
    ours = trainer.compute_loss(model, batch)
    torch.testing.assert_close(ours, model(**batch).loss)
    assert "labels" in batch  # the caller's dict is left intact
    n = int((batch["labels"] != -100).sum())
    torch.testing.assert_close(trainer.compute_loss(model, batch, num_items_in_batch=n * 3), ours / 3)


def test_label_smoothing_and_temperature_reach_the_loss(tmp_path):
    model = bert_token_cls()
    batch = _batch(token_cls_data())
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    args = tricks_args(tmp_path, loss_type="label_smoothing", label_smoothing_factor=0.3, temperature=0.5)
    with torch.no_grad():
        ours = TricksTrainer(model=model, args=args).compute_loss(model, batch)
    ref = F.cross_entropy((logits / 0.5).reshape(-1, 5), batch["labels"].reshape(-1), label_smoothing=0.3)
    torch.testing.assert_close(ours, ref)


def _one_step(tmp_path, model, data, batch_size, accumulation, settings, **extra):
    args = tricks_args(
        tmp_path,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        weight_decay=0.0,
        **settings,
        **extra,
    )
    TricksTrainer(model=model, args=args, train_dataset=data).train()
    return dict(model.named_parameters())


@pytest.mark.parametrize("setting", list(LOSS_SETTINGS))
def test_gradient_accumulation_is_exact(tmp_path, setting):
    """One SGD step on 8 examples equals 4 x 2 and 2 x 4 micro-batches (label counts differ per micro-batch)."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    full = _one_step(tmp_path / "a", copy.deepcopy(base), data, 8, 1, LOSS_SETTINGS[setting])
    for bs, ga in [(4, 2), (2, 4)]:
        accumulated = _one_step(tmp_path / f"b{bs}", copy.deepcopy(base), data, bs, ga, LOSS_SETTINGS[setting])
        for name, p in full.items():
            # Summation order differs between the splits: float32 round-off only.
            torch.testing.assert_close(accumulated[name], p, rtol=1e-5, atol=1e-6, msg=f"{name} ({bs}x{ga})")


def test_one_step_equals_manual_sgd_on_the_full_batch_mean(tmp_path):
    """Reference: plain SGD on F.cross_entropy's mean over all labelled tokens of the 8 examples."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    batch = _batch(data)
    loss = F.cross_entropy(
        ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.reshape(-1, 5),
        batch["labels"].reshape(-1),
    )
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    ours = _one_step(tmp_path, copy.deepcopy(base), data, 2, 4, {}, max_grad_norm=0.0)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(ours[name], p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("setting", list(LOSS_SETTINGS))
@pytest.mark.parametrize("make_model,make_data", [(bert_seq_cls, seq_cls_data), (bert_token_cls, token_cls_data)])
def test_training_changes_every_trainable_parameter(tmp_path, setting, make_model, make_data):
    settings = dict(LOSS_SETTINGS[setting])
    if make_model is bert_seq_cls and "focal_alpha" in settings:
        settings["focal_alpha"] = [0.5, 1.0, 2.0]
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = tricks_args(tmp_path, max_steps=3, learning_rate=1e-2, layer_decay=0.9, head_lr_scale=2.0, **settings)
    trainer = TricksTrainer(model=model, args=args, train_dataset=make_data(n=12))
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert any("loss" in entry for entry in trainer.state.log_history)
    for name, p in model.named_parameters():
        assert not torch.equal(before[name], p.detach()), f"{name} did not change"


def test_seq2seq_training_runs(tmp_path):
    model = bart_lm()
    before = model.model.encoder.layers[0].fc1.weight.detach().clone()
    args = tricks_args(tmp_path, loss_type="focal", focal_gamma=1.0, max_steps=2)
    TricksTrainer(model=model, args=args, train_dataset=seq2seq_data()).train()
    assert not torch.equal(before, model.model.encoder.layers[0].fc1.weight)


def test_regression_keeps_the_models_loss_scaled(tmp_path):
    model = bert_seq_cls(num_labels=1)
    batch = _batch(seq_cls_data())
    batch["labels"] = batch["labels"].float()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path))
    expected = model(**batch).loss
    torch.testing.assert_close(trainer.compute_loss(model, batch), expected)
    torch.testing.assert_close(trainer.compute_loss(model, batch, num_items_in_batch=16), expected * 8 / 16)


def test_warmup_ratio_maps_to_fractional_warmup_steps(tmp_path):
    args = tricks_args(tmp_path, warmup_ratio=0.25)
    assert args.warmup_steps == 0.25
    assert args.get_warmup_steps(100) == 25


@pytest.mark.parametrize(
    "field,value",
    [
        ("loss_type", "hinge"),
        ("focal_gamma", -1.0),
        ("temperature", 0.0),
        ("head_lr_scale", 0.0),
        ("layer_decay", 1.5),
        ("layer_decay", 0.0),
        ("warmup_ratio", 1.0),
        ("label_smoothing_factor", 1.0),
    ],
)
def test_bad_values_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        tricks_args(tmp_path, **{field: value})


def test_inconsistent_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        tricks_args(tmp_path, loss_type="label_smoothing")
    with pytest.raises(ValueError, match="focal_alpha"):
        tricks_args(tmp_path, focal_alpha=[1.0, 2.0])
    with pytest.raises(ValueError, match="warmup"):
        tricks_args(tmp_path, warmup_ratio=0.1, warmup_steps=5)


def test_plain_training_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match="TricksArguments"):
        TricksTrainer(model=bert_seq_cls(), args=TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    assert isinstance(TricksArguments(output_dir=str(tmp_path)), TrainingArguments)


def test_recorded_metrics_are_averaged_into_the_training_log(tmp_path):
    class Recording(TricksTrainer):
        def compute_tricks_loss(self, logits, labels, num_items_in_batch=None):
            self.record_metric("seen_step", self.state.global_step)
            self.trick_state["calls"] = self.trick_state.get("calls", 0) + 1
            return super().compute_tricks_loss(logits, labels, num_items_in_batch=num_items_in_batch)

    args = tricks_args(tmp_path, max_steps=4, logging_steps=2, gradient_accumulation_steps=2)
    trainer = Recording(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=16))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    # 2 optimizer steps per log, 2 micro-batches each: steps 0,0,1,1 then 2,2,3,3
    assert [e["seen_step"] for e in logs] == [0.5, 2.5]
    assert [e["calls"] for e in logs] == [4, 8]


def test_teacher_logits_switch_to_distillation(tmp_path):
    model = bert_token_cls()
    batch = _batch(token_cls_data())
    teacher = torch.randn(*batch["labels"].shape, 5)
    args = tricks_args(tmp_path, distill_temperature=3.0, distill_alpha=0.25)
    trainer = TricksTrainer(model=model, args=args)
    with torch.no_grad():
        ours = trainer.compute_loss(model, {**batch, "teacher_logits": teacher})
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = batch["labels"] != -100
    s, t, y = logits[keep], teacher[keep], batch["labels"][keep]
    kl = F.kl_div(F.log_softmax(s / 3, -1), F.log_softmax(t / 3, -1), log_target=True, reduction="batchmean")
    torch.testing.assert_close(ours, 0.25 * 9 * kl + 0.75 * F.cross_entropy(s, y))


def test_public_api_names():
    """The names of the design contract, importable from the package (loaded on first use)."""
    import nlp_tricks
    from nlp_tricks import (  # noqa: F401
        FGM,
        PGD,
        FocalLoss,
        LabelSmoothingCrossEntropy,
        TricksArguments,
        TricksTrainer,
        build_param_groups,
        focal_loss,
        label_smoothing_cross_entropy,
        load_state_dict_portable,
    )
    from nlp_tricks.seq2seq import (  # noqa: F401
        ScheduledSampler,
        Seq2SeqTricksArguments,
        Seq2SeqTricksTrainer,
        tie_encoder_decoder,
    )

    assert set(nlp_tricks.__all__) == set(nlp_tricks._EXPORTS)
    with pytest.raises(AttributeError, match="no_such_name"):
        nlp_tricks.no_such_name  # noqa: B018
