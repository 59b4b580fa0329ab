"""NEFTune with adversarial training: the clean pass draws upstream's noise, the adversarial passes reuse it, so the
update equals the classic recipe on embeddings carrying one fixed noise."""

import copy

import pytest
import torch
from torch import nn
from transformers import default_data_collator
from transformers.integrations.neftune import neftune_post_forward_hook

from classic_recipes import classic_fgm, classic_pgd
from nlp_tricks import FGM, PGD, TricksTrainer
from nlp_tricks.functional.neftune import NEFTuneNoise, neftune_noise
from tiny import tricks_args
from tiny_causal import CAUSAL_LMS, causal_lm_data, llama_lm

ALPHA = 5.0


def _batch(data):
    return default_data_collator([data[i] for i in range(len(data))])


def _upstream_hook(module, alpha):
    module.neftune_noise_alpha = alpha
    return module.register_forward_hook(neftune_post_forward_hook)


def test_first_pass_draws_upstreams_noise_and_later_passes_replay_it():
    emb = nn.Embedding(99, 16).train()
    ids = torch.randint(0, 99, (3, 7))
    torch.manual_seed(5)
    handle = _upstream_hook(emb, ALPHA)
    upstream = emb(ids)
    handle.remove()
    torch.manual_seed(5)
    with NEFTuneNoise(emb, ALPHA) as noise:
        noise.new_pass()
        first = emb(ids)
        noise.new_pass()
        second = emb(ids)
    assert torch.equal(first, upstream)
    assert torch.equal(second, first)
    magnitude = ALPHA / (7 * 16) ** 0.5
    assert 0 < (first - emb(ids)).abs().max() <= magnitude  # the hook is gone: emb(ids) is the plain lookup
    with NEFTuneNoise(emb, ALPHA):
        assert not torch.equal(emb(ids), first)  # a new micro-batch draws new noise
    with NEFTuneNoise(emb.eval(), ALPHA):
        assert torch.equal(emb(ids), emb.weight[ids])  # no noise outside training, as upstream


ATTACKS = {
    "fgm": (lambda m: FGM(m, epsilon=1.0), lambda m, f, w: classic_fgm(m, f, w, epsilon=1.0)),
    "pgd": (
        lambda m: PGD(m, epsilon=1.0, alpha=0.6, steps=3),
        lambda m, f, w: classic_pgd(m, f, w, epsilon=1.0, alpha=0.6, steps=3),
    ),
}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", list(ATTACKS))
@pytest.mark.parametrize("arch", list(CAUSAL_LMS))
def test_attack_with_neftune_equals_the_classic_recipe_on_fixed_noise(arch, method):
    """Reference: the classic weight-space recipe with one noise tensor N (upstream's draw at the same seed) added to
    the embedding output in every pass. GPT-2's tied lm_head is untied in the reference (input side only)."""
    ours_attack, classic = ATTACKS[method]
    model = CAUSAL_LMS[arch]().train()
    batch = _batch(causal_lm_data())
    ref = copy.deepcopy(model)
    weight = ref.get_input_embeddings().weight
    tied = ref.get_output_embeddings().weight is weight
    if tied:
        ref.lm_head.weight = nn.Parameter(weight.detach().clone())
    torch.manual_seed(11)
    fixed = neftune_noise(torch.zeros(*batch["input_ids"].shape, weight.shape[1]), ALPHA)
    ref.get_input_embeddings().register_forward_hook(lambda module, args, output: output + fixed)
    classic(ref, lambda: ref(**batch).loss, weight)
    want = _grads(ref)
    if tied:
        want["transformer.wte.weight"] = want["transformer.wte.weight"] + want.pop("lm_head.weight")

    def attack(model, noise_hook):
        torch.manual_seed(11)  # the noise is the forward's first random draw: the clean pass draws `fixed`
        with noise_hook(model.get_input_embeddings()) as noise:
            return ours_attack(model).step(noise.each_pass(lambda: model(**batch).loss))

    ours = copy.deepcopy(model)
    clean, adv = attack(ours, lambda emb: NEFTuneNoise(emb, ALPHA))
    got = _grads(ours)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert adv > clean

    # Upstream's hook alone (fresh noise per pass) does not give that update: the test can tell the two apart.
    fresh = copy.deepcopy(model)
    attack(fresh, lambda emb: _FreshNoise(emb))
    assert any(not torch.allclose(g, want[n]) for n, g in _grads(fresh).items())


class _FreshNoise:
    """Upstream's hook, as a context with NEFTuneNoise's interface."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.handle = _upstream_hook(self.module, ALPHA)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def each_pass(self, loss_fn):
        return loss_fn


def test_trainer_adversarial_passes_see_the_clean_pass_noise(tmp_path):
    """Recorded at the first decoder layer's input (= the embedding output in Llama): in every micro-batch the
    adversarial pass differs from the clean one by at most adv_epsilon per element (the perturbation), while the clean
    pass carries one NEFTune draw (nonzero, within alpha / sqrt(L d)). Fresh noise would differ by up to twice that."""
    model = llama_lm()
    epsilon = 1e-3
    ids, layer_inputs = [], []
    model.register_forward_pre_hook(lambda module, args, kwargs: ids.append(kwargs["input_ids"]), with_kwargs=True)

    def record(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        plain = model.get_input_embeddings().weight[ids[-1]]
        layer_inputs.append((hidden.detach().clone(), plain.detach().clone()))

    model.model.layers[0].register_forward_pre_hook(record, with_kwargs=True)
    args = tricks_args(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        neftune_noise_alpha=ALPHA,
        adversarial="fgm",
        adv_epsilon=epsilon,
    )
    trainer = TricksTrainer(model=model, args=args, train_dataset=causal_lm_data(n=8))
    trainer.train()
    assert len(layer_inputs) == 2 * 2 * 2  # steps x micro-batches x (clean, adversarial)
    magnitude = ALPHA / (12 * 32) ** 0.5
    for k in range(0, len(layer_inputs), 2):
        (clean, plain), (adv, plain_again) = layer_inputs[k], layer_inputs[k + 1]
        assert torch.equal(plain, plain_again)
        assert 0 < (adv - clean).abs().max() <= epsilon * (1 + 1e-4)
        noise = clean - plain
        assert 0.5 * magnitude < noise.abs().max() <= magnitude * (1 + 1e-4)
    assert not model.get_input_embeddings()._forward_hooks  # nothing left behind
    # Without --adversarial upstream's own NEFTune hook is used, untouched.
    plain_args = tricks_args(tmp_path, neftune_noise_alpha=ALPHA)
    assert TricksTrainer(model=llama_lm(), args=plain_args).neftune_noise_alpha == ALPHA
