"""SMART (smart_alpha, ...) against Algorithm 1 of Jiang et al. 2020 written out here on ``inputs_embeds``,
standalone and in TricksTrainer: smart_alpha=0 is plain training bitwise, accumulation is exact, it composes with
FGM / PGD, R-Drop, NEFTune and SAM."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import default_data_collator

from nlp_tricks import Trick, TricksArguments
from nlp_tricks.functional.smart import SMART
from nlp_tricks.tricks.smart import SmoothnessRegularization
from tiny import bert_seq_cls, bert_token_cls, one_sgd_step_trainer, seq_cls_data, token_cls_data

SETTING = dict(epsilon=0.05, step_size=0.02, steps=2, noise_std=0.01)


def _batch(data, start=0, stop=None):
    return default_data_collator([data[i] for i in range(start, len(data) if stop is None else stop)])


def _sym_kl_sum(a, b, keep):
    """Sum over the kept items of KL(p || q) + KL(q || p), in float64."""
    log_p, log_q = a[keep].double().log_softmax(-1), b[keep].double().log_softmax(-1)
    return ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum()


def smart_reference(model, batch, labels, alpha, epsilon, step_size, steps, noise_std, total, offset=None):
    """Jiang et al. 2020, Algorithm 1 (lines 6-10, then the regularised loss), on `inputs_embeds`: x the
    word-embedding output (plus `offset`, a stand-in for NEFTune's noise), x~ = x + nu with nu ~ N(0, sigma^2), T_x
    steps of x~ <- Proj_{||x~ - x||_inf <= eps}(x~ + eta g / ||g||_inf), g the gradient at x~ of l_s(f(x), f(x~)) (per
    example), then CE + alpha * l_s(f(x), f(x~)) per counted item. Returns that loss (sum over items / total)."""
    rest = {k: v for k, v in batch.items() if k != "input_ids"}
    x = model.get_input_embeddings()(batch["input_ids"])
    if offset is not None:
        x = x + offset
    logits = model(inputs_embeds=x, **rest).logits
    keep = labels != -100
    noise = torch.randn(x.shape) * noise_std
    for _ in range(steps):
        noise.requires_grad_()
        adv = model(inputs_embeds=x.detach() + noise, **rest).logits
        (g,) = torch.autograd.grad(_sym_kl_sum(logits.detach(), adv, keep), noise)
        g_inf = g.abs().reshape(g.shape[0], -1).max(1).values.view(-1, 1, 1)
        noise = (noise.detach() + step_size * g / g_inf).clamp(-epsilon, epsilon)
    adv = model(inputs_embeds=x + noise, **rest).logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return (ce + alpha * _sym_kl_sum(logits, adv, keep).float()) / total


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ours, ref, **tolerance):
    assert set(ours) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(ours[name], value, msg=name, **tolerance)


# ---- The module -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_other_hook", [False, True])
def test_module_gradient_equals_algorithm_1(with_other_hook):
    """`with_other_hook`: a forward hook on the embeddings (as NEFTune's) adds an offset; SMART records x after it
    and sets it aside in its own forwards (else the offset would count twice, or the hook's state would move)."""
    data = seq_cls_data(n=6)
    base = bert_seq_cls()
    batch = _batch(data)
    labels = batch.pop("labels")
    offset = 0.05 * torch.randn(6, 12, 32) if with_other_hook else None
    ref, model = copy.deepcopy(base), copy.deepcopy(base)

    torch.manual_seed(7)
    smart_reference(ref, batch, labels, alpha=2.0, total=len(labels), offset=offset, **SETTING).backward()

    calls = []
    if with_other_hook:

        def other(module, args, output):
            calls.append(1)
            return output + offset

        model.get_input_embeddings().register_forward_hook(other)
    smart = SMART(model, **SETTING)
    torch.manual_seed(7)
    with smart.capture():
        logits = model(**batch).logits
    term = smart.loss(lambda: model(**batch).logits, logits, labels)
    (F.cross_entropy(logits, labels) + 2.0 * term).backward()
    assert term > 0
    assert len(calls) == (1 if with_other_hook else 0)
    # Float32 custom KL (ours) against float64 autograd (reference): round-off only.
    _assert_same(_grads(model), _grads(ref), rtol=1e-4, atol=1e-6)


def test_module_term_is_zero_without_perturbation_and_dropout():
    """A sanity bound of the reference itself: with sigma = 0 the gradient at x~ = x is 0, so delta stays 0."""
    model = bert_seq_cls()
    batch = _batch(seq_cls_data(n=4))
    labels = batch.pop("labels")
    smart = SMART(model, epsilon=0.1, step_size=0.1, steps=1, noise_std=0.0)
    with smart.capture():
        logits = model(**batch).logits
    assert smart.loss(lambda: model(**batch).logits, logits, labels) == 0


# ---- In TricksTrainer -----------------------------------------------------------------------------------------------


class RecordRNG(Trick):
    """Records the RNG state before each training forward: SMART draws its random start from there (dropout 0 draws
    nothing)."""

    def __init__(self):
        self.states = []

    def prepare_loss_batch(self, trainer, batch):
        if trainer.model.training:
            self.states.append(torch.get_rng_state())
        return batch


def _train(tmp_path, model, data, tricks=(), **overrides):
    trainer = one_sgd_step_trainer(tmp_path, model, data, tricks, **overrides)
    smart = trainer.get_trick(SmoothnessRegularization)
    if smart is not None:
        # The references' sigma: at the paper's 1e-5 the first ascent direction is a difference of nearly equal
        # logits, where float32 (the trainer) and float64 (the reference) round apart.
        smart.noise_std = SETTING["noise_std"]
    trainer.train()
    return trainer


TRAINER_SETTING = dict(smart_alpha=2.0, smart_epsilon=0.05, smart_step_size=0.02, smart_steps=2)


def _reference_sgd_step(model, data, micro_batch, states, lr=0.5):
    """Algorithm 1 per micro-batch (each from the RNG state the trainer had there), `sum / labelled tokens of the
    step`, gradients summed, one SGD step."""
    total = int(sum((data[i]["labels"] != -100).sum() for i in range(len(data))))
    for k, start in enumerate(range(0, len(data), micro_batch)):
        batch = _batch(data, start, start + micro_batch)
        labels = batch.pop("labels")
        torch.set_rng_state(states[k])
        smart_reference(model, batch, labels, alpha=2.0, total=total, **SETTING).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


@pytest.mark.parametrize("bs,ga", [(8, 1), (4, 2)])
def test_trainer_step_equals_algorithm_1(tmp_path, bs, ga):
    """Token classification (label counts differ per micro-batch): the term is per labelled token over the whole
    step, so accumulation is exact."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    model = copy.deepcopy(base)
    record = RecordRNG()
    trainer = _train(
        tmp_path,
        model,
        data,
        [record],
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        **TRAINER_SETTING,
    )
    assert len(record.states) == ga and trainer.trick_state["smart_skipped"] == 0
    ref = copy.deepcopy(base)
    _reference_sgd_step(ref, data, bs, record.states)
    for name, p in ref.named_parameters():
        # Float32 custom KL and summation order (ours) against float64 autograd (reference): round-off only.
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(model.classifier.weight, base.classifier.weight)


def test_smart_alpha_zero_is_plain_training_bitwise(tmp_path):
    data = token_cls_data(n=8)
    base = bert_token_cls(hidden_dropout_prob=0.1)
    plain, off = copy.deepcopy(base), copy.deepcopy(base)
    _train(tmp_path / "plain", plain, data, max_steps=2, per_device_train_batch_size=4)
    settings = dict(TRAINER_SETTING, smart_alpha=0.0)
    trainer = _train(tmp_path / "off", off, data, max_steps=2, per_device_train_batch_size=4, **settings)
    assert "SMART" not in {trick.state_name for trick in trainer.tricks}
    for name, p in plain.named_parameters():
        assert torch.equal(off.get_parameter(name), p), name


@pytest.mark.parametrize(
    "settings",
    [
        dict(adversarial="fgm"),
        dict(adversarial="pgd", adv_steps=2),
        dict(rdrop_alpha=1.0, model=dict(hidden_dropout_prob=0.1)),
        dict(neftune_noise_alpha=5.0, adversarial="fgm"),
        dict(sam_rho=0.05),
    ],
    ids=["fgm", "pgd", "rdrop", "neftune+fgm", "sam"],
)
def test_composes_with_the_other_tricks(tmp_path, settings):
    settings = dict(settings)
    model = bert_token_cls(**settings.pop("model", {}))
    trainer = _train(
        tmp_path,
        model,
        token_cls_data(n=8),
        max_steps=2,
        learning_rate=1e-3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        **TRAINER_SETTING,
        **settings,
    )
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2
    for entry in logged:
        assert entry["loss_smart"] > 0 and entry["smart_skipped"] == 0
        assert all(torch.isfinite(torch.tensor(v)) for v in entry.values() if isinstance(v, float))
        if "adversarial" in settings:
            assert entry["loss_adv"] > 0 and entry["adv_skipped"] == 0


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(smart_alpha=-1.0), r"^smart_alpha=-1\.0 is not allowed; it must be >= 0"),
        (dict(smart_alpha=1.0, smart_epsilon=0.0), r"^smart_epsilon=0\.0 is not allowed; it must be > 0"),
        (dict(smart_alpha=1.0, smart_step_size=-1.0), r"^smart_step_size=-1\.0 is not allowed"),
        (dict(smart_alpha=1.0, smart_steps=0), r"^smart_steps=0 is not allowed; it must be an integer >= 1"),
        (dict(smart_alpha=1.0, crf=True), r"^smart_alpha=1\.0 .* does not combine with crf=True"),
        (dict(smart_alpha=1.0, head_dropout_samples=4, head_dropout=0.5), r"not combine with head_dropout_samples=4"),
    ],
)
def test_bad_settings_name_the_field(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message) as info:
        TricksArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **settings)
    assert "\n" not in str(info.value)
