"""Causal LMs: every loss scores the logits at t against the label at t + 1, as the model's own loss and upstream's
Trainer do; the item count is over the shifted labels; the collator's `shift_labels` are honoured."""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import transformers
from loss_cases import CHUNKED_LOSSES, EVERY_LOSS
from packaging.version import Version
from safetensors.torch import load_file
from scripts.causal_lm_ddp import SETTINGS as DDP_SETTINGS
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM, Trainer, TrainingArguments, default_data_collator

from classic_recipes import classic_fgm, classic_pgd
from nlp_tricks import FGM, PGD, Trick, TricksTrainer
from nlp_tricks.tricks.loss_type import LOSS_TABLE, LossFunction
from recipe_helpers import launch_ddp_script
from tiny import bart_lm, bert_token_cls, sgd_step_args, tricks_args
from tiny_causal import CAUSAL_LMS, causal_lm_data, gpt2_lm, llama_lm

STEP = dict(max_steps=1, optim="sgd", learning_rate=0.5, weight_decay=0.0, train_sampling_strategy="sequential")


def _batch(data):
    return default_data_collator([data[i] for i in range(len(data))])


def _plain_args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=4,
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
        **STEP,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _train(trainer_cls, args, model, data, collator=None):
    trainer = trainer_cls(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    return trainer


def _assert_same_params(model, ref, msg=""):
    for name, p in ref.named_parameters():
        # Summation order differs (micro-batches, loss code): float32 round-off only.
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=f"{name} {msg}")


def _shifted(labels):
    return labels[:, 1:]


# ---- The loss of one batch ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(CAUSAL_LMS))
def test_tricks_off_loss_equals_the_models_own_loss(tmp_path, arch):
    model = CAUSAL_LMS[arch]()
    batch = _batch(causal_lm_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path))
    assert trainer.loss_shifts_labels
    torch.testing.assert_close(trainer.compute_loss(model, batch), model(**batch).loss)
    n = int(_shifted(batch["labels"]).ne(-100).sum()) + 7  # as if the batch were part of a larger accumulated one
    torch.testing.assert_close(
        trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(n)),
        model(**batch, num_items_in_batch=torch.tensor(n)).loss,
    )


def _focal_reference(logits, labels, gamma):
    logp = logits.float().log_softmax(-1)
    valid = labels.ne(-100)
    logp_y = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (-((1 - logp_y.exp()) ** gamma) * logp_y)[valid].mean()


def _distillation_reference(student, teacher, labels, temperature, alpha):
    valid = labels.ne(-100)
    s, t = student[valid], teacher[valid]
    log_s, log_t = (s / temperature).log_softmax(-1), (t / temperature).log_softmax(-1)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1).mean()
    return alpha * temperature**2 * kl + (1 - alpha) * F.cross_entropy(s, labels[valid])


# Each loss on logits[:, :-1] against labels[:, 1:], written out with torch.
LOSS_CASES = {
    "ce": ({}, lambda x, y, t: F.cross_entropy(x.transpose(1, 2), y)),
    "focal": ({"loss_type": "focal", "focal_gamma": 2.0}, lambda x, y, t: _focal_reference(x, y, 2.0)),
    "label_smoothing": (
        {"loss_type": "label_smoothing", "label_smoothing_factor": 0.1},
        lambda x, y, t: F.cross_entropy(x.transpose(1, 2), y, label_smoothing=0.1),
    ),
    "temperature": ({"temperature": 2.0}, lambda x, y, t: F.cross_entropy(x.transpose(1, 2) / 2.0, y)),
    "distillation": (
        {"distill_temperature": 2.0, "distill_alpha": 0.7},
        lambda x, y, t: _distillation_reference(x, t, y, 2.0, 0.7),
    ),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_every_loss_is_taken_on_the_shifted_positions(tmp_path, case):
    settings, reference = LOSS_CASES[case]
    model = gpt2_lm()
    batch = _batch(causal_lm_data())
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    teacher = torch.randn_like(logits) if case == "distillation" else None
    if teacher is not None:
        batch["teacher_logits"] = teacher
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, **settings))
    ours = trainer.compute_loss(model, batch)
    shifted_teacher = None if teacher is None else teacher[:, :-1]
    want = reference(logits[:, :-1], _shifted(batch["labels"]), shifted_teacher)
    torch.testing.assert_close(ours, want)
    # And not the unshifted loss (the bug this guards against).
    unshifted = reference(logits, batch["labels"], teacher)
    assert not torch.allclose(ours, unshifted)


def test_the_loss_sees_the_models_logits_uncopied(tmp_path):
    """Labels are shifted, not logits sliced: the loss gets the (B, L, V) logits tensor the model returned."""
    seen = {}

    class Probe(TricksTrainer):
        def compute_tricks_loss(self, logits, labels, num_items_in_batch=None):
            seen["logits"], seen["labels"] = logits, labels
            return super().compute_tricks_loss(logits, labels, num_items_in_batch=num_items_in_batch)

    model = llama_lm()
    batch = _batch(causal_lm_data())
    loss, outputs = Probe(model=model, args=tricks_args(tmp_path)).compute_loss(model, batch, return_outputs=True)
    assert seen["logits"] is outputs.logits and seen["logits"].shape == (*batch["labels"].shape, 99)
    assert torch.equal(seen["labels"][:, :-1], _shifted(batch["labels"]))
    assert (seen["labels"][:, -1] == -100).all()


def test_not_shifted_for_encoder_decoder_and_token_classification(tmp_path):
    for model in (bart_lm(), bert_token_cls()):
        assert not TricksTrainer(model=model, args=tricks_args(tmp_path)).loss_shifts_labels


# ---- Training steps -------------------------------------------------------------------------------------------------


class CountRecorder(TricksTrainer):
    """Records the item count the Trainer hands to compute_loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.counts = getattr(self, "counts", []) + [int(num_items_in_batch)]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize("arch", list(CAUSAL_LMS))
def test_item_count_is_over_the_shifted_labels(tmp_path, arch):
    """Upstream counts `labels[..., 1:]` only for models whose `loss_type` is causal; GPT2LMHeadModel has none, so its
    count would include position 0. Here both count the shifted labels, hand-counted."""
    data = causal_lm_data(n=8)
    args = tricks_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, **STEP)
    trainer = _train(CountRecorder, args, CAUSAL_LMS[arch](), data)
    want = sum(int(data[i]["labels"][1:].ne(-100).sum()) for i in range(8))
    assert trainer.counts == [want, want]


@pytest.mark.parametrize("arch", list(CAUSAL_LMS))
def test_one_sgd_step_equals_the_models_own_loss_accumulated(tmp_path, arch):
    """Reference: per micro-batch, the model's own (shifted) loss normalised by the step's shifted label count."""
    data = causal_lm_data(n=8)
    base = CAUSAL_LMS[arch]()
    ref = copy.deepcopy(base)
    items = [data[i] for i in range(8)]
    total = torch.tensor(sum(int(item["labels"][1:].ne(-100).sum()) for item in items))
    for start in (0, 4):
        ref(**default_data_collator(items[start : start + 4]), num_items_in_batch=total).loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    model = copy.deepcopy(base)
    args = tricks_args(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.0, **STEP
    )
    _train(TricksTrainer, args, model, data)
    _assert_same_params(model, ref)


def test_one_sgd_step_equals_plain_trainer(tmp_path):
    """Llama: upstream's Trainer counts and shifts right for it, so it is the reference as it is (clipping on)."""
    data = causal_lm_data(n=8)
    base = llama_lm()
    ref = copy.deepcopy(base)
    settings = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5)
    _train(Trainer, _plain_args(tmp_path / "plain", **settings), ref, data)
    model = copy.deepcopy(base)
    _train(TricksTrainer, tricks_args(tmp_path / "tricks", **settings, **STEP), model, data)
    _assert_same_params(model, ref)


def test_label_smoothing_equals_upstreams_label_smoothing_factor(tmp_path):
    data = causal_lm_data(n=8)
    base = llama_lm()
    settings = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, label_smoothing_factor=0.1)
    if Version(transformers.__version__) < Version("5.15.0"):
        # Upstream's label smoothing divides by `num_items_in_batch` from transformers 5.15 on; before, it takes each
        # micro-batch's mean and is not exact under accumulation, so the reference there is one 8-sequence batch.
        settings.update(per_device_train_batch_size=8, gradient_accumulation_steps=1)
    ref = copy.deepcopy(base)
    _train(Trainer, _plain_args(tmp_path / "plain", **settings), ref, data)
    for loss_type in ("label_smoothing", "ce"):  # `ce` with label_smoothing_factor > 0 smooths too
        model = copy.deepcopy(base)
        _train(TricksTrainer, tricks_args(tmp_path / loss_type, loss_type=loss_type, **settings, **STEP), model, data)
        _assert_same_params(model, ref, loss_type)


# Every loss type of the table (tests/loss_cases.py).
ACCUMULATION_LOSSES = EVERY_LOSS


@pytest.mark.parametrize("loss", list(ACCUMULATION_LOSSES))
@pytest.mark.parametrize("arch", list(CAUSAL_LMS))
def test_accumulation_is_exact(tmp_path, arch, loss):
    """One step on 8 sequences equals 4 x 2 and 2 x 4 micro-batches (label counts differ per sequence)."""
    data = causal_lm_data(n=8)
    base = CAUSAL_LMS[arch]()
    settings = dict(ACCUMULATION_LOSSES[loss], **STEP)
    full = copy.deepcopy(base)
    _train(TricksTrainer, tricks_args(tmp_path / "full", per_device_train_batch_size=8, **settings), full, data)
    for bs, ga in [(4, 2), (2, 4)]:
        split = copy.deepcopy(base)
        args = tricks_args(
            tmp_path / f"{bs}x{ga}", per_device_train_batch_size=bs, gradient_accumulation_steps=ga, **settings
        )
        _train(TricksTrainer, args, split, data)
        _assert_same_params(split, full, f"{bs}x{ga}")


# ---- shift_labels from the collator -----------------------------------------------------------------------------


def packing_collator(features):
    """Stands for a padding-free collator: it gives `shift_labels`, here with the prediction across a sequence boundary
    in the middle of each row (position 5 -> 6) masked, which `labels[:, 1:]` alone cannot express."""
    batch = default_data_collator(features)
    shift = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    shift[:, 5] = -100
    batch["shift_labels"] = shift
    return batch


def test_collator_shift_labels_are_honoured(tmp_path):
    model = llama_lm()
    data = causal_lm_data(n=8)
    batch = packing_collator([data[i] for i in range(8)])
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = F.cross_entropy(logits.transpose(1, 2), batch["shift_labels"])  # written out
    torch.testing.assert_close(trainer.compute_loss(model, batch), want)
    torch.testing.assert_close(model(**batch).loss, want)  # the model's own loss honours them too


def test_collator_shift_labels_one_step_equals_plain_trainer(tmp_path):
    """Upstream counts the collator's `shift_labels` and the model's loss takes them: the same step here."""
    data = causal_lm_data(n=8)
    base = llama_lm()
    settings = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    ref = copy.deepcopy(base)
    _train(Trainer, _plain_args(tmp_path / "plain", **settings), ref, data, packing_collator)
    model = copy.deepcopy(base)
    trainer = _train(CountRecorder, tricks_args(tmp_path / "t", **settings, **STEP), model, data, packing_collator)
    items = [data[i] for i in range(8)]
    want = sum(int(packing_collator(items[s : s + 4])["shift_labels"].ne(-100).sum()) for s in (0, 4))
    assert trainer.counts == [want, want]
    _assert_same_params(model, ref)


# ---- FGM / PGD on decoder layouts -----------------------------------------------------------------------------------

ATTACKS = {
    "fgm": (lambda m: FGM(m, epsilon=1.0), lambda m, f, w: classic_fgm(m, f, w, epsilon=1.0)),
    "pgd": (
        lambda m: PGD(m, epsilon=1.0, alpha=0.6, steps=3),
        lambda m, f, w: classic_pgd(m, f, w, epsilon=1.0, alpha=0.6, steps=3),
    ),
}


@pytest.mark.parametrize("method", list(ATTACKS))
@pytest.mark.parametrize("arch", list(CAUSAL_LMS))
def test_attack_on_a_causal_lm_equals_the_classic_recipe_on_the_input_side(arch, method):
    """The attack perturbs `wte` / `embed_tokens` only. GPT-2 ties lm_head to it: the reference unties lm_head so that
    the classic recipe perturbs the input side alone, and the tied weight's gradient is the sum of the two."""
    ours_attack, classic = ATTACKS[method]
    model = CAUSAL_LMS[arch]()
    batch = _batch(causal_lm_data())
    ref = copy.deepcopy(model)
    weight = ref.get_input_embeddings().weight
    tied = ref.get_output_embeddings().weight is weight
    assert tied == (arch == "gpt2")
    if tied:
        ref.lm_head.weight = nn.Parameter(weight.detach().clone())
    classic(ref, lambda: ref(**batch).loss, weight)
    clean, adv = ours_attack(model).step(lambda: model(**batch).loss)
    want = {n: p.grad for n, p in ref.named_parameters()}
    if tied:
        want["transformer.wte.weight"] = want["transformer.wte.weight"] + want.pop("lm_head.weight")
    ours = {n: p.grad for n, p in model.named_parameters()}
    assert set(ours) == set(want)
    for name in want:
        torch.testing.assert_close(ours[name], want[name], msg=name)
    assert adv > clean


# ---- The lean loss paths: the model's own loss with tricks off, the chunked loss with a loss trick on -------------


class KeepFullLogits(Trick):
    needs_logits = True


def _record_forward_kwargs(model):
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    return seen


@pytest.mark.parametrize("arch", list(CAUSAL_LMS))
def test_tricks_off_the_model_gets_its_labels_and_computes_its_own_loss(tmp_path, arch):
    """As under plain Trainer: labels and the item count go to the model (so its own loss code, `logits_to_keep`
    and fused kernels apply); the loss is the model's, bit for bit."""
    model = CAUSAL_LMS[arch]()
    seen = _record_forward_kwargs(model)
    batch = _batch(causal_lm_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path))
    assert trainer.lm_loss_path == "model"
    n = torch.tensor(int(_shifted(batch["labels"]).ne(-100).sum()) + 7)
    loss = trainer.compute_loss(model, batch, num_items_in_batch=n)
    assert {"labels", "num_items_in_batch"} <= seen[-1]
    assert torch.equal(loss, model(**batch, num_items_in_batch=n).loss)
    # A trick that needs the logits, a loss trick, a subclass's own loss: the labels stay with TricksTrainer.
    for kwargs, path in (({"tricks": [KeepFullLogits()]}, "logits"), ({}, "chunked")):
        settings = {} if path == "logits" else {"loss_type": "focal"}
        assert TricksTrainer(model=model, args=tricks_args(tmp_path, **settings), **kwargs).lm_loss_path == path
    assert TricksTrainer(model=bert_token_cls(), args=tricks_args(tmp_path)).lm_loss_path is None


def _dft_reference(x, y):
    """-sg(p_y) log p_y per counted position, summed (Wu et al. 2025, Eq. 9)."""
    valid = y.ne(-100)
    log_p = x.float().log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (-log_p.detach().exp() * log_p)[valid].sum()


def _focal_sum(x, y, gamma=2.0):
    valid = y.ne(-100)
    log_p = x.float().log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (-((1 - log_p.exp()) ** gamma) * log_p)[valid].sum()


def _ce_sum(x, y, **kwargs):
    return F.cross_entropy(x.float().transpose(1, 2), y, reduction="sum", **kwargs)


# Each loss as a sum over the shifted positions, written out with torch. A loss type of the table without a formula
# here is compared with its own function on the full logits: the chunked path equals the full-logits path.
FORMULAS = {
    "ce": _ce_sum,
    "label_smoothing": lambda x, y: _ce_sum(x, y, label_smoothing=0.1),
    "focal": _focal_sum,
    "dft": _dft_reference,
}
# Every loss type whose function takes the chunks (chunked_lm_loss: plain "ce" too), and two compositions.
CHUNKED_CASES = {
    **{name: (dict(EVERY_LOSS[name], chunked_lm_loss=True), FORMULAS.get(name)) for name in CHUNKED_LOSSES},
    "ce_smoothed": ({"label_smoothing_factor": 0.2}, lambda x, y: _ce_sum(x, y, label_smoothing=0.2)),
    "temperature": ({"temperature": 2.0}, lambda x, y: _ce_sum(x / 2.0, y)),
}


def _full_logits_loss(trainer):
    """The run's loss type, its function on the full logits with the keywords the trainer gives it, as a sum."""
    loss = trainer.get_trick(LossFunction)
    function, keywords = LOSS_TABLE[loss.args.loss_type].function, loss.loss_keywords(trainer)
    return lambda x, y: function(x, y, reduction="sum", **keywords)


@pytest.mark.parametrize("case", list(CHUNKED_CASES))
@pytest.mark.parametrize("arch", list(CAUSAL_LMS))
def test_chunked_loss_and_gradients_equal_the_formula_on_the_full_logits(tmp_path, arch, case):
    """A training forward with a loss trick on: the loss from the last hidden state in chunks (4 tokens here, so a
    batch spans many), ignored positions skipped, equals the loss written out on logits[:, :-1] vs labels[:, 1:]
    and so do the gradients of every weight (GPT-2's head tied to its embeddings, Llama's untied)."""
    settings, reference = CHUNKED_CASES[case]
    base = CAUSAL_LMS[arch]()
    batch = _batch(causal_lm_data())
    n = torch.tensor(int(_shifted(batch["labels"]).ne(-100).sum()) + 3)
    model = copy.deepcopy(base).train()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, **settings))
    assert trainer.lm_loss_path == "chunked"
    reference = reference or _full_logits_loss(trainer)
    ref = copy.deepcopy(base)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    want = reference(ref(**inputs).logits[:, :-1], _shifted(batch["labels"])) / n
    want.backward()
    with mock.patch("nlp_tricks.functional.chunked_loss.CHUNK_ELEMENTS", 4 * 99):
        loss = trainer.compute_loss(model, batch, num_items_in_batch=n)
    loss.backward()
    # Float32 sums in another order (per chunk, per row): round-off only.
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_loss_keeps_no_full_logits(tmp_path):
    """What autograd keeps for the backward: with the chunked loss nothing of vocabulary width (the model's head saw
    the last position only, the chunks' logits are recomputed); on the full logits, the (B * L, V) logits."""
    batch = _batch(causal_lm_data())
    tokens, vocab = batch["input_ids"].numel(), 99
    kept = {}
    for name, tricks in (("chunked", []), ("logits", [KeepFullLogits()])):
        model = llama_lm().train()
        trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, loss_type="focal"), tricks=tricks)
        assert trainer.lm_loss_path == name
        shapes, weights = [], {p.data_ptr() for p in model.parameters()}

        def keep(tensor, shapes=shapes, weights=weights):
            if tensor.data_ptr() not in weights:  # activations only (a linear layer keeps its weight too)
                shapes.append(tensor.shape)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss, outputs = trainer.compute_loss(model, batch, True, torch.tensor(50))
        kept[name] = sum(shape.numel() for shape in shapes if shape and shape[-1] == vocab)
        assert (outputs.logits is None) == (name == "chunked")
    assert kept["logits"] >= tokens * vocab
    assert kept["chunked"] == 0


def test_a_model_that_changes_its_logits_after_the_head_falls_back_to_the_full_logits(tmp_path, caplog):
    """Gemma-2 soft-caps its logits (tanh(x / c) c): the chunked loss would score the head's raw output, so the first
    training forward sees the difference, warns once and takes this batch and the rest of the run on the full
    logits, which equal the loss written out on the model's (capped) logits."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5, pad_token_id=0,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).train()
    batch = _batch(causal_lm_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, loss_type="focal"))
    assert trainer.lm_loss_path == "chunked"
    n = torch.tensor(40)
    with caplog.at_level("WARNING"):
        loss = trainer.compute_loss(model, batch, num_items_in_batch=n)
    assert trainer.lm_loss_path == "logits"
    assert "logits are not its LM head's output" in caplog.text
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(loss, _focal_sum(logits[:, :-1], _shifted(batch["labels"])) / n)


class LogitPenalty(Trick):
    def adjust_loss(self, trainer, inputs, outputs, loss):
        return loss + 0.1 * outputs.logits.pow(2).mean()


def test_a_trick_reading_the_logits_keeps_them_and_one_that_says_it_does_not_need_them_does_not(tmp_path):
    model = llama_lm().train()
    batch = _batch(causal_lm_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, loss_type="focal"), tricks=[LogitPenalty()])
    assert trainer.lm_loss_path == "logits"
    trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(40))  # outputs.logits are there

    class ConstantTerm(Trick):
        needs_logits = False

        def adjust_loss(self, trainer, inputs, outputs, loss):
            return loss + 1.0

    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, loss_type="focal"), tricks=[ConstantTerm()])
    assert trainer.lm_loss_path == "chunked"
    for trick_settings in (
        {"rdrop_alpha": 1.0},
        {"scheduled_sampling": "linear", "ss_k": 100},
        {"smart_alpha": 1.0},
    ):
        path = TricksTrainer(model=model, args=tricks_args(tmp_path, **trick_settings)).lm_loss_path
        assert path == "logits", trick_settings


def test_liger_with_a_loss_trick_warns_once(tmp_path, caplog):
    trainer = TricksTrainer(model=llama_lm(), args=tricks_args(tmp_path, loss_type="focal"))
    trainer.args.use_liger_kernel = True  # set after building: the test needs no liger-kernel installed
    with caplog.at_level("WARNING"):
        assert trainer.lm_loss_path == "chunked"
        assert trainer.lm_loss_path == "chunked"
    assert caplog.text.count("Liger's fused linear cross-entropy runs only when the model computes its own loss") == 1
    assert "loss_type='focal'" in caplog.text


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch_ddp_script("causal_lm_ddp.py", tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DDP_SETTINGS))
def test_chunked_loss_under_ddp_equals_one_process(ddp_run, tmp_path, name):
    """2 processes x 2 micro-batches of 2 sequences (the head's weight used outside the DDP forward, its gradient
    all-reduced as every other) equal one process with the 8 sequences."""
    single = TricksTrainer(
        model=llama_lm(),
        args=sgd_step_args(tmp_path, per_device_train_batch_size=8, **DDP_SETTINGS[name]),
        train_dataset=causal_lm_data(n=8),
    )
    single.train()
    rank0 = load_file(str(ddp_run / f"{name}_rank0.safetensors"))
    rank1 = load_file(str(ddp_run / f"{name}_rank1.safetensors"))
    for key, value in single.model.state_dict().items():
        assert torch.equal(rank0[key], rank1[key]), f"{name}: {key} differs between ranks"
        # Summation order differs (per-rank partial sums, then the all-reduce): float32 round-off only.
        torch.testing.assert_close(rank0[key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def test_chunked_lm_loss_with_tricks_off_equals_the_models_own_loss(tmp_path):
    """`chunked_lm_loss`: cross-entropy in chunks instead of the model's own loss, the same loss and gradients."""
    base = llama_lm()
    batch = _batch(causal_lm_data())
    n = torch.tensor(int(_shifted(batch["labels"]).ne(-100).sum()))
    ref = copy.deepcopy(base)
    want = ref(**batch, num_items_in_batch=n).loss
    want.backward()
    model = copy.deepcopy(base).train()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, chunked_lm_loss=True))
    assert trainer.lm_loss_path == "chunked"
    loss = trainer.compute_loss(model, batch, num_items_in_batch=n)
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)  # float32 sums in another order
    for name, p in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_evaluation_chunks_only_when_no_logits_are_returned(tmp_path):
    """A prediction step that returns the loss only takes it in chunks (a mean over the batch, as on the full
    logits); one that returns predictions gets the model's full logits."""
    model = llama_lm().eval()
    batch = _batch(causal_lm_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, loss_type="focal"))
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    valid = int(_shifted(batch["labels"]).ne(-100).sum())
    want = _focal_sum(logits[:, :-1], _shifted(batch["labels"])) / valid
    loss, none, _ = trainer.prediction_step(model, batch, prediction_loss_only=True)
    assert none is None
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss, predicted, _ = trainer.prediction_step(model, batch, prediction_loss_only=False)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(predicted, logits)
