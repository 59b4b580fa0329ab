"""TricksTrainer(span_head=...): the loss per sentence and type, exact gradient accumulation, the head's own lr,
predictions as decoded spans, save / load round trips, refusals, the length guard, and the tricks it composes with."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, AutoModelForTokenClassification, default_data_collator

from nlp_tricks import TricksTrainer, load_span_model, load_state_dict_portable
from nlp_tricks.data.spans import WORD
from nlp_tricks.functional.spans import (
    EfficientGlobalPointer,
    GlobalPointer,
    add_span_head,
    decode_spans,
    span_scores,
    word_positions_of,
)
from tiny import bert_token_cls, sgd_step_args, span_data, tricks_args

TYPES = ["LOC", "ORG", "PER"]


def _model(head=None, **overrides):
    model = bert_token_cls(num_labels=3, **overrides)
    model.config.id2label = dict(enumerate(TYPES))
    model.config.label2id = {t: i for i, t in enumerate(TYPES)}
    if head is not None:
        add_span_head(model, head, 8)
    return model


def _batch(n=6, **kwargs):
    data = span_data(n=n, **kwargs)
    return default_data_collator([data[i] for i in range(n)])


def _loss_by_hand(scores_of_sentence, rows, num_types):
    """The sentence's losses per type, log(1 + sum_neg e^s) + log(1 + sum_pos e^-s) over the spans i <= j, in
    float64 loops."""
    words = sum(1 for r in rows if r[0] == WORD)
    gold = {(t, i, j - 1) for t, i, j in rows if t >= 0}
    losses = []
    for t in range(num_types):
        neg = pos = 0.0
        for i in range(words):
            for j in range(i, words):
                s = float(scores_of_sentence[t, i, j].detach())
                if (t, i, j) in gold:
                    pos += math.exp(-s)
                else:
                    neg += math.exp(s)
        losses.append(math.log1p(neg) + math.log1p(pos))
    return losses


def test_the_heads_initialisation_is_the_encoders_but_egps_type_layer_is_glorot():
    """Every head layer as the model's own ``_init_weights`` draws it (BERT: normal std ``initializer_range``, zero
    bias), but EfficientGlobalPointer's type layer: Glorot-uniform, bound sqrt(6 / (fan_in + fan_out)), zero bias (at
    std 0.02 its per-type biases carry no signal and the head did not learn in the demo's first epoch)."""
    torch.manual_seed(0)
    std = _model().config.initializer_range
    for head in ("global_pointer", "efficient_global_pointer"):
        torch.manual_seed(0)
        layer = _model(head, hidden_size=64).classifier
        # The model's init: std within 10% of initializer_range over the 1,000+ weights of each layer.
        assert abs(layer.dense.weight.std().item() - std) < 0.1 * std and not layer.dense.bias.any()
        if head == "efficient_global_pointer":
            fan_out, fan_in = layer.type_dense.weight.shape
            bound = math.sqrt(6 / (fan_in + fan_out))
            weight = layer.type_dense.weight
            assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound  # uniform over (-bound, bound)
            assert abs(weight.std().item() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)
            assert not layer.type_dense.bias.any()


@pytest.mark.parametrize("head", ["global_pointer", "efficient_global_pointer"])
def test_trainer_loss_is_the_mean_over_sentences_and_types(tmp_path, head):
    model = _model()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, span_head=head, span_head_size=8))
    assert isinstance(model.classifier, GlobalPointer if head == "global_pointer" else EfficientGlobalPointer)
    batch = _batch(empty=(2,))
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = []
    for b in range(6):
        rows = [r for r in batch["labels"][b].tolist() if r[0] != -100]
        positions = [p for k, p, _ in rows if k == WORD]
        if not positions:
            continue  # a sentence without a word has no item
        scores = model.classifier.scores(logits[b : b + 1, positions])[0]
        expected += _loss_by_hand(scores, rows, 3)
    assert len(expected) == 5 * 3
    assert loss.item() == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    # With the Trainer's count: sentences (with a word) x types of the whole accumulated batch.
    counted = trainer._get_num_items_in_batch([batch, batch], torch.device("cpu"))
    assert int(counted) == 2 * 5 * 3
    torch.testing.assert_close(trainer.compute_loss(model, batch, num_items_in_batch=counted), loss / 2)


def _step(tmp_path, model, data, batch_size, accumulation, **settings):
    args = tricks_args(
        tmp_path,
        span_head="efficient_global_pointer",
        span_head_size=8,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        weight_decay=0.0,
        max_grad_norm=0.0,
        **settings,
    )
    TricksTrainer(model=model, args=args, train_dataset=data).train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_gradient_accumulation_is_exact(tmp_path):
    """One SGD step on 4 sentences equals 2 x 2 micro-batches: the first micro-batch holds 2 sentences with words,
    the second 1, so a per-micro-batch mean would weigh them wrongly."""
    data = span_data(n=4, empty=(3,))
    base = _model()
    start = {name: p.detach().clone() for name, p in base.named_parameters()}
    full = _step(tmp_path / "a", copy.deepcopy(base), data, 4, 1, span_head_lr_scale=3.0)
    accumulated = _step(tmp_path / "b", copy.deepcopy(base), data, 2, 2, span_head_lr_scale=3.0)
    for name, p in full.items():
        # Summation order differs between the splits: float32 round-off only.
        torch.testing.assert_close(accumulated[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(
        full["bert.embeddings.word_embeddings.weight"], start["bert.embeddings.word_embeddings.weight"]
    )


def test_the_head_gets_its_own_learning_rate_and_every_parameter_trains(tmp_path):
    model = _model()
    args = tricks_args(
        tmp_path, span_head="global_pointer", span_head_size=8, span_head_lr_scale=20.0, head_lr_scale=3.0,
        max_steps=2, layer_decay=0.8,
    )  # fmt: skip
    trainer = TricksTrainer(model=model, args=args, train_dataset=span_data())
    trainer.create_optimizer()
    groups = {g["label"]: g for g in trainer.optimizer.param_groups}
    assert {id(p) for p in groups["classifier"]["params"]} == {id(p) for p in model.classifier.parameters()}
    assert groups["classifier"]["lr"] == pytest.approx(1e-3 * 20.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    for name, p in model.named_parameters():
        if name.startswith("bert.pooler"):
            continue  # token classification does not use the pooler
        assert not torch.equal(before[name], p.detach()), f"{name} did not change"


@pytest.mark.parametrize("flat", [False, True])
def test_predictions_are_the_decoded_spans(tmp_path, flat):
    model = _model()
    args = tricks_args(
        tmp_path, span_head="global_pointer", span_head_size=8, span_flat=flat, per_device_eval_batch_size=4
    )
    trainer = TricksTrainer(model=model, args=args)
    data = span_data(n=6)
    out = trainer.predict(data)
    batch = _batch()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = decode_spans(span_scores(model, logits, word_positions_of(batch["labels"])), flat=flat)
    assert sum(map(len, expected)) > 0  # a fresh head predicts spans: the comparison can fail
    for b in range(6):
        assert [tuple(r) for r in out.predictions[b].tolist() if r[0] != -100] == expected[b]
    assert "test_loss" in out.metrics and out.metrics["test_loss"] > 0
    assert model.config.span_flat is flat


@pytest.mark.parametrize("head", ["global_pointer", "efficient_global_pointer"])
def test_save_pretrained_then_one_call_loads_the_model_and_its_head(tmp_path, head):
    model = _model(head)
    with torch.no_grad():
        for p in model.classifier.parameters():
            p.normal_()
    model.save_pretrained(tmp_path)
    loaded = load_span_model(tmp_path)
    assert isinstance(loaded, MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[type(model.config)])
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    batch = _batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    positions = word_positions_of(batch["labels"])
    with torch.no_grad():
        before = span_scores(model.eval(), model(**inputs).logits, positions)
        after = span_scores(loaded.eval(), loaded(**inputs).logits, positions)
    assert torch.equal(before, after) and decode_spans(before) == decode_spans(after)
    # The same folder through load_state_dict_portable: a fresh model with the head attached, loaded strictly.
    fresh = AutoModelForTokenClassification.from_config(model.config)
    add_span_head(fresh, head, 8)
    load_state_dict_portable(fresh, tmp_path)
    with torch.no_grad():
        assert torch.equal(span_scores(fresh.eval(), fresh(**inputs).logits, positions), before)
    # A head of other settings than the saved one is refused, naming both.
    with pytest.raises(ValueError, match=f"holds a {head} span head \\(span_head_size=8"):
        add_span_head(loaded, head, 16)


def test_loading_a_folder_without_a_span_head_is_refused(tmp_path):
    _model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="was not saved with a span head"):
        load_span_model(tmp_path)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(crf=True), "span_head='global_pointer' does not combine with crf=True"),
        (dict(pooling="mean"), "does not combine with pooling='mean'"),
        (dict(rdrop_alpha=1.0), "does not combine with rdrop_alpha=1.0 \\(R-Drop's KL"),
        (dict(smart_alpha=1.0), "does not combine with smart_alpha=1.0"),
        (dict(loss_type="focal"), "does not combine with loss_type='focal'"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1"),
        (dict(class_weights=["1", "2", "3"]), "does not combine with class_weights"),
        (dict(head_dropout_samples=3, head_dropout=0.5), "does not combine with head_dropout_samples=3"),
        (dict(span_head_size=7), "span_head_size=7 is not allowed with span_head_rope=True; it must be even"),
        (dict(span_head_size=0), "span_head_size=0 is not allowed"),
        (dict(span_head_lr_scale=0.0), "span_head_lr_scale=0.0 is not allowed"),
        (dict(span_head_max_words=0), "span_head_max_words=0 is not allowed"),
        (dict(span_head="pointer"), "span_head='pointer' is not allowed; choose one of"),
    ],
)
def test_settings_that_cannot_apply_are_refused_in_one_line(tmp_path, settings, message):
    settings = {"span_head": "global_pointer", **settings}
    with pytest.raises(ValueError, match=message) as err:
        tricks_args(tmp_path, **settings)
    assert "\n" not in str(err.value)


def test_span_settings_need_a_span_head(tmp_path):
    with pytest.raises(ValueError, match="span_flat=True needs span_head"):
        tricks_args(tmp_path, span_flat=True)
    tricks_args(tmp_path, span_head="global_pointer", span_head_size=7, span_head_rope=False)  # odd: fine unrotated


def test_the_length_guard_and_token_labels_are_one_line(tmp_path):
    model = _model()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, span_head="global_pointer", span_head_max_words=5))
    batch = _batch()
    with pytest.raises(ValueError, match=r"a sentence of \d+ words is longer than span_head_max_words=5"):
        trainer.compute_loss(model, batch)
    tokens = {**batch, "labels": torch.zeros_like(batch["input_ids"])}
    with pytest.raises(ValueError, match="span heads train on integer label rows"):
        trainer.compute_loss(model, tokens)


@pytest.mark.parametrize(
    "settings",
    [
        dict(adversarial="fgm"),
        dict(adversarial="pgd", adv_steps=2),
        dict(adversarial="freelb", adv_steps=2),
        dict(adversarial="awp"),
        dict(ema_decay=0.9),
        dict(layer_decay=0.8, head_lr_scale=5.0),
        dict(swa_last_k=2, save_strategy="steps", save_steps=1, save_only_model=True),
    ],
    ids=["fgm", "pgd", "freelb", "awp", "ema", "layer_decay", "swa"],
)
def test_span_head_composes_with(tmp_path, settings):
    model = _model(hidden_dropout_prob=0.1)
    args = tricks_args(tmp_path, span_head="efficient_global_pointer", span_head_size=8, max_steps=3, **settings)
    trainer = TricksTrainer(model=model, args=args, train_dataset=span_data())
    before = {n: p.detach().clone() for n, p in model.classifier.named_parameters()}
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    for name, p in model.classifier.named_parameters():
        assert not torch.equal(before[name], p.detach()), f"{name} did not change"
    out = trainer.predict(span_data(n=3))
    assert out.predictions.shape[0] == 3 and out.predictions.shape[-1] == 3


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    from recipe_helpers import launch_ddp_script

    return launch_ddp_script("span_head_ddp.py", tmp_path_factory.mktemp("span_ddp"))


@pytest.mark.slow
@pytest.mark.parametrize("head", ["global_pointer", "efficient_global_pointer"])
def test_ddp_step_equals_one_process_step(ddp_run, tmp_path, head):
    from safetensors.torch import load_file
    from scripts.span_head_ddp import EMPTY, SETTINGS, span_model

    single = TricksTrainer(
        model=span_model(head),
        args=sgd_step_args(tmp_path, per_device_train_batch_size=8, **SETTINGS[head]),
        train_dataset=span_data(n=8, empty=EMPTY),
    )
    single.train()
    rank0 = load_file(str(ddp_run / f"{head}_rank0.safetensors"))
    rank1 = load_file(str(ddp_run / f"{head}_rank1.safetensors"))
    for key, value in single.model.state_dict().items():
        assert torch.equal(rank0[key], rank1[key]), f"{head}: {key} differs between ranks"
        # Summation order differs (per-rank partial sums, then the all-reduce): float32 round-off only.
        torch.testing.assert_close(rank0[key], value, rtol=1e-5, atol=1e-6, msg=f"{head}: {key}")
