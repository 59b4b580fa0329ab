"""Scheduled sampling for decoder-only (causal) LMs, and one draw per micro-batch shared with the FGM / PGD passes."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel, default_data_collator, modeling_utils

from nlp_tricks import FGM, TricksArguments, TricksTrainer
from nlp_tricks.functional.scheduled_sampling import (
    causal_replacement_mask,
    causal_scheduled_sampling_forward,
    draw_predictions,
)
from nlp_tricks.seq2seq import Seq2SeqTricksTrainer
from tiny import VOCAB, ListDataset, bart_lm, bert_seq_cls, seq2seq_data, tricks_args
from tiny_causal import CAUSAL_LMS, gpt2_lm
from tiny_seq2seq import seq2seq_args

# Upstream's helper for a boolean `logits_to_keep` (transformers 5.21+); before it, pass 1 takes all logits.
slice_logits_to_keep = getattr(modeling_utils, "slice_logits_to_keep", None)
needs_slicing = pytest.mark.skipif(
    slice_logits_to_keep is None, reason="transformers < 5.21 has no slice_logits_to_keep: pass 1 takes all logits"
)

# ---- Tiny causal LMs and prompt + completion data -----------------------------------------------------------------


CAUSAL = CAUSAL_LMS


def causal_data(n=8, length=12, seed=0) -> ListDataset:
    """Prompt (labels -100), completion (labels = input_ids), right padding (attention 0, labels -100); lengths
    vary."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        ids = torch.randint(5, VOCAB, (length,), generator=g)
        prompt = 2 + i % 4
        end = length - i % 3
        labels = ids.clone()
        labels[:prompt] = -100
        labels[end:] = -100
        mask = torch.ones(length, dtype=torch.long)
        mask[end:] = 0
        ids[end:] = 0
        items.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return ListDataset(items)


def _batch(data):
    return default_data_collator([data[i] for i in range(len(data))])


def causal_loss(logits, labels):
    """The causal-LM loss written out: logits at t - 1 predict the label at t."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def reference_mixed_ids(model, batch):
    """Plain loops: completion position t >= 1 (label not -100) gets the argmax pass 1 predicted at t - 1."""
    with torch.no_grad():
        predicted = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    ids, labels = batch["input_ids"], batch["labels"]
    mixed = ids.clone()
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if labels[b, t] != -100:
                mixed[b, t] = predicted[b, t - 1]
    return mixed


class ModelInputs:
    """Records what each call of ``model`` receives, split by whether autograd was on (pass 2) or off (pass 1)."""

    def __init__(self, module, key="input_ids"):
        self.key = key
        self.grad, self.no_grad = [], []
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        value = kwargs.get(self.key, args[0] if args and self.key.endswith("input_ids") else None)
        value = None if value is None else value.detach().clone()
        (self.grad if torch.is_grad_enabled() else self.no_grad).append(value)


def _loss_and_grads(model, logits, labels):
    loss = causal_loss(logits, labels)
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


# ---- Mask ---------------------------------------------------------------------------------------------------------


def test_causal_mask_replaces_completion_tokens_only():
    labels = torch.tensor([[-100, -100, 7, 8, 9, -100], [5, 6, -100, 8, -100, -100]])
    # Allowed: t >= 1 whose own label is set (the prediction for it is made at t - 1, from the prompt's last token
    # for the completion's first token).
    allowed = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(causal_replacement_mask(labels, 0.0), allowed)
    assert not causal_replacement_mask(labels, 1.0).any()
    # Padding-free collators give shift_labels = labels[:, 1:]: the same positions.
    shift = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    assert torch.equal(causal_replacement_mask(labels, 0.0, shift_labels=shift), allowed)
    many = labels.repeat(2000, 1)
    mask = causal_replacement_mask(many, 0.3)
    assert not (mask & ~allowed.repeat(2000, 1)).any()
    # 10000 Bernoulli(0.7) draws: 5 standard deviations is 0.023.
    assert mask.sum().item() / allowed.repeat(2000, 1).sum().item() == pytest.approx(0.7, abs=0.023)


# ---- Two-pass forward ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CAUSAL))
def test_ratio_zero_feeds_exactly_the_pass1_predictions_at_completion_positions(name):
    """Pass 1 is teacher-forced; pass 2 reads the pass-1 argmax (made one position earlier) at every completion token
    and the gold token elsewhere; its loss and gradients are those of a plain forward on that input."""
    model = CAUSAL[name]()
    batch = _batch(causal_data())
    labels = batch["labels"]
    expected = reference_mixed_ids(model, batch)
    prompt_or_pad = labels.eq(-100)
    assert torch.equal(expected[prompt_or_pad], batch["input_ids"][prompt_or_pad])
    assert not torch.equal(expected, batch["input_ids"])  # the test can see a difference

    ref_loss, ref_grads = _loss_and_grads(
        model, model(input_ids=expected, attention_mask=batch["attention_mask"]).logits, labels
    )
    seen = ModelInputs(model)
    outputs = causal_scheduled_sampling_forward(model, _inputs(batch), labels, ratio=0.0)
    loss, grads = _loss_and_grads(model, outputs.logits, labels)
    seen.handle.remove()

    assert len(seen.no_grad) == 1 and len(seen.grad) == 1
    assert torch.equal(seen.no_grad[0], batch["input_ids"])
    assert torch.equal(seen.grad[0], expected)
    # The same computation on the same input: bit for bit.
    assert torch.equal(loss, ref_loss)
    assert ref_grads.keys() == grads.keys()
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n


@needs_slicing
@pytest.mark.parametrize("name", list(CAUSAL))
def test_pass1_projects_only_the_positions_it_feeds(name):
    """Pass 1 asks the model for the logits at t - 1 of each replaced t only (logits_to_keep): the vocabulary
    projection sees one row per replaced position, the prompt and the tokens kept gold cost nothing there."""
    model = CAUSAL[name]()
    batch = _batch(causal_data())
    rows = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: None if torch.is_grad_enabled() else rows.append(out.shape)
    )
    generator = torch.Generator().manual_seed(5)
    mask = causal_replacement_mask(batch["labels"], 0.5, generator=torch.Generator().manual_seed(5))
    causal_scheduled_sampling_forward(model, _inputs(batch), batch["labels"], 0.5, generator=generator)
    assert rows == [torch.Size([int(mask.sum()), VOCAB])]


class GPT2IgnoringLogitsToKeep(GPT2LMHeadModel):
    """Claims logits_to_keep (its module imports slice_logits_to_keep) but returns every position's logits."""

    def forward(self, *args, logits_to_keep=0, **kwargs):
        assert slice_logits_to_keep is not None
        return super().forward(*args, **kwargs)


@needs_slicing
def test_models_that_do_not_slice_the_logits_get_a_full_pass1():
    model = GPT2IgnoringLogitsToKeep(gpt2_lm().config)
    model.load_state_dict(gpt2_lm().state_dict())
    batch = _batch(causal_data())
    expected = reference_mixed_ids(model, batch)
    seen = ModelInputs(model)
    causal_scheduled_sampling_forward(model, _inputs(batch), batch["labels"], 0.0)
    assert torch.equal(seen.grad[0], expected)
    assert len(seen.no_grad) == 2  # the sliced call came back whole: pass 1 again, with all logits
    seen.no_grad.clear()
    causal_scheduled_sampling_forward(model, _inputs(batch), batch["labels"], 0.0)
    assert len(seen.no_grad) == 1  # and from then on directly


@pytest.mark.parametrize("name", list(CAUSAL))
def test_ratio_one_is_exactly_teacher_forcing(name):
    model = CAUSAL[name]()
    batch = _batch(causal_data())
    labels = batch["labels"]
    ref_loss, ref_grads = _loss_and_grads(model, model(**_inputs(batch)).logits, labels)
    seen = ModelInputs(model)
    outputs = causal_scheduled_sampling_forward(model, _inputs(batch), labels, ratio=1.0)
    loss, grads = _loss_and_grads(model, outputs.logits, labels)
    assert len(seen.no_grad) == 0  # pass 1 is skipped
    assert torch.equal(loss, ref_loss)
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n


@pytest.mark.parametrize("name", list(CAUSAL))
def test_soft_mode_feeds_the_expected_embedding_written_out(name):
    """Reference: at a replaced completion position t, softmax(pass-1 logits[t - 1] / T) @ E; embedding(gold)
    elsewhere. Values, the loss and the embedding weight's gradient must match; the function computes the product at
    the replaced positions only (sums in another order): float32 round-off."""
    model = CAUSAL[name]()
    batch = _batch(causal_data())
    labels = batch["labels"]
    embedding = model.get_input_embeddings()
    temperature = 2.0
    mask = causal_replacement_mask(labels, 0.5, generator=torch.Generator().manual_seed(3))
    assert mask.any() and not torch.equal(mask, causal_replacement_mask(labels, 0.0))
    with torch.no_grad():
        pass1 = model(**_inputs(batch)).logits
    expected = embedding(batch["input_ids"]).clone()
    for b in range(mask.shape[0]):
        for t in range(1, mask.shape[1]):
            if mask[b, t]:
                expected[b, t] = torch.softmax(pass1[b, t - 1] / temperature, -1) @ embedding.weight
    ref_loss = causal_loss(model(inputs_embeds=expected, attention_mask=batch["attention_mask"]).logits, labels)
    (ref_grad,) = torch.autograd.grad(ref_loss, embedding.weight)

    seen = ModelInputs(model, key="inputs_embeds")
    outputs = causal_scheduled_sampling_forward(
        model, _inputs(batch), labels, 0.5, mode="soft", temperature=temperature,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    loss = causal_loss(outputs.logits, labels)
    (grad,) = torch.autograd.grad(loss, embedding.weight)
    assert seen.no_grad == [None]  # pass 1 read the ids
    torch.testing.assert_close(seen.grad[0], expected)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)


def test_sample_mode_draws_with_the_generator_and_feeds_completion_positions_only():
    model = gpt2_lm()
    batch = _batch(causal_data())
    labels = batch["labels"]
    seen = ModelInputs(model)
    causal_scheduled_sampling_forward(model, _inputs(batch), labels, 0.0, mode="sample", temperature=5.0)
    mixed = seen.grad[0]
    prompt_or_pad = labels.eq(-100)
    assert torch.equal(mixed[prompt_or_pad], batch["input_ids"][prompt_or_pad])
    # At temperature 5 the samples are not the argmax everywhere.
    assert not torch.equal(mixed, reference_mixed_ids(model, batch))


# ---- Trainer ------------------------------------------------------------------------------------------------------


def _sgd(**extra):
    kw = dict(max_steps=1, optim="sgd", learning_rate=0.5, weight_decay=0.0, max_grad_norm=0.0)
    kw.update(extra)
    return kw


def _with_ids(data, mixed, key="input_ids"):
    return ListDataset([{**data[i], key: mixed[i]} for i in range(len(data))])


@pytest.mark.parametrize("name", list(CAUSAL))
def test_trainer_ratio_zero_step_equals_the_trainer_on_the_mixed_input(tmp_path, name):
    """Reference: the same TricksTrainer without scheduled sampling on the batch whose input_ids are the reference
    mixture (so the reference does not depend on how compute_loss takes the causal loss)."""
    base, data = CAUSAL[name](), causal_data()
    mixed = reference_mixed_ids(base, _batch(data))
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    TricksTrainer(model=ref, args=tricks_args(tmp_path / "a", **_sgd()), train_dataset=_with_ids(data, mixed)).train()
    args = tricks_args(tmp_path / "b", scheduled_sampling="constant", ss_k=0.0, **_sgd())
    trainer = TricksTrainer(model=ours, args=args, train_dataset=data)
    trainer.train()
    for n, p in ref.named_parameters():
        assert torch.equal(ours.get_parameter(n), p), n
    assert trainer.state.log_history[0]["teacher_forcing_ratio"] == 0.0


@pytest.mark.parametrize("name", list(CAUSAL))
def test_trainer_ratio_one_equals_the_plain_trainer(tmp_path, name):
    base, data = CAUSAL[name](), causal_data()
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    TricksTrainer(model=plain, args=tricks_args(tmp_path / "a", **_sgd()), train_dataset=data).train()
    args = tricks_args(tmp_path / "b", scheduled_sampling="constant", ss_k=1.0, **_sgd())
    TricksTrainer(model=ours, args=args, train_dataset=data).train()
    for n, p in plain.named_parameters():
        assert torch.equal(ours.get_parameter(n), p), n


def test_trainer_runs_it_on_a_lora_adapter(tmp_path):
    """A PeftModel is looked through (its loss shifts labels); pass 1 goes through the adapter, only LoRA trains."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(CAUSAL["llama"](), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = ModelInputs(model.get_base_model())
    args = tricks_args(tmp_path, scheduled_sampling="constant", ss_k=0.0, max_steps=1, learning_rate=0.1)
    TricksTrainer(model=model, args=args, train_dataset=causal_data(n=4)).train()
    assert len(seen.no_grad) == 1 and len(seen.grad) == 1
    assert not torch.equal(seen.grad[0], seen.no_grad[0])
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    # LoRA B starts at zero, so the first step moves B only (A's gradient is B^T times something).
    assert changed == {n for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n}


def test_trainer_refuses_models_scheduled_sampling_cannot_run(tmp_path):
    args = tricks_args(tmp_path, scheduled_sampling="linear", ss_k=10)
    with pytest.raises(ValueError, match="scheduled_sampling='linear' needs a decoder-only causal LM"):
        TricksTrainer(model=bert_seq_cls(), args=args)
    with pytest.raises(ValueError, match="use Seq2SeqTricksTrainer"):
        TricksTrainer(model=bart_lm(), args=args)
    with pytest.raises(ValueError, match="use TricksTrainer"):
        Seq2SeqTricksTrainer(model=gpt2_lm(), args=seq2seq_args(tmp_path, scheduled_sampling="linear", ss_k=10))


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"scheduled_sampling": "cosine"}, "scheduled_sampling"),
        ({"scheduled_sampling": "linear"}, "ss_k"),
        ({"scheduled_sampling": "inverse_sigmoid", "ss_k": 0.5}, "ss_k"),
        ({"ss_k": 0.5}, "ss_k"),
        ({"ss_min_ratio": 2.0}, "ss_min_ratio"),
        ({"ss_mode": "beam"}, "ss_mode"),
        ({"ss_temperature": -1.0}, "ss_temperature"),
    ],
)
def test_tricks_arguments_validate_the_scheduled_sampling_fields(tmp_path, fields, name):
    with pytest.raises(ValueError, match=name):
        tricks_args(tmp_path, **fields)


def test_scheduled_sampling_fields_are_defined_once():
    from dataclasses import fields

    from nlp_tricks.seq2seq import Seq2SeqTricksArguments

    ours = {f.name: f for f in fields(TricksArguments)}
    theirs = {f.name: f for f in fields(Seq2SeqTricksArguments)}
    for name in ("scheduled_sampling", "ss_k", "ss_min_ratio", "ss_mode", "ss_temperature"):
        assert theirs[name] is ours[name], name  # inherited, not redefined
        assert ours[name].metadata["help"], name


# ---- Adversarial training: one draw per micro-batch ---------------------------------------------------------------


def test_attack_ignores_forwards_without_autograd():
    """A no_grad forward inside loss_fn (scheduled sampling's pass 1) changes nothing: FGM's update equals FGM on
    the graded forward alone."""
    batch = _batch(causal_data())
    inputs, labels = _inputs(batch), batch["labels"]
    ref, ours = gpt2_lm(), gpt2_lm()
    FGM(ref, epsilon=1.0).step(lambda: causal_loss(ref(**inputs).logits, labels))

    def loss_fn():
        with torch.no_grad():
            ours(input_ids=inputs["input_ids"][:, :5])  # another shape: the hook would refuse it in perturb mode
        return causal_loss(ours(**inputs).logits, labels)

    FGM(ours, epsilon=1.0).step(loss_fn)
    for n, p in ref.named_parameters():
        assert torch.equal(ours.get_parameter(n).grad, p.grad), n


@pytest.mark.parametrize("method", ["fgm", "pgd"])
@pytest.mark.parametrize("mode", ["sample", "argmax"])
def test_causal_attack_perturbs_the_clean_pass_mixed_input(tmp_path, method, mode):
    """Every graded pass of one micro-batch (clean, PGD's intermediate ones, adversarial) reads the same mixed ids,
    and pass 1 ran once per micro-batch. Sampling at ratio 0.5 would draw other ids at each pass."""
    model, data = gpt2_lm(), causal_data(n=4)
    seen = ModelInputs(model)
    args = tricks_args(
        tmp_path, scheduled_sampling="constant", ss_k=0.5, ss_mode=mode, adversarial=method, adv_steps=2, max_steps=1,
        per_device_train_batch_size=4,
    )  # fmt: skip
    TricksTrainer(model=model, args=args, train_dataset=data).train()
    passes = 2 if method == "fgm" else 3
    assert len(seen.no_grad) == 1 and len(seen.grad) == passes
    assert not torch.equal(seen.grad[0], _batch(data)["input_ids"])
    for ids in seen.grad[1:]:
        assert torch.equal(ids, seen.grad[0])


def test_seq2seq_attack_perturbs_the_clean_pass_mixed_input(tmp_path):
    model, data = bart_lm(), seq2seq_data(n=4)
    seen = ModelInputs(model.get_decoder())
    args = seq2seq_args(
        tmp_path, scheduled_sampling="constant", ss_k=0.5, ss_mode="sample", adversarial="pgd", adv_steps=2,
        max_steps=1, per_device_train_batch_size=4,
    )  # fmt: skip
    Seq2SeqTricksTrainer(model=model, args=args, train_dataset=data).train()
    assert len(seen.no_grad) == 1 and len(seen.grad) == 3
    for ids in seen.grad[1:]:
        assert torch.equal(ids, seen.grad[0])


def test_causal_fgm_with_scheduled_sampling_equals_fgm_on_the_mixed_input(tmp_path):
    """Ratio 0, argmax: the step equals the same trainer's FGM step on the batch whose input_ids are the mixture.
    Before the draw was shared, the adversarial pass reran pass 1 under the attack and got another input."""
    base, data = gpt2_lm(), causal_data()
    mixed = reference_mixed_ids(base, _batch(data))
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    common = dict(adversarial="fgm", adv_epsilon=5.0, **_sgd())
    train = _with_ids(data, mixed)
    TricksTrainer(model=ref, args=tricks_args(tmp_path / "a", **common), train_dataset=train).train()
    args = tricks_args(tmp_path / "b", scheduled_sampling="constant", ss_k=0.0, **common)
    TricksTrainer(model=ours, args=args, train_dataset=data).train()
    for n, p in ref.named_parameters():
        assert torch.equal(ours.get_parameter(n), p), n


def seq2seq_reference_mixed_ids(model, batch):
    """Plain loops: decoder position t >= 1 gets the argmax predicted at t - 1 when labels t and t - 1 are set."""
    labels = batch["labels"]
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    with torch.no_grad():
        predicted = model(**_inputs(batch), decoder_input_ids=decoder_input_ids).logits.argmax(-1)
    mixed = decoder_input_ids.clone()
    for b in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            if labels[b, t] != -100 and labels[b, t - 1] != -100:
                mixed[b, t] = predicted[b, t - 1]
    return mixed


def test_seq2seq_fgm_with_scheduled_sampling_equals_fgm_on_the_mixed_input(tmp_path):
    base, data = bart_lm(), seq2seq_data(n=8)
    mixed = seq2seq_reference_mixed_ids(base, _batch(data))
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    common = dict(adversarial="fgm", adv_epsilon=5.0, **_sgd())
    train = _with_ids(data, mixed, key="decoder_input_ids")
    Seq2SeqTricksTrainer(model=ref, args=seq2seq_args(tmp_path / "a", **common), train_dataset=train).train()
    args = seq2seq_args(tmp_path / "b", scheduled_sampling="constant", ss_k=0.0, **common)
    Seq2SeqTricksTrainer(model=ours, args=args, train_dataset=data).train()
    for n, p in ref.named_parameters():
        # The encoder output is computed once and reused by pass 2 instead of inside one model call: round-off.
        torch.testing.assert_close(ours.get_parameter(n), p, rtol=1e-5, atol=1e-6, msg=n)


def test_sample_mode_draws_each_token_with_its_probability():
    """Reference: the probabilities themselves. 20000 draws per row; 5 standard deviations of a frequency p is
    5 * sqrt(p (1 - p) / 20000) <= 0.018. A token of probability 0 is never drawn; a seeded generator repeats."""
    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 20000
    logits = torch.log(p).expand(n, 2, 5).clone()  # log 0 = -inf: softmax gives it 0
    mask = torch.tensor([[False, True]]).repeat(n, 1)
    draw = draw_predictions(logits, mask, mode="sample", generator=torch.Generator().manual_seed(0))
    again = draw_predictions(logits, mask, mode="sample", generator=torch.Generator().manual_seed(0))
    assert torch.equal(draw.predictions, again.predictions)
    freq = torch.bincount(draw.predictions, minlength=5).float() / n
    torch.testing.assert_close(freq, p, atol=0.018, rtol=0)
    assert freq[1] == 0


def test_soft_mode_attack_perturbs_the_gold_positions_and_shares_the_expected_embeddings(tmp_path):
    """The attack perturbs the embedding module's output, i.e. the gold tokens' embeddings; the expected embeddings
    at the replaced positions come from the clean pass's probabilities in every pass, unperturbed."""
    model, data = gpt2_lm(), causal_data(n=4)
    seen = ModelInputs(model, key="inputs_embeds")
    args = tricks_args(
        tmp_path, scheduled_sampling="constant", ss_k=0.5, ss_mode="soft", adversarial="pgd", adv_steps=2,
        max_steps=1, per_device_train_batch_size=4,
    )  # fmt: skip
    ids = ModelInputs(model)
    TricksTrainer(model=model, args=args, train_dataset=data).train()
    assert seen.no_grad == [None] and len(seen.grad) == 3
    assert len(ids.no_grad) == 1  # pass 1 read the batch's ids (in the loader's order)
    clean = seen.grad[0]
    with torch.no_grad():  # the weights before the step: the attack's passes all ran on them
        gold = gpt2_lm().get_input_embeddings()(ids.no_grad[0])
    replaced = (clean - gold).abs().amax(-1) > 0
    assert replaced.any() and not replaced.all()
    for embeds in seen.grad[1:]:
        moved = (embeds - clean).abs().amax(-1) > 0
        assert torch.equal(embeds[replaced], clean[replaced])
        assert moved[~replaced].any()


def test_neftune_noise_is_shared_by_the_graded_passes_and_fresh_in_pass_1(tmp_path, monkeypatch):
    """With NEFTune, FGM and scheduled sampling: pass 1 (once, without autograd) gets its own noise; the clean and
    the adversarial pass 2 get the same noise. Replaying by call order would hand pass 1's noise to the adversarial
    pass 2, which does not run pass 1 again."""
    from nlp_tricks.functional.neftune import NEFTuneNoise

    added = []
    hook = NEFTuneNoise._hook

    def spy(self, module, args, output):
        result = hook(self, module, args, output)
        grad = torch.is_grad_enabled()
        # A graded call adds a recorded tensor (the one at the cursor); pass 1 adds fresh noise, not recorded.
        added.append((grad, self._noise[self._cursor - 1] if grad else (result - output).detach()))
        return result

    monkeypatch.setattr(NEFTuneNoise, "_hook", spy)
    args = tricks_args(
        tmp_path, scheduled_sampling="constant", ss_k=0.5, adversarial="fgm", neftune_noise_alpha=5.0, max_steps=1,
    )  # fmt: skip
    TricksTrainer(model=gpt2_lm(), args=args, train_dataset=causal_data(n=4)).train()
    assert [grad for grad, _ in added] == [False, True, True]
    pass1, clean, adversarial = (noise for _, noise in added)
    assert adversarial is clean
    assert clean.abs().max() > 0 and pass1.abs().max() > 0 and not torch.equal(pass1, clean)
