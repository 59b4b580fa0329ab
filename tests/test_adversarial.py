"""FGM / PGD against the classic weight-space recipe and a plain output-space reference, standalone and in Trainer."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertForMaskedLM, default_data_collator

from classic_recipes import classic_fgm, classic_pgd
from nlp_tricks import FGM, PGD, TricksTrainer
from tiny import (
    bart_lm,
    bert_config,
    bert_seq_cls,
    bert_token_cls,
    seq2seq_data,
    seq_cls_data,
    token_cls_data,
    tricks_args,
)


def _batch(dataset):
    return default_data_collator([dataset[i] for i in range(len(dataset))])


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(ours, ref, skip=()):
    assert set(ours) == set(ref) - set(skip)
    for name, grad in ref.items():
        if name not in skip:
            torch.testing.assert_close(ours[name], grad, msg=name)


# ---- References: the classic recipe (classic_recipes.py) and an output-space one -------------------------------


def output_space_reference(model, batch, epsilon, alpha, steps, norm):
    """PGD on BERT's `inputs_embeds`, normalising and projecting each example / token in Python loops."""
    emb = model.get_input_embeddings()
    ids = batch["input_ids"]
    rest = {k: v for k, v in batch.items() if k != "input_ids"}
    keep = (ids != emb.padding_idx).unsqueeze(-1).float()
    groups = (
        [(b,) for b in range(ids.shape[0])] if norm == "example" else list(itertools.product(*map(range, ids.shape)))
    )

    def scaled(t, size, only_above):
        out = t.clone()
        for idx in groups:
            n = t[idx].norm()
            if n > 0 and (not only_above or n > size):
                out[idx] = size * t[idx] / n
        return out

    def adv_loss(r):
        return model(inputs_embeds=emb(ids) + r, **rest).loss

    e = emb(ids).detach().requires_grad_()
    (grad,) = torch.autograd.grad(model(inputs_embeds=e, **rest).loss, e)
    model(**batch).loss.backward()
    r = torch.zeros_like(e)
    for t in range(steps):
        r = r + scaled(grad * keep, alpha, only_above=False)
        if steps > 1:
            r = scaled(r, epsilon, only_above=True)
        if t < steps - 1:
            leaf = r.detach().requires_grad_()
            (grad,) = torch.autograd.grad(adv_loss(leaf), leaf)
    adv_loss(r.detach()).backward()


# ---- Equivalence ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_model,make_data,attend_padding",
    [
        (bert_token_cls, token_cls_data, False),
        (bert_seq_cls, seq_cls_data, False),
        (bert_token_cls, token_cls_data, True),
    ],
)
def test_fgm_global_equals_the_classic_weight_recipe(make_model, make_data, attend_padding):
    batch = _batch(make_data())  # padded with id 0, BERT's padding_idx: its weight row gets no gradient
    if attend_padding:  # so the embedding output at the padding positions does get a gradient
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    base = make_model()
    ref = copy.deepcopy(base)
    classic_fgm(ref, lambda: ref(**batch).loss, ref.bert.embeddings.word_embeddings.weight, epsilon=1.0)
    model = copy.deepcopy(base)
    clean, adv = FGM(model, epsilon=1.0).step(lambda: model(**batch).loss)
    _assert_same_grads(_grads(model), _grads(ref))
    torch.testing.assert_close(clean, base(**batch).loss)
    assert adv > clean  # an ascent direction


@pytest.mark.parametrize("epsilon,alpha,steps", [(1.0, 0.6, 3), (1.0, 0.3, 2), (0.5, 0.3, 1)])
def test_pgd_global_equals_the_classic_weight_recipe(epsilon, alpha, steps):
    """(1.0, 0.6, 3) leaves the ball after two steps, so the projection matters; (1.0, 0.3, 2) stays inside."""
    batch = _batch(token_cls_data())
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    weight = ref.bert.embeddings.word_embeddings.weight
    classic_pgd(ref, lambda: ref(**batch).loss, weight, epsilon=epsilon, alpha=alpha, steps=steps)
    model = copy.deepcopy(base)
    PGD(model, epsilon=epsilon, alpha=alpha, steps=steps).step(lambda: model(**batch).loss)
    _assert_same_grads(_grads(model), _grads(ref))


@pytest.mark.parametrize("norm", ["example", "token"])
@pytest.mark.parametrize("method", ["fgm", "pgd"])
def test_example_and_token_norms_equal_a_plain_reference(norm, method):
    batch = _batch(token_cls_data())
    base = bert_token_cls()
    epsilon, alpha, steps = (0.5, 0.5, 1) if method == "fgm" else (0.5, 0.3, 3)
    ref = copy.deepcopy(base)
    output_space_reference(ref, batch, epsilon, alpha, steps, norm)
    model = copy.deepcopy(base)
    if method == "fgm":
        attack = FGM(model, epsilon=epsilon, norm=norm)
    else:
        attack = PGD(model, epsilon=epsilon, alpha=alpha, steps=steps, norm=norm)
    attack.step(lambda: model(**batch).loss)
    _assert_same_grads(_grads(model), _grads(ref))


def test_frozen_embeddings_are_still_attacked():
    batch = _batch(token_cls_data())
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    classic_fgm(ref, lambda: ref(**batch).loss, ref.bert.embeddings.word_embeddings.weight, epsilon=1.0)
    model = copy.deepcopy(base)
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    clean, adv = FGM(model, epsilon=1.0).step(lambda: model(**batch).loss)
    # The classic recipe needs the weight's gradient; ours only the output's, so the frozen model gets the same update.
    _assert_same_grads(_grads(model), _grads(ref), skip={"bert.embeddings.word_embeddings.weight"})
    assert adv > clean


def test_tied_embeddings_perturb_only_the_input_side():
    """Reference: an untied copy (decoder weight = a copy of the embedding) where the classic recipe perturbs only
    the input embedding; the tied weight's gradient is the sum of the two copies' gradients."""
    data = token_cls_data()
    batch = _batch(data)
    batch["labels"] = torch.where(batch["labels"] == -100, -100, batch["input_ids"])
    torch.manual_seed(0)
    tied = BertForMaskedLM(bert_config())
    assert tied.cls.predictions.decoder.weight is tied.bert.embeddings.word_embeddings.weight
    untied = BertForMaskedLM(bert_config(tie_word_embeddings=False))
    untied.load_state_dict(tied.state_dict())
    with torch.no_grad():
        untied.cls.predictions.decoder.weight.copy_(tied.bert.embeddings.word_embeddings.weight)
    classic_fgm(untied, lambda: untied(**batch).loss, untied.bert.embeddings.word_embeddings.weight, epsilon=1.0)

    FGM(tied, epsilon=1.0).step(lambda: tied(**batch).loss)
    ref = _grads(untied)
    emb, dec = "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"
    ref[emb] = ref[emb] + ref.pop(dec)
    # Both models tie the decoder bias to `cls.predictions.bias`; named_parameters lists it under either name.
    if "cls.predictions.decoder.bias" in ref:
        ref["cls.predictions.bias"] = ref.pop("cls.predictions.decoder.bias")
    _assert_same_grads(_grads(tied), ref)


def test_embedding_shared_by_encoder_and_decoder_is_perturbed_at_both():
    """BART looks the shared weight up in the encoder and the decoder (and ties lm_head to it): the reference unties
    only lm_head, so the classic recipe perturbs both lookups and nothing else."""
    batch = _batch(seq2seq_data())
    base = bart_lm()
    ref = copy.deepcopy(base)
    ref.lm_head.weight = nn.Parameter(ref.model.shared.weight.detach().clone())
    classic_fgm(ref, lambda: ref(**batch).loss, ref.model.shared.weight, epsilon=1.0)
    model = copy.deepcopy(base)
    attack = FGM(model, epsilon=1.0)
    assert len(attack.modules) == 3  # shared, encoder.embed_tokens, decoder.embed_tokens; not lm_head
    attack.step(lambda: model(**batch).loss)
    expected = _grads(ref)
    expected["model.shared.weight"] = expected["model.shared.weight"] + expected.pop("lm_head.weight")
    _assert_same_grads(_grads(model), expected)


def test_only_the_current_micro_batch_gradient_is_used():
    """Gradients already in `.grad` (earlier micro-batches) must not steer the attack; the classic recipe's would."""
    batch = _batch(token_cls_data())
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    classic_pgd(ref, lambda: ref(**batch).loss, ref.bert.embeddings.word_embeddings.weight, 1.0, 0.6, 3)
    model = copy.deepcopy(base)
    earlier = {n: torch.randn_like(p) * 10 for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = earlier[n].clone()
    PGD(model, epsilon=1.0, alpha=0.6, steps=3).step(lambda: model(**batch).loss)
    ours = {n: g - earlier[n] for n, g in _grads(model).items()}
    for name, grad in _grads(ref).items():
        # The pre-filled gradients are ~10x larger: their round-off sets the tolerance.
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_pgd_intermediate_passes_compute_no_parameter_gradient():
    batch = _batch(token_cls_data())
    model = bert_token_cls()
    computed = {n: 0 for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        p.register_hook(lambda grad, n=n: computed.__setitem__(n, computed[n] + 1))
    forwards = []

    def loss_fn():
        forwards.append(1)
        return model(**batch).loss

    PGD(model, epsilon=1.0, alpha=0.3, steps=3).step(loss_fn)
    assert len(forwards) == 4  # K + 1 passes
    assert set(computed.values()) == {2}, computed  # the clean and the last pass only


def test_adversarial_pass_builds_no_second_dense_embedding_gradient():
    """The stock embedding backward builds a dense vocab x dim gradient (aten::embedding_dense_backward); the
    adversarial pass adds its rows to the clean gradient sparsely instead, so only the clean pass builds one. The
    update itself is checked against the classic recipe above; here with ids repeated within the batch."""
    batch = _batch(token_cls_data())
    batch["input_ids"][:, 1:4] = batch["input_ids"][0, 1]  # one id at many positions: its row sums them
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    classic_fgm(ref, lambda: ref(**batch).loss, ref.bert.embeddings.word_embeddings.weight, epsilon=1.0)
    model = copy.deepcopy(base)
    with torch.profiler.profile() as prof:
        FGM(model, epsilon=1.0).step(lambda: model(**batch).loss)
    dense = [e for e in prof.events() if e.name == "aten::embedding_dense_backward"]
    # BERT has three embedding lookups (word, position, token type): 3 in the clean pass, 2 in the adversarial one.
    assert len(dense) == 5
    _assert_same_grads(_grads(model), _grads(ref))
    assert model.bert.embeddings.word_embeddings.weight.grad.layout == torch.strided


# ---- Skips, scaling, mixed precision --------------------------------------------------------------------------------


def test_zero_or_nonfinite_gradient_skips_the_attack():
    batch = _batch(token_cls_data())
    model = bert_token_cls()
    passes = []

    def loss_fn():
        passes.append(1)
        return model(**batch).loss

    clean, adv = FGM(model).step(lambda: loss_fn() * 0.0)
    assert adv is None and len(passes) == 1
    # An fp16-style overflow: the scaled loss is inf in float32, so is the gradient.
    passes.clear()
    clean, adv = PGD(model).step(loss_fn, backward=lambda loss: (loss * 1e39).backward())
    assert adv is None and len(passes) == 1
    torch.testing.assert_close(clean, model(**batch).loss)


def test_skipped_attack_still_ends_with_one_synced_backward():
    """Under DDP a rank that skips must still run the step's last (all-reducing) backward, or the others hang."""
    batch = _batch(token_cls_data())
    model = bert_token_cls()
    state = {"no_sync": False}
    backwards = []

    class NoSync:
        def __enter__(self):
            state["no_sync"] = True

        def __exit__(self, *exc):
            state["no_sync"] = False

    def backward(loss):
        backwards.append((state["no_sync"], float(loss.detach())))
        (loss * 1e39).backward()

    clean, adv = FGM(model).step(lambda: model(**batch).loss, backward, no_sync=NoSync)
    assert adv is None
    assert backwards == [(True, pytest.approx(float(clean))), (False, 0.0)]


def test_grad_scaler_scale_cancels_in_the_direction():
    batch = _batch(token_cls_data())
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    PGD(ref, steps=2).step(lambda: ref(**batch).loss)
    model = copy.deepcopy(base)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    PGD(model, steps=2).step(lambda: model(**batch).loss, grad_scaler=scaler)
    # A power-of-two scale is exact in float32, and the direction g / ||g|| does not see it.
    _assert_same_grads({n: g / 2.0**12 for n, g in _grads(model).items()}, _grads(ref))


def test_target_by_name_and_errors():
    model = bert_token_cls()
    assert FGM(model, target="word_embeddings").module is model.bert.embeddings.word_embeddings
    assert FGM(model, target="bert.embeddings.word_embeddings").module is model.bert.embeddings.word_embeddings
    with pytest.raises(ValueError, match="names no module"):
        FGM(model, target="wordembeddings")
    with pytest.raises(ValueError, match="ambiguous"):
        FGM(model, target="dense")
    with pytest.raises(ValueError, match="norm"):
        FGM(model, norm="l1")
    with pytest.raises(ValueError, match="steps"):
        PGD(model, steps=0)
    with pytest.raises(ValueError, match="epsilon"):
        FGM(model, epsilon=0.0)


# ---- In TricksTrainer -----------------------------------------------------------------------------------------------


def _train(tmp_path, model, data, grad_scaler=None, **overrides):
    kwargs = dict(max_steps=1, optim="sgd", learning_rate=0.5, weight_decay=0.0, train_sampling_strategy="sequential")
    kwargs.update(overrides)
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, **kwargs), train_dataset=data)
    if grad_scaler is not None:  # see the comment above test_trainer_with_grad_scaler_equals_classic_recipe
        trainer.accelerator.scaler = grad_scaler
    trainer.train()
    return trainer


def _classic_sgd_step(model, data, micro_batch, lr, max_grad_norm, attack):
    """The reference update: per micro-batch, the classic attack on `sum CE / (labels of the whole step)`; the
    gradients summed over micro-batches, clipped to `max_grad_norm`, one SGD step."""
    items = [data[i] for i in range(len(data))]
    total = sum(int((item["labels"] != -100).sum()) for item in items)
    for start in range(0, len(items), micro_batch):
        batch = default_data_collator(items[start : start + micro_batch])
        labels = batch.pop("labels")

        def loss_fn(batch=batch, labels=labels):
            logits = model(**batch).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum") / total

        # The classic recipe reads `.grad`, so it runs from zero grads; the micro-batches' results are summed.
        earlier = _grads(model)
        model.zero_grad()
        attack(model, loss_fn, model.bert.embeddings.word_embeddings.weight)
        for n, p in model.named_parameters():
            if n in earlier:
                p.grad += earlier[n]
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


# The classic attacks, as `_classic_sgd_step` runs them, beside the Trainer's `adversarial` value.
CLASSIC_ATTACKS = pytest.mark.parametrize(
    "method,attack",
    [
        ("fgm", lambda m, f, w: classic_fgm(m, f, w, epsilon=1.0)),
        ("pgd", lambda m, f, w: classic_pgd(m, f, w, epsilon=1.0, alpha=0.6, steps=3)),
    ],
)


def _assert_trainer_step_equals_classic(tmp_path, method, attack, max_grad_norm, grad_scaler=None):
    """One Trainer step on 2 micro-batches of 4 (label counts differ) against `_classic_sgd_step`."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    _classic_sgd_step(ref, data, micro_batch=4, lr=0.5, max_grad_norm=max_grad_norm, attack=attack)
    model = copy.deepcopy(base)
    _train(
        tmp_path,
        model,
        data,
        grad_scaler,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=max_grad_norm,
        adversarial=method,
        adv_epsilon=1.0,
        adv_alpha=0.6,
        adv_steps=3,
    )
    for name, p in ref.named_parameters():
        # Summation order differs (Trainer vs reference): float32 round-off only.
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)


@CLASSIC_ATTACKS
def test_trainer_step_equals_classic_recipe_with_accumulation_and_clipping(tmp_path, method, attack):
    """Clipping on: the Trainer clips the summed clean + adversarial gradient. The per-micro-batch attack uses that
    micro-batch's gradient only, as the reference does."""
    _assert_trainer_step_equals_classic(tmp_path, method, attack, max_grad_norm=0.5)


@pytest.mark.parametrize("norm", ["example", "token"])
def test_per_example_norms_make_accumulation_invariant(tmp_path, norm):
    """With per-example / per-token normalisation an example's perturbation depends on that example alone, so one
    step on 8 examples equals 4 x 2 and 2 x 4 micro-batches (not so for 'global', which normalises per batch)."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    settings = dict(adversarial="pgd", adv_norm=norm, adv_epsilon=0.5, adv_alpha=0.3, adv_steps=2)
    full = copy.deepcopy(base)
    _train(tmp_path / "a", full, data, per_device_train_batch_size=8, **settings)
    for bs, ga in [(4, 2), (2, 4)]:
        split = copy.deepcopy(base)
        _train(
            tmp_path / f"b{bs}",
            split,
            data,
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            **settings,
        )
        for name, p in full.named_parameters():
            # Summation order differs between the splits: float32 round-off only.
            torch.testing.assert_close(split.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=f"{name} {bs}x{ga}")


def test_trainer_logs_clean_and_adversarial_losses(tmp_path):
    model = bert_token_cls()
    trainer = _train(
        tmp_path,
        model,
        token_cls_data(n=16),
        max_steps=4,
        logging_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        adversarial="fgm",
    )
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2
    for entry in logs:
        # The logged `loss` (upstream's accumulation of what training_step returns) is the clean loss.
        assert entry["loss_clean"] == pytest.approx(entry["loss"], abs=2e-4)
        assert entry["loss_adv"] > entry["loss_clean"]
        assert entry["adv_skipped"] == 0


def test_trainer_counts_skipped_attacks(tmp_path):
    class ZeroLoss(TricksTrainer):
        def compute_tricks_loss(self, logits, labels, num_items_in_batch=None):
            return 0.0 * super().compute_tricks_loss(logits, labels, num_items_in_batch=num_items_in_batch)

    args = tricks_args(tmp_path, max_steps=2, adversarial="fgm", gradient_accumulation_steps=2)
    trainer = ZeroLoss(model=bert_token_cls(), args=args, train_dataset=token_cls_data(n=16))
    trainer.train()
    assert trainer.trick_state["adv_skipped"] == 4
    assert all("loss_adv" not in e for e in trainer.state.log_history)


def test_trainer_target_by_name_and_frozen_embeddings(tmp_path):
    data = token_cls_data(n=8)
    base = bert_token_cls()
    # No clipping: the frozen weight's gradient would otherwise count in the norm of one run only.
    settings = dict(per_device_train_batch_size=8, max_grad_norm=0.0, adversarial="fgm")
    by_default = copy.deepcopy(base)
    _train(tmp_path / "a", by_default, data, **settings)
    by_name = copy.deepcopy(base)
    by_name.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    _train(tmp_path / "b", by_name, data, adv_target="word_embeddings", **settings)
    for name, p in by_default.named_parameters():
        if name != "bert.embeddings.word_embeddings.weight":
            torch.testing.assert_close(by_name.get_parameter(name), p, msg=name)


def test_trainer_bf16_autocast_on_cpu(tmp_path):
    """Reference: the classic recipe under the same bf16 autocast. The fp32 result differs from it by ~5e-4, so
    matching it to float32 round-off shows the attack ran under autocast (the embedding output stays float32)."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    classic = lambda m, f, w: classic_fgm(m, f, w, epsilon=1.0)  # noqa: E731
    ref = copy.deepcopy(base)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _classic_sgd_step(ref, data, 8, 0.5, 0.0, classic)
    fp32 = copy.deepcopy(base)
    _classic_sgd_step(fp32, data, 8, 0.5, 0.0, classic)
    model = copy.deepcopy(base)
    _train(tmp_path, model, data, per_device_train_batch_size=8, max_grad_norm=0.0, bf16=True, adversarial="fgm")
    bf16_effect = 0.0
    for name, p in ref.named_parameters():
        # Same bf16 products; the gradients' summation order differs: float32 round-off.
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)
        bf16_effect = max(bf16_effect, float((fp32.get_parameter(name) - p).detach().abs().max()))
    assert bf16_effect > 1e-4


# Accelerate builds its fp16 GradScaler only on CUDA (on the CPU `--fp16` trains in fp32; tests/gpu cover CUDA). The
# Trainer's fp16 path past that point is device-independent: the scaled backward, the attack on scaled gradients,
# the scaler's unscale / skip inside the optimizer step and the skip count. Here a CPU GradScaler is handed to the
# accelerator before training (`_train(grad_scaler=...)`), so CI runs that path. (No clipping: Accelerate unscales
# before clipping only when it built the scaler for fp16 itself.)


@CLASSIC_ATTACKS
def test_trainer_with_grad_scaler_equals_classic_recipe(tmp_path, method, attack):
    """Reference: the unscaled classic recipe. A power-of-two scale is exact in float32 and cancels in g / ||g||; a
    backward that bypassed the scaler would be unscaled by 1/4096 in the optimizer step and fail here."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    _assert_trainer_step_equals_classic(tmp_path, method, attack, max_grad_norm=0.0, grad_scaler=scaler)
    assert scaler.get_scale() == 2.0**12  # no overflow: the step was taken, the scale kept


def test_trainer_with_grad_scaler_skips_and_counts_an_overflow_step(tmp_path):
    """The first micro-batch overflows (as an fp16 activation does): its attack is skipped and counted, the scaler
    skips the optimizer step and halves its scale; the next steps are attacked and applied."""
    model = bert_token_cls()
    calls = []

    def overflow_first_call(module, args, output):
        calls.append(1)
        return output * 1e39 if len(calls) == 1 else None  # inf in float32

    model.bert.encoder.layer[0].output.dense.register_forward_hook(overflow_first_call)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    settings = dict(max_steps=3, learning_rate=1e-3, max_grad_norm=0.0, adversarial="fgm")
    trainer = _train(tmp_path, model, token_cls_data(n=8), scaler, **settings)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["adv_skipped"] for h in logs] == [1, 1, 1]  # a running count
    assert "loss_adv" not in logs[0] and all(h["loss_adv"] > h["loss_clean"] for h in logs[1:])
    assert len(calls) == 1 + 2 + 2  # step 1: the clean pass only; steps 2 and 3: clean + adversarial
    assert trainer.accelerator.scaler.get_scale() == 2.0**11
    assert all(torch.isfinite(p).all() for p in model.parameters())
    changed = [name for name, p in model.named_parameters() if not torch.equal(before[name], p)]
    assert changed == list(before)  # steps 2 and 3 were applied


@pytest.mark.parametrize(
    "field,value",
    [("adversarial", "free"), ("adv_epsilon", 0.0), ("adv_alpha", -1.0), ("adv_steps", 0), ("adv_norm", "l1")],
)
def test_bad_adversarial_values_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        tricks_args(tmp_path, **{field: value})
