"""Scheduled sampling: schedules, the decoder input mixing, the two-pass forward and its wiring in the trainer."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import default_data_collator

from nlp_tricks import TricksTrainer
from nlp_tricks.seq2seq import ScheduledSampler, Seq2SeqTricksTrainer, scheduled_sampling_forward
from nlp_tricks.seq2seq.scheduled_sampling import mix_decoder_inputs, replacement_mask
from tiny import VOCAB, seq2seq_data, tricks_args
from tiny_seq2seq import MODELS, bart_lm, marian_mt, seq2seq_args, t5_lm

# ---- Schedules ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule,k,min_ratio,expected",
    [
        # step: ratio, computed by hand
        ("constant", 0.3, 0.0, {0: 0.3, 1: 0.3, 1000: 0.3}),
        ("constant", 0.3, 0.5, {0: 0.5, 7: 0.5}),
        ("linear", 100, 0.0, {0: 1.0, 25: 0.75, 60: 0.4, 100: 0.0, 250: 0.0}),
        ("linear", 100, 0.2, {0: 1.0, 50: 0.5, 80: 0.2, 90: 0.2}),
        ("exponential", 0.9, 0.0, {0: 1.0, 1: 0.9, 2: 0.81, 3: 0.729}),
        ("exponential", 0.5, 0.1, {3: 0.125, 4: 0.1}),
        # 10 / (10 + e^(step/10)): e^0 = 1, e^1 = 2.718281828, e^2 = 7.389056099
        ("inverse_sigmoid", 10, 0.0, {0: 10 / 11, 10: 0.786270, 20: 0.575074}),
        ("inverse_sigmoid", 1, 0.0, {0: 0.5, 100000: 0.0}),
    ],
)
def test_schedule_values(schedule, k, min_ratio, expected):
    sampler = ScheduledSampler(schedule, k=k, min_ratio=min_ratio)
    for step, ratio in expected.items():
        assert sampler.ratio(step) == pytest.approx(ratio, abs=1e-6), (schedule, step)


@pytest.mark.parametrize(
    "schedule,k",
    [("constant", 1.5), ("constant", -0.1), ("linear", 0), ("exponential", 1.0), ("exponential", 0.0),
     ("inverse_sigmoid", 0.5), ("linear", None)],
)  # fmt: skip
def test_bad_schedule_parameters_name_k(schedule, k):
    with pytest.raises(ValueError, match="k"):
        ScheduledSampler(schedule, k=k)


def test_bad_schedule_and_floor():
    with pytest.raises(ValueError, match="schedule"):
        ScheduledSampler("cosine", k=1.0)
    with pytest.raises(ValueError, match="min_ratio"):
        ScheduledSampler("linear", k=10, min_ratio=1.5)


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"scheduled_sampling": "cosine"}, "scheduled_sampling"),
        ({"scheduled_sampling": "linear"}, "ss_k"),
        ({"scheduled_sampling": "exponential", "ss_k": 2.0}, "ss_k"),
        ({"scheduled_sampling": "linear", "ss_k": 10, "ss_min_ratio": -0.1}, "ss_min_ratio"),
        ({"ss_k": 0.5}, "ss_k"),
        ({"ss_mode": "beam"}, "ss_mode"),
        ({"ss_temperature": 0.0}, "ss_temperature"),
        ({"tie_encoder_decoder": "layers"}, "tie_encoder_decoder"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path, fields, name):
    with pytest.raises(ValueError, match=name):
        seq2seq_args(tmp_path, **fields)


# ---- Mixing -------------------------------------------------------------------------------------------------------


def test_replacement_mask_protects_start_and_ignored_positions():
    labels = torch.tensor([[5, 6, 7, 8, -100, -100], [-100, 6, 7, -100, 9, 10]])
    # Allowed: t >= 1 with labels t and t-1 both labelled.
    allowed = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(replacement_mask(labels, 0.0), allowed)
    assert not replacement_mask(labels, 1.0).any()
    many = labels.repeat(2000, 1)
    mask = replacement_mask(many, 0.3)
    assert not (mask & ~allowed.repeat(2000, 1)).any()
    # 16000 Bernoulli(0.7) draws: 5 standard deviations is 0.018.
    assert mask.sum().item() / allowed.repeat(2000, 1).sum().item() == pytest.approx(0.7, abs=0.018)


def test_mix_argmax_and_sample_feed_the_previous_positions_prediction():
    ids = torch.tensor([[2, 10, 11, 12]])
    logits = torch.full((1, 4, 20), -50.0)
    for t, token in enumerate([15, 16, 17, 18]):
        logits[0, t, token] = 50.0
    mask = torch.tensor([[False, True, False, True]])
    expected = torch.tensor([[2, 15, 11, 17]])  # position t takes the prediction made at t - 1
    assert torch.equal(mix_decoder_inputs(ids, logits, mask)["decoder_input_ids"], expected)
    # exp(-100) underflows to 0 in float32: the softmax is one-hot and the sample is the argmax.
    sampled = mix_decoder_inputs(ids, logits, mask, mode="sample")["decoder_input_ids"]
    assert torch.equal(sampled, expected)


def test_sample_mode_draws_from_the_tempered_softmax():
    n = 4000
    ids = torch.full((n, 2), 3)
    logits = torch.zeros(n, 2, 5)
    logits[:, 0, 1] = math.log(3.0)  # softmax(logits / 2) puts sqrt(3) / (sqrt(3) + 4) on token 1
    mask = torch.tensor([[False, True]]).repeat(n, 1)
    got = mix_decoder_inputs(ids, logits, mask, mode="sample", temperature=2.0)["decoder_input_ids"][:, 1]
    p1 = math.sqrt(3) / (math.sqrt(3) + 4)
    # 4000 draws: 5 standard deviations of a frequency near 0.3 is 0.036.
    assert (got == 1).float().mean().item() == pytest.approx(p1, abs=0.036)
    assert set(got.tolist()) <= {0, 1, 2, 3, 4}


@pytest.mark.parametrize(
    "make_model",
    [lambda: bart_lm(scale_embedding=True), t5_lm, MODELS["bert2bert"], marian_mt],
    ids=["bart_scaled", "t5", "bert2bert", "marian"],
)
def test_soft_mode_with_one_hot_probabilities_equals_feeding_the_ids(make_model):
    """softmax(logits / T) @ E with one-hot probabilities is the embedding the decoder gives the argmax ids.

    BART scales in the embedding module, Marian in the decoder's forward: both must match the ids path.
    """
    model = make_model().eval()
    batch = _batch(4)
    labels = batch.pop("labels")
    ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    g = torch.Generator().manual_seed(1)
    predicted = torch.randint(5, VOCAB, ids.shape, generator=g)
    logits = F.one_hot(predicted, VOCAB).float() * 200.0  # exp(-200) is 0 in float32: exactly one-hot
    mask = replacement_mask(labels, 0.0)
    as_ids = mix_decoder_inputs(ids, logits, mask)["decoder_input_ids"]
    embedding = model.get_decoder().get_input_embeddings()
    embeds = mix_decoder_inputs(ids, logits, mask, mode="soft", embedding=embedding)["decoder_inputs_embeds"]
    torch.testing.assert_close(embeds, embedding(as_ids))
    with torch.no_grad():
        via_ids = model(**batch, decoder_input_ids=as_ids).logits
        via_embeds = model(**batch, decoder_inputs_embeds=embeds).logits
    torch.testing.assert_close(via_embeds, via_ids)


@pytest.mark.parametrize("make_model", [lambda: bart_lm(scale_embedding=True), t5_lm], ids=["bart_scaled", "t5"])
def test_soft_mode_equals_the_expected_embedding_written_out(make_model):
    """Reference: softmax(logits[t-1] / T) @ E at every position, gold where the mask is False (position 0 always
    gold). Values and the embedding weight's gradient must match; mix_decoder_inputs only computes the product at the
    replaced positions, so the sums run in another order: float32 round-off."""
    model = make_model()
    batch = _batch(4)
    labels = batch.pop("labels")
    ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(*ids.shape, VOCAB, generator=g) * 3.0
    mask = replacement_mask(labels, 0.5, generator=g)
    assert mask[:, 1:].any() and not mask[:, 1:].all()
    embedding = model.get_decoder().get_input_embeddings()
    weight = embedding.weight
    matrix = embedding(torch.arange(VOCAB))  # any scaling included
    gold = embedding(ids)
    expected = torch.softmax(logits[:, :-1] / 2.0, dim=-1) @ matrix
    expected = torch.where(mask.unsqueeze(-1), torch.cat([gold[:, :1], expected], dim=1), gold)
    probe = torch.randn(expected.shape, generator=g)
    (expected_grad,) = torch.autograd.grad((expected * probe).sum(), weight)
    got = mix_decoder_inputs(ids, logits, mask, mode="soft", temperature=2.0, embedding=embedding)
    embeds = got["decoder_inputs_embeds"]
    (grad,) = torch.autograd.grad((embeds * probe).sum(), weight)
    torch.testing.assert_close(embeds, expected)
    torch.testing.assert_close(grad, expected_grad)


# ---- Two-pass forward ---------------------------------------------------------------------------------------------


def _batch(n=4, **kwargs):
    data = seq2seq_data(n=n, **kwargs)
    return default_data_collator([data[i] for i in range(len(data))])


def _reference_mixed_ids(model, batch, decoder_input_ids):
    """Plain loops: position t >= 1 gets the argmax predicted at t - 1 when labels t and t - 1 are both labelled."""
    with torch.no_grad():
        predicted = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_input_ids
        ).logits.argmax(-1)
    labels = batch["labels"]
    mixed = decoder_input_ids.clone()
    for b in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            if labels[b, t] != -100 and labels[b, t - 1] != -100:
                mixed[b, t] = predicted[b, t - 1]
    return mixed


class DecoderInputs:
    """Records the input ids each decoder call receives."""

    def __init__(self, model):
        self.seen = []
        self.handle = model.get_decoder().register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.seen.append(None if ids is None else ids.clone())


def _loss_and_grads(model, logits, labels):
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_ratio_zero_trains_on_the_pass1_predictions_with_the_plain_gradients(name):
    """Pass 2 feeds exactly the pass-1 argmax; loss and gradients (encoder included) equal a plain forward on it."""
    model = MODELS[name]()
    batch = _batch()
    labels = batch["labels"]
    dec_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    expected_ids = _reference_mixed_ids(model, batch, dec_ids)
    assert not torch.equal(expected_ids, dec_ids)  # the test can see a difference

    ref_loss, ref_grads = _loss_and_grads(
        model,
        model(**{k: v for k, v in batch.items() if k != "labels"}, decoder_input_ids=expected_ids).logits,
        labels,
    )
    recorder = DecoderInputs(model)
    encoder_calls = []
    model.get_encoder().register_forward_hook(lambda *a: encoder_calls.append(1))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "decoder_input_ids": dec_ids}
    outputs = scheduled_sampling_forward(model, inputs, labels, ratio=0.0)
    loss, grads = _loss_and_grads(model, outputs.logits, labels)
    recorder.handle.remove()

    assert len(encoder_calls) == 1
    assert len(recorder.seen) == 2
    assert torch.equal(recorder.seen[0], dec_ids)  # pass 1 is teacher-forced
    assert torch.equal(recorder.seen[1], expected_ids)
    torch.testing.assert_close(loss, ref_loss)
    assert ref_grads.keys() == grads.keys()
    assert any("encoder" in n for n in grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, msg=n)


@pytest.mark.parametrize("name", list(MODELS))
def test_ratio_one_is_plain_teacher_forcing(name):
    model = MODELS[name]()
    batch = _batch()
    labels = batch["labels"]
    ref_loss, ref_grads = _loss_and_grads(model, model(**batch).logits, labels)
    dec_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "decoder_input_ids": dec_ids}
    loss, grads = _loss_and_grads(model, scheduled_sampling_forward(model, inputs, labels, 1.0).logits, labels)
    assert torch.equal(loss, ref_loss)
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n


# ---- Trainer ------------------------------------------------------------------------------------------------------


def _sgd(tmp_path, **extra):
    kw = dict(max_steps=1, optim="sgd", learning_rate=0.5, weight_decay=0.0, max_grad_norm=0.0)
    kw.update(extra)
    return kw


@pytest.mark.parametrize("loss", [{}, {"loss_type": "focal", "focal_gamma": 1.0}])
def test_trainer_ratio_zero_step_equals_manual_sgd_on_the_mixed_input(tmp_path, loss):
    base = bart_lm()
    data = seq2seq_data(n=8)
    batch = _batch(8)
    ref = copy.deepcopy(base)
    mixed = _reference_mixed_ids(ref, batch, ref.prepare_decoder_input_ids_from_labels(labels=batch["labels"]))
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=mixed).logits
    flat, target = logits.reshape(-1, VOCAB), batch["labels"].reshape(-1)
    if loss:  # focal loss with gamma 1, written out: mean over labelled tokens of -(1 - p_t) log p_t
        keep = target != -100
        logp = F.log_softmax(flat[keep], -1).gather(1, target[keep, None]).squeeze(1)
        ref_loss = (-(1 - logp.exp()) * logp).mean()
    else:
        ref_loss = F.cross_entropy(flat, target)
    ref_loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad

    model = copy.deepcopy(base)
    args = seq2seq_args(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, scheduled_sampling="constant",
        ss_k=0.0, **_sgd(tmp_path), **loss,
    )  # fmt: skip
    Seq2SeqTricksTrainer(model=model, args=args, train_dataset=data).train()
    for n, p in ref.named_parameters():
        # Accumulation over 2 micro-batches sums in another order: float32 round-off only.
        torch.testing.assert_close(model.get_parameter(n), p, rtol=1e-5, atol=1e-6, msg=n)


def test_trainer_ratio_one_equals_the_plain_trainer(tmp_path):
    base, data = bart_lm(), seq2seq_data(n=8)
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    TricksTrainer(model=plain, args=tricks_args(tmp_path / "a", **_sgd(tmp_path)), train_dataset=data).train()
    args = seq2seq_args(tmp_path / "b", scheduled_sampling="constant", ss_k=1.0, **_sgd(tmp_path))
    Seq2SeqTricksTrainer(model=ours, args=args, train_dataset=data).train()
    for n, p in plain.named_parameters():
        assert torch.equal(ours.get_parameter(n), p), n


def test_encoder_runs_once_per_micro_batch(tmp_path):
    model = bart_lm()
    calls = []
    model.get_encoder().register_forward_hook(lambda *a: calls.append(1))
    decoder_calls = DecoderInputs(model)
    args = seq2seq_args(
        tmp_path, scheduled_sampling="constant", ss_k=0.5, max_steps=1, gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
    )  # fmt: skip
    Seq2SeqTricksTrainer(model=model, args=args, train_dataset=seq2seq_data(n=4)).train()
    assert len(calls) == 2
    assert len(decoder_calls.seen) == 4


def test_collator_decoder_input_ids_are_respected(tmp_path):
    model = bart_lm()
    batch = _batch()
    # A collator that starts the decoder with token 0 (BART's config says 2) and shifts on its own.
    dec_ids = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    dec_ids[:, 0] = 0
    batch["decoder_input_ids"] = dec_ids
    trainer = Seq2SeqTricksTrainer(model=model, args=seq2seq_args(tmp_path, scheduled_sampling="constant", ss_k=0.0))
    expected = _reference_mixed_ids(model, batch, dec_ids)
    recorder = DecoderInputs(model)
    model.train()
    trainer.compute_loss(model, batch)
    assert torch.equal(recorder.seen[0], dec_ids)
    assert torch.equal(recorder.seen[1], expected)
    assert torch.equal(recorder.seen[1][:, 0], torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("mode", ["soft", "sample"])
def test_trainer_modes_at_low_temperature_match_argmax(tmp_path, mode):
    """At temperature 1e-6 the softmax is one-hot (gaps of these logits are far above 1e-6 * 100), so soft and sample
    feed the argmax: the loss equals argmax mode's up to float32 round-off of the embedding products."""
    model = bart_lm(scale_embedding=True)
    model.train()
    batch = _batch()
    losses = {}
    for m in ("argmax", mode):
        args = seq2seq_args(tmp_path, scheduled_sampling="constant", ss_k=0.0, ss_mode=m, ss_temperature=1e-6)
        losses[m] = Seq2SeqTricksTrainer(model=model, args=args).compute_loss(model, batch)
    torch.testing.assert_close(losses[mode], losses["argmax"])


def test_evaluation_stays_teacher_forced(tmp_path):
    model = bart_lm().eval()
    batch = _batch()
    trainer = Seq2SeqTricksTrainer(model=model, args=seq2seq_args(tmp_path, scheduled_sampling="constant", ss_k=0.0))
    with torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(model, batch), model(**batch).loss)


def test_ratio_is_read_at_the_global_step(tmp_path):
    model = bart_lm()
    trainer = Seq2SeqTricksTrainer(model=model, args=seq2seq_args(tmp_path, scheduled_sampling="linear", ss_k=100))
    model.train()
    trainer.state.global_step = 30
    trainer.compute_loss(model, _batch())
    assert trainer._step_metrics["teacher_forcing_ratio"][-1].item() == pytest.approx(0.7)


def test_ratio_is_logged_and_resumes_from_a_checkpoint(tmp_path):
    data = seq2seq_data(n=8)
    common = dict(scheduled_sampling="linear", ss_k=8, per_device_train_batch_size=2, save_strategy="steps")
    args = seq2seq_args(tmp_path, max_steps=3, save_steps=2, **common)
    trainer = Seq2SeqTricksTrainer(model=bart_lm(), args=args, train_dataset=data)
    trainer.train()
    ratios = [e["teacher_forcing_ratio"] for e in trainer.state.log_history if "loss" in e]
    assert ratios == [1.0, 0.875, 0.75]  # 1 - step / 8 at steps 0..2

    resumed = Seq2SeqTricksTrainer(model=bart_lm(), args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    ratios = [e["teacher_forcing_ratio"] for e in resumed.state.log_history if "loss" in e and e["step"] > 2]
    assert ratios == [0.75]


def test_scheduled_sampling_needs_an_encoder_decoder(tmp_path):
    from tiny import bert_seq_cls

    with pytest.raises(ValueError, match="encoder-decoder"):
        Seq2SeqTricksTrainer(model=bert_seq_cls(), args=seq2seq_args(tmp_path, scheduled_sampling="linear", ss_k=10))
