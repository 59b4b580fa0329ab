"""AWP, FreeLB, R-Drop and adv_start_step against the recipes written out here, standalone and in TricksTrainer."""

import copy
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator

from nlp_tricks import AWP, TricksTrainer, build_param_groups
from nlp_tricks.functional.adversarial import FreeLB, awp_parameters
from nlp_tricks.functional.losses import rdrop_kl, rdrop_loss
from tiny import bart_lm, bert_seq_cls, bert_token_cls, seq2seq_data, seq_cls_data, token_cls_data, tricks_args


def _batch(dataset):
    return default_data_collator([dataset[i] for i in range(len(dataset))])


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(ours, ref, **tolerance):
    assert set(ours) == set(ref)
    for name, grad in ref.items():
        torch.testing.assert_close(ours[name], grad, msg=name, **tolerance)


# ---- References: the recipes written out ----------------------------------------------------------------------------

# BERT's Linear weights inside its numbered layers, by hand: what AWP perturbs by default.
BERT_LAYER_LINEARS = re.compile(r"^bert\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|.*dense)\.weight$")


def awp_reference(model, loss_fn, gamma, names):
    """TorchBlocks' AWP without its clamp (and its 1e-6 guards): clean backward; every named weight with a non-zero
    gradient moves by gamma * ||w|| * g / ||g||; adversarial backward; the weights restored."""
    loss_fn().backward()
    backup = {}
    for name, p in model.named_parameters():
        if name in names and p.grad is not None and torch.norm(p.grad) != 0:
            backup[name] = p.data.clone()
            p.data.add_(p.grad * (gamma * torch.norm(p.data) / torch.norm(p.grad)))
    loss_fn().backward()
    for name, p in model.named_parameters():
        if name in backup:
            p.data = backup[name]


def freelb_reference(model, loss_fn, batch, alpha, steps, epsilon, init_mag, clean_pass):
    """FreeLB as the official code (huggingface-transformers/examples/run_glue_freelb.py) runs it, on
    `inputs_embeds`; `clean_pass` adds one clean forward/backward first (FreeLB#10)."""
    emb = model.get_input_embeddings()
    ids = batch["input_ids"]
    if clean_pass:
        loss_fn().backward()
    embeds_init = emb(ids)
    if init_mag > 0:
        input_mask = batch["attention_mask"].to(embeds_init)
        delta = torch.zeros_like(embeds_init).uniform_(-1, 1) * input_mask.unsqueeze(2)
        dims = input_mask.sum(1) * embeds_init.size(-1)
        delta = (delta * (init_mag / torch.sqrt(dims)).view(-1, 1, 1)).detach()
    else:
        delta = torch.zeros_like(embeds_init)
    for k in range(steps):
        delta.requires_grad_()
        loss = loss_fn(input_ids=None, inputs_embeds=delta + embeds_init) / steps
        loss.backward()
        if k == steps - 1:
            break
        grad = delta.grad.clone().detach()
        denorm = torch.clamp(torch.norm(grad.view(grad.size(0), -1), dim=1).view(-1, 1, 1), min=1e-8)
        delta = (delta + alpha * grad / denorm).detach()
        if epsilon > 0:
            delta_norm = torch.norm(delta.view(delta.size(0), -1).float(), p=2, dim=1).detach()
            exceed = (delta_norm > epsilon).to(embeds_init)
            delta = (delta * (epsilon / delta_norm * exceed + (1 - exceed)).view(-1, 1, 1)).detach()
        embeds_init = emb(ids)


def rdrop_formula(a, b, labels, alpha, num_items=None):
    """Liang et al. 2021, Eq. 3, per counted item, with the two KL divergences summed out over the classes."""
    keep = labels != -100
    a, b, y = a[keep].double(), b[keep].double(), labels[keep]
    log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
    nll = -(log_a.gather(1, y[:, None]) + log_b.gather(1, y[:, None])).squeeze(1)
    kl = (log_a.exp() * (log_a - log_b)).sum(-1) + (log_b.exp() * (log_b - log_a)).sum(-1)
    per_item = nll + alpha / 2 * kl
    return per_item.sum() / (num_items if num_items is not None else keep.sum())


def focal_sum(logits, labels, gamma=2.0):
    """-(1 - p_y)^gamma log p_y summed over the counted items."""
    keep = labels != -100
    log_p = logits[keep].float().log_softmax(-1).gather(1, labels[keep][:, None]).squeeze(1)
    return (-((1 - log_p.exp()) ** gamma) * log_p).sum()


class HalfDropout(nn.Module):
    """A deterministic stand-in for dropout (rate p): a fixed mask per (half of the batch, position, channel). R-Drop
    runs each batch doubled, so its two passes get different masks, and an example's masks do not depend on how the
    batch is split: the accumulation tests can be exact."""

    def __init__(self, p, salt):
        super().__init__()
        self.p, self.salt = p, salt

    def forward(self, x):
        if not self.training:
            return x
        half = (torch.arange(x.shape[0]) >= x.shape[0] // 2).long().view(-1, *[1] * (x.dim() - 1))
        where = torch.arange(x[0].numel()).reshape(x.shape[1:]).unsqueeze(0)
        keep = (where * 7919 + half * 104729 + self.salt * 31337) % 1000 >= 1000 * self.p
        return x * keep / (1 - self.p)


def with_half_dropout(model, p=0.1):
    """The model with each `nn.Dropout` of rate > 0 replaced by a HalfDropout of its own salt."""
    salt = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Dropout) and child.p > 0:
                salt += 1
                setattr(parent, name, HalfDropout(p, salt))
    return model


def bert_token_cls_dropout():
    return with_half_dropout(bert_token_cls(hidden_dropout_prob=0.1))


# ---- AWP ------------------------------------------------------------------------------------------------------------


def test_awp_default_target_is_the_layers_linear_weights():
    model = bert_token_cls()
    expected = {n for n, _ in model.named_parameters() if BERT_LAYER_LINEARS.search(n)}
    assert len(expected) == 2 * 6
    assert {n for n, _ in awp_parameters(model)} == expected
    assert {n for n, _ in awp_parameters(model, r"attention\.self\.query\.weight$")} == {
        f"bert.encoder.layer.{i}.attention.self.query.weight" for i in range(2)
    }
    with pytest.raises(ValueError, match="awp_target='nothing' matches no trainable parameter"):
        AWP(model, target="nothing")
    with pytest.raises(ValueError, match="gamma"):
        AWP(model, gamma=0.0)


@pytest.mark.parametrize("make_model,make_data", [(bert_token_cls, token_cls_data), (bert_seq_cls, seq_cls_data)])
def test_awp_equals_the_written_out_recipe(make_model, make_data):
    batch = _batch(make_data())
    base = make_model()
    names = {n for n, _ in base.named_parameters() if BERT_LAYER_LINEARS.search(n)}
    ref = copy.deepcopy(base)
    awp_reference(ref, lambda: ref(**batch).loss, 0.05, names)
    model = copy.deepcopy(base)
    clean, adv = AWP(model, gamma=0.05).step(lambda: model(**batch).loss)
    # The perturbation's scale is computed in another order than the reference's: float32 round-off.
    _assert_same_grads(_grads(model), _grads(ref), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clean, base(**batch).loss)
    assert adv > clean
    for name, p in base.named_parameters():  # restored bitwise
        assert torch.equal(model.get_parameter(name), p), name


def test_awp_uses_only_the_current_micro_batch_gradient():
    """Gradients already in `.grad` (earlier micro-batches) must not steer the perturbation."""
    batch = _batch(token_cls_data())
    base = bert_token_cls()
    names = {n for n, _ in base.named_parameters() if BERT_LAYER_LINEARS.search(n)}
    ref = copy.deepcopy(base)
    awp_reference(ref, lambda: ref(**batch).loss, 0.05, names)
    model = copy.deepcopy(base)
    earlier = {n: torch.randn_like(p) * 10 for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = earlier[n].clone()
    AWP(model, gamma=0.05).step(lambda: model(**batch).loss)
    ours = {n: g - earlier[n] for n, g in _grads(model).items()}
    # The pre-filled gradients are ~10x larger: their round-off sets the tolerance.
    _assert_same_grads(ours, _grads(ref), rtol=1e-4, atol=1e-5)


def test_awp_inside_one_autocast_region_uses_the_perturbed_weights():
    """Autocast caches its bf16 copy of each weight for the whole region: AWP drops the cache after perturbing, so a
    step run inside one region (as a user's loop may) equals the recipe with autocast entered per forward. Without
    that, the adversarial forward would multiply by the cached unperturbed copies."""
    batch = _batch(token_cls_data())
    base = bert_token_cls()
    names = {n for n, _ in base.named_parameters() if BERT_LAYER_LINEARS.search(n)}

    def loss_fn(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**batch).loss

    ref = copy.deepcopy(base)
    awp_reference(ref, lambda: loss_fn(ref), 0.05, names)
    model = copy.deepcopy(base)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        AWP(model, gamma=0.05).step(lambda: model(**batch).loss)
    _assert_same_grads(_grads(model), _grads(ref), rtol=1e-5, atol=1e-6)


def test_awp_skips_a_zero_or_nonfinite_gradient():
    batch = _batch(token_cls_data())
    model = bert_token_cls()
    before = copy.deepcopy(model.state_dict())
    passes = []

    def loss_fn():
        passes.append(1)
        return model(**batch).loss

    clean, adv = AWP(model).step(lambda: loss_fn() * 0.0)
    assert adv is None and len(passes) == 1
    passes.clear()
    clean, adv = AWP(model).step(loss_fn, backward=lambda loss: (loss * 1e39).backward())  # an fp16-like overflow
    assert adv is None and len(passes) == 1
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# ---- FreeLB ---------------------------------------------------------------------------------------------------------

FREELB_CASES = pytest.mark.parametrize(
    "alpha,steps,epsilon,init_mag,clean_pass",
    [
        (0.3, 3, 0.0, 0.0, True),  # zero start: the clean pass and pass 0 are one pass
        (0.3, 3, 0.4, 0.0, False),  # two steps of 0.3 leave the 0.4 ball: the projection matters
        (0.3, 2, 0.0, 0.5, True),  # random start under the attention mask, plus a clean pass
        (0.2, 3, 0.3, 0.5, False),
    ],
)


@FREELB_CASES
def test_freelb_equals_the_official_algorithm(alpha, steps, epsilon, init_mag, clean_pass):
    batch = _batch(token_cls_data())  # padded: the random start is masked and the lengths differ per example
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    torch.manual_seed(1)
    freelb_reference(ref, lambda **kw: ref(**{**batch, **kw}).loss, batch, alpha, steps, epsilon, init_mag, clean_pass)
    model = copy.deepcopy(base)
    forwards = []

    def loss_fn():
        forwards.append(1)
        return model(**batch).loss

    torch.manual_seed(1)
    attack = FreeLB(model, epsilon=epsilon, alpha=alpha, steps=steps, init_mag=init_mag, clean_pass=clean_pass)
    clean, adv = attack.step(loss_fn, attention_mask=batch["attention_mask"])
    # The passes' gradients are summed in another order (and with a zero start, (1 + 1/K) * loss is one backward
    # where the reference runs loss and loss / K): float32 round-off.
    _assert_same_grads(_grads(model), _grads(ref), rtol=1e-5, atol=1e-6)
    assert len(forwards) == steps + (clean_pass and init_mag > 0)
    assert adv > clean or init_mag > 0


def test_freelb_skips_on_a_nonfinite_gradient_and_still_syncs_once():
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
        backwards.append(state["no_sync"])
        (loss * 1e39).backward()

    clean, adv = FreeLB(model, steps=3).step(lambda: model(**batch).loss, backward, no_sync=NoSync)
    assert adv is None
    assert backwards == [True, False]  # pass 0 (unsynced), then the zero-weight synced pass


def test_freelb_arguments_are_checked():
    model = bert_token_cls()
    for kwargs, field in [({"epsilon": -1.0}, "epsilon"), ({"alpha": 0.0}, "alpha"), ({"init_mag": -1}, "init_mag")]:
        with pytest.raises(ValueError, match=field):
            FreeLB(model, **kwargs)


# ---- R-Drop: the loss function --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 5), (3, 6, 5)])
@pytest.mark.parametrize("num_items", [None, 40])
def test_rdrop_loss_equals_the_formula_values_and_gradients(shape, num_items):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(*shape, generator=g, requires_grad=True)
    b = torch.randn(*shape, generator=g, requires_grad=True)
    labels = torch.randint(0, 5, shape[:-1], generator=g)
    labels.view(-1)[::3] = -100
    ours = rdrop_loss(a, b, labels, alpha=0.7, num_items_in_batch=num_items)
    ref = rdrop_formula(a, b, labels, 0.7, num_items)  # in float64
    torch.testing.assert_close(ours, ref.float())
    grads = torch.autograd.grad(ours, (a, b))
    for ours_g, ref_g in zip(grads, torch.autograd.grad(ref, (a, b))):
        torch.testing.assert_close(ours_g, ref_g)
    assert grads[0][labels == -100].abs().sum() == 0  # ignored items get no gradient


def test_rdrop_kl_is_float32_and_symmetric_for_half_precision_logits():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 10, 9, generator=g).bfloat16().unbind(0)
    labels = torch.zeros(10, dtype=torch.long)
    kl = rdrop_kl(a, b, labels)
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl, rdrop_kl(b, a, labels))
    torch.testing.assert_close(kl, (rdrop_formula(a, b, labels, 1.0) - rdrop_formula(a, b, labels, 0.0)).float())


# ---- R-Drop in TricksTrainer ----------------------------------------------------------------------------------------


def test_trainer_rdrop_loss_is_the_formula_on_one_doubled_forward(tmp_path):
    """Real torch dropout: the same seed gives the same masks to the trainer's doubled forward and the reference's."""
    model = bert_token_cls(hidden_dropout_prob=0.2).train()
    batch = _batch(token_cls_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, rdrop_alpha=0.5, temperature=2.0))
    torch.manual_seed(3)
    ours = trainer.compute_loss(model, batch, num_items_in_batch=50)
    torch.manual_seed(3)
    doubled = {k: torch.cat([v, v]) for k, v in batch.items() if k != "labels"}
    a, b = (model(**doubled).logits / 2.0).chunk(2)
    assert not torch.equal(a, b)
    torch.testing.assert_close(ours, rdrop_formula(a, b, batch["labels"], 0.5, 50).float())


@pytest.mark.parametrize(
    "setting",
    [{}, {"loss_type": "focal", "focal_gamma": 2.0}, {"loss_type": "label_smoothing", "label_smoothing_factor": 0.2}],
)
def test_trainer_rdrop_replaces_ce_by_the_configured_loss_on_both_passes(tmp_path, setting):
    model = bert_token_cls_dropout().train()
    batch = _batch(token_cls_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, rdrop_alpha=0.5, **setting))
    ours = trainer.compute_loss(model, batch, num_items_in_batch=50)  # a sum over counted items / 50
    a, b = model(**{k: torch.cat([v, v]) for k, v in batch.items() if k != "labels"}).logits.chunk(2)
    labels = batch["labels"]
    keep = labels != -100
    if setting.get("loss_type") == "focal":
        per_pass = (focal_sum(a, labels) + focal_sum(b, labels)) / 50
    elif setting.get("loss_type") == "label_smoothing":
        per_pass = sum(F.cross_entropy(x[keep], labels[keep], label_smoothing=0.2, reduction="sum") for x in (a, b))
        per_pass = per_pass / 50
    else:
        per_pass = sum(F.cross_entropy(x[keep], labels[keep], reduction="sum") for x in (a, b)) / 50
    kl_only = rdrop_formula(a, b, labels, 0.5, 50) - rdrop_formula(a, b, labels, 0.0, 50)
    torch.testing.assert_close(ours, per_pass + kl_only.float())
    # Without num_items_in_batch: the mean per counted item, the same per-item sum.
    mean = trainer.compute_loss(model, batch)
    torch.testing.assert_close(mean * int(keep.sum()), ours * 50)


def test_trainer_rdrop_on_seq2seq_and_causal_lm(tmp_path):
    """BART: the formula on the doubled forward (decoder inputs doubled too). Causal LM: the KL is taken on the same
    logits and labels the loss is (whatever compute_loss's path hands compute_tricks_loss, e.g. shifted)."""
    bart = bart_lm(dropout=0.1).train()  # functional dropout: the same seed gives the same masks
    batch = _batch(seq2seq_data())
    trainer = TricksTrainer(model=bart, args=tricks_args(tmp_path / "bart", rdrop_alpha=1.0))
    torch.manual_seed(5)
    ours = trainer.compute_loss(bart, batch, num_items_in_batch=30)
    decoder_input_ids = bart.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    doubled = {k: torch.cat([v, v]) for k, v in batch.items() if k != "labels"}
    torch.manual_seed(5)
    logits = bart(**doubled, decoder_input_ids=torch.cat([decoder_input_ids] * 2)).logits
    torch.testing.assert_close(ours, rdrop_formula(*logits.chunk(2), batch["labels"], 1.0, 30).float())

    seen = []

    class Capturing(TricksTrainer):
        def compute_tricks_loss(self, logits, labels, num_items_in_batch=None):
            seen.append((logits, labels))
            return super().compute_tricks_loss(logits, labels, num_items_in_batch=num_items_in_batch)

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=32)).train()
    ids = torch.randint(0, 99, (4, 10), generator=torch.Generator().manual_seed(0))
    trainer = Capturing(model=gpt2, args=tricks_args(tmp_path / "gpt2", rdrop_alpha=1.0))
    ours = trainer.compute_loss(gpt2, {"input_ids": ids, "labels": ids.clone()}, num_items_in_batch=36)
    logits, labels = seen[0]
    assert logits.shape[0] == labels.shape[0] == 8  # the doubled batch
    assert torch.equal(labels, F.pad(ids[:, 1:], (0, 1), value=-100).repeat(2, 1))  # a causal LM's shifted labels
    a, b = logits.chunk(2)
    torch.testing.assert_close(ours, rdrop_formula(a, b, labels.chunk(2)[0], 1.0, 36).float())


def test_trainer_rdrop_where_it_cannot_apply(tmp_path, caplog):
    """A regression head trains on its own loss, once, with a warning naming rdrop_alpha (as for the other loss
    tricks); crf=True is refused."""
    model = bert_seq_cls(num_labels=1, hidden_dropout_prob=0.1).train()
    batch = _batch(seq_cls_data())
    batch["labels"] = batch["labels"].float()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, rdrop_alpha=1.0))
    calls = []
    handle = model.register_forward_hook(lambda module, args, output: calls.append(args))
    with caplog.at_level(logging.WARNING, logger="nlp_tricks.trainer"):
        torch.manual_seed(0)
        ours = trainer.compute_loss(model, batch)
    handle.remove()
    torch.manual_seed(0)
    torch.testing.assert_close(ours, model(**batch).loss)  # one forward of the batch as it is: its MSE
    assert len(calls) == 1 and "rdrop_alpha=1.0 cannot apply" in caplog.text
    with pytest.raises(ValueError, match="rdrop_alpha"):
        tricks_args(tmp_path, rdrop_alpha=1.0, crf=True)


def test_trainer_rdrop_refuses_a_model_without_dropout(tmp_path):
    trainer = TricksTrainer(
        model=bert_token_cls(), args=tricks_args(tmp_path, rdrop_alpha=1.0), train_dataset=token_cls_data()
    )
    with pytest.raises(ValueError, match="no active dropout"):
        trainer.train()


# ---- In TricksTrainer: one optimizer step against the recipes -------------------------------------------------------


def _train(tmp_path, model, data, grad_scaler=None, **overrides):
    kwargs = dict(max_steps=1, optim="sgd", learning_rate=0.5, weight_decay=0.0, train_sampling_strategy="sequential")
    kwargs.update(overrides)
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, **kwargs), train_dataset=data)
    if grad_scaler is not None:  # as in tests/test_adversarial.py: Accelerate builds its fp16 scaler on CUDA only
        trainer.accelerator.scaler = grad_scaler
    trainer.train()
    return trainer


def reference_sgd_step(
    model, data, micro_batch, attack, lr=0.5, max_grad_norm=0.0, loss="ce", layer_decay=1.0, bf16=False
):
    """Per micro-batch, `attack(model, loss_fn, batch)` on `sum loss / (labels of the whole step)`, from zero grads;
    the micro-batches' gradients summed, clipped, one SGD step at each parameter's lr (layer_decay: the lrs of
    build_param_groups, the optimizer groups under test in test_param_groups.py). bf16: each forward under bf16
    autocast, as Accelerate runs the model's forward."""
    items = [data[i] for i in range(len(data))]
    total = sum(int((item["labels"] != -100).sum()) for item in items)
    for start in range(0, len(items), micro_batch):
        batch = default_data_collator(items[start : start + micro_batch])
        labels = batch.pop("labels")

        def loss_fn(batch=batch, labels=labels, **overrides):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(**{**batch, **overrides}).logits.float()  # the loss in float32
            if loss == "focal":
                return focal_sum(logits, labels) / total
            flat = logits.reshape(-1, logits.shape[-1])
            return F.cross_entropy(flat, labels.reshape(-1), reduction="sum") / total

        earlier = _grads(model)
        model.zero_grad()
        attack(model, loss_fn, batch, labels, total)
        for n, p in model.named_parameters():
            if n in earlier:
                p.grad += earlier[n]
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    groups = build_param_groups(model, learning_rate=lr, weight_decay=0.0, layer_decay=layer_decay)
    lrs = {name: group["lr"] for group in groups for name in group["names"]}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p -= lrs[name] * p.grad


def _awp_attack(model, loss_fn, batch, labels, total):
    names = {n for n, _ in model.named_parameters() if BERT_LAYER_LINEARS.search(n)}
    awp_reference(model, loss_fn, 0.05, names)


def _freelb_attack(model, loss_fn, batch, labels, total):
    freelb_reference(model, loss_fn, batch, alpha=0.3, steps=3, epsilon=0.4, init_mag=0.0, clean_pass=True)


def _rdrop_attack(model, loss_fn, batch, labels, total):
    """No attack: the R-Drop loss on one doubled forward (HalfDropout masks: the same as the trainer's)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=torch.is_autocast_enabled("cpu")):
        a, b = model(**{k: torch.cat([v, v]) for k, v in batch.items()}).logits.chunk(2)
    rdrop_formula(a, b, labels, 0.5, total).float().backward()


FAMILY = {
    "awp": (dict(adversarial="awp", awp_gamma=0.05), _awp_attack),
    "freelb": (dict(adversarial="freelb", adv_alpha=0.3, adv_steps=3, adv_epsilon=0.4), _freelb_attack),
    "rdrop": (dict(rdrop_alpha=0.5), _rdrop_attack),
}


def _model_for(method):
    return bert_token_cls_dropout() if method == "rdrop" else bert_token_cls()


@pytest.mark.parametrize("method", list(FAMILY))
def test_trainer_step_equals_the_recipe_with_accumulation_and_clipping(tmp_path, method):
    """2 micro-batches of 4 (label counts differ); the Trainer clips the summed gradient."""
    settings, attack = FAMILY[method]
    data = token_cls_data(n=8)
    base = _model_for(method)
    ref = copy.deepcopy(base)
    reference_sgd_step(ref, data, micro_batch=4, attack=attack, max_grad_norm=0.5)
    model = copy.deepcopy(base)
    settings = dict(settings, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5)
    _train(tmp_path, model, data, **settings)
    for name, p in ref.named_parameters():
        # Summation order differs (Trainer vs reference): float32 round-off only.
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", ["freelb", "rdrop"])
def test_accumulation_is_exact_8_4x2_2x4(tmp_path, method):
    """FreeLB's norms are per example and R-Drop's loss is per item, so the step on 8 examples does not depend on
    the split. (AWP's per-tensor norms are of the micro-batch's gradient, so its step depends on the split by
    definition; the test above pins it per micro-batch.)"""
    settings, _ = FAMILY[method]
    data = token_cls_data(n=8)
    base = _model_for(method)
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


@pytest.mark.parametrize("method", list(FAMILY))
def test_trainer_with_grad_scaler_equals_the_recipe(tmp_path, method):
    """fp16's GradScaler path on the CPU, as tests/test_adversarial.py runs it for FGM / PGD: a power-of-two scale
    is exact in float32 and cancels in every direction (g / ||g||); a backward that bypassed the scaler would be
    unscaled by 1/4096 in the optimizer step and fail here."""
    settings, attack = FAMILY[method]
    data = token_cls_data(n=8)
    base = _model_for(method)
    ref = copy.deepcopy(base)
    reference_sgd_step(ref, data, micro_batch=4, attack=attack)
    model = copy.deepcopy(base)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    settings = dict(settings, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.0)
    _train(tmp_path, model, data, scaler, **settings)
    assert scaler.get_scale() == 2.0**12  # no overflow: the step was taken
    for name, p in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", list(FAMILY))
def test_trainer_bf16_autocast_on_cpu(tmp_path, method):
    """Reference: the recipe with each forward under bf16 autocast (its difference from float32, ~1e-4, would fail
    here). FreeLB without the clean pass: merged into pass 0, `(1 + 1/K) * loss` rounds differently in bf16 than the
    reference's two backwards."""
    settings, attack = FAMILY[method]
    if method == "freelb":
        settings = dict(settings, freelb_clean_pass=False)

        def attack(model, loss_fn, batch, labels, total):
            freelb_reference(model, loss_fn, batch, alpha=0.3, steps=3, epsilon=0.4, init_mag=0.0, clean_pass=False)

    data = token_cls_data(n=8)
    base = _model_for(method)
    ref = copy.deepcopy(base)
    if method == "rdrop":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference_sgd_step(ref, data, micro_batch=8, attack=attack)
    else:
        reference_sgd_step(ref, data, micro_batch=8, attack=attack, bf16=True)
    model = copy.deepcopy(base)
    _train(tmp_path, model, data, per_device_train_batch_size=8, max_grad_norm=0.0, bf16=True, **settings)
    for name, p in ref.named_parameters():
        # Same bf16 products; the gradients' summation order differs: float32 round-off.
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", list(FAMILY))
def test_composes_with_focal_loss_and_layer_wise_decay(tmp_path, method):
    settings, attack = FAMILY[method]
    data = token_cls_data(n=8)
    base = _model_for(method)
    ref = copy.deepcopy(base)
    if method == "rdrop":

        def attack(model, loss_fn, batch, labels, total):
            a, b = model(**{k: torch.cat([v, v]) for k, v in batch.items()}).logits.chunk(2)
            kl = rdrop_formula(a, b, labels, 0.5, total) - rdrop_formula(a, b, labels, 0.0, total)
            ((focal_sum(a, labels) + focal_sum(b, labels)) / total + kl.float()).backward()

    reference_sgd_step(ref, data, micro_batch=8, attack=attack, max_grad_norm=1.0, loss="focal", layer_decay=0.5)
    model = copy.deepcopy(base)
    settings = dict(settings, per_device_train_batch_size=8, max_grad_norm=1.0, loss_type="focal", layer_decay=0.5)
    _train(tmp_path, model, data, **settings)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_logs_each_method(tmp_path):
    logs = {}
    for method, (settings, _) in FAMILY.items():
        trainer = _train(
            tmp_path / method,
            _model_for(method),
            token_cls_data(n=8),
            max_steps=1,
            learning_rate=1e-3,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            **settings,
        )
        logs[method] = [e for e in trainer.state.log_history if "loss" in e]
    for method in ("awp", "freelb"):
        for entry in logs[method]:
            assert entry["loss_clean"] == pytest.approx(entry["loss"], abs=2e-4)
            assert entry["loss_adv"] > entry["loss_clean"] and entry["adv_skipped"] == 0
    assert all(entry["loss_kl"] > 0 for entry in logs["rdrop"])


# ---- adv_start_step -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["freelb"])
def test_steps_before_adv_start_step_are_plain_and_counted(tmp_path, method):
    """FreeLB, the method that diverges from step 0 (FreeLB#19); the check comes before any method's code, and the
    DDP test runs AWP with adv_start_step too."""
    data = token_cls_data(n=12)
    base = bert_token_cls()
    plain = copy.deepcopy(base)
    _train(tmp_path / "plain", plain, data, max_steps=2)
    delayed = copy.deepcopy(base)
    trainer = _train(tmp_path / "delayed", delayed, data, max_steps=3, adversarial=method, adv_start_step=2)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["adv_plain_steps"] for e in logs] == [1, 2, 2]
    assert ["loss_adv" in e for e in logs] == [False, False, True]
    # The first two steps were plain: a 2-step run stops at plain's weights exactly.
    early = copy.deepcopy(base)
    _train(tmp_path / "early", early, data, max_steps=2, adversarial=method, adv_start_step=2)
    for name, p in plain.named_parameters():
        assert torch.equal(early.get_parameter(name), p), name


# ---- Arguments ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("adversarial", "vat"),
        ("awp_gamma", 0.0),
        ("awp_target", "(unclosed"),
        ("adv_init_mag", -0.1),
        ("adv_start_step", -1),
        ("rdrop_alpha", -1.0),
    ],
)
def test_bad_values_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        tricks_args(tmp_path, **{field: value})


def test_freelb_allows_no_projection_but_fgm_does_not(tmp_path):
    assert tricks_args(tmp_path, adversarial="freelb", adv_epsilon=0.0).adv_epsilon == 0.0
    with pytest.raises(ValueError, match="adv_epsilon"):
        tricks_args(tmp_path, adversarial="fgm", adv_epsilon=0.0)
