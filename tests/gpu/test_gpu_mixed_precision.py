"""The tricks on CUDA in fp16 and bf16: adversarial steps against an fp32 reference, skipped overflow steps, float32
losses, scheduled sampling, and DataParallel (several GPUs).

Run with ``pytest tests/gpu`` on a machine with a GPU (``scripts/gpu_check.sh`` does); skipped without one.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nlp_tricks import FGM, PGD, TricksTrainer, focal_loss, label_smoothing_cross_entropy
from nlp_tricks.functional.losses import cross_entropy
from nlp_tricks.seq2seq import Seq2SeqTricksTrainer
from nlp_tricks.seq2seq.scheduled_sampling import scheduled_sampling_forward
from tiny import bart_lm, bert_token_cls, seq2seq_data, token_cls_data, tricks_args
from tiny_seq2seq import seq2seq_args

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
EPSILON, ALPHA, STEPS = 1.0, 0.3, 3
# Relative L2 error of the whole gradient against the fp32 reference. One rounding costs 2^-11 (fp16) or 2^-8 (bf16)
# of a value; through 2 layers and 2-4 passes the errors add up to 3e-4 (fp16) and 2.4e-3 (bf16) with CPU autocast
# (the dry run), and the bounds leave a margin of about 15x for CUDA's kernels. A missing unscale (x4096), a missing
# or doubled attack (checked below to move the gradient by far more than the bound: 0.7 here) or a perturbation in the
# wrong place all fail.
GRAD_RTOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


# ---- Helpers and the fp32 references (written out here, independent of nlp_tricks.functional.adversarial) ----


def token_batch(device, n=8):
    items = list(token_cls_data(n=n))
    inputs = {key: torch.stack([item[key] for item in items]).to(device) for key in ("input_ids", "attention_mask")}
    labels = torch.stack([item["labels"] for item in items]).to(device)
    return inputs, labels


def mean_ce(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten() for p in model.parameters()]
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def weight_space_fgm(model, loss_fn, epsilon):
    """The classic recipe: add ``epsilon * g / ||g||`` to the embedding weight, rerun, restore."""
    weight = model.get_input_embeddings().weight
    loss_fn().backward()
    backup = weight.data.clone()
    weight.data.add_(epsilon * weight.grad / weight.grad.norm())
    loss_fn().backward()
    weight.data = backup


def weight_space_pgd(model, loss_fn, epsilon, alpha, steps):
    """The classic PGD recipe on the embedding weight: ascend, project, restore the clean gradient before the last."""
    weight = model.get_input_embeddings().weight
    loss_fn().backward()
    backup = weight.data.clone()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for t in range(steps):
        weight.data.add_(alpha * weight.grad / weight.grad.norm())
        r = weight.data - backup
        if r.norm() > epsilon:
            r = epsilon * r / r.norm()
        weight.data = backup + r
        if t != steps - 1:
            model.zero_grad()
        else:
            for name, p in model.named_parameters():
                if name in grads:
                    p.grad = grads[name]
        loss_fn().backward()
    weight.data = backup


def poison_first_call(module: nn.Module):
    """Make ``module``'s first output overflow (x1e9: inf in fp16), as an fp16 activation overflow does."""
    calls = []

    def hook(mod, args, output):
        calls.append(output.dtype)
        return output * 1e9 if len(calls) == 1 else None

    module.register_forward_hook(hook)
    return calls


def record_output_dtypes(module: nn.Module) -> list:
    dtypes = []
    module.register_forward_hook(lambda mod, args, output: dtypes.append(output.dtype))
    return dtypes


def changed_parameters(before: dict, model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach().cpu())]


def snapshot(model: nn.Module) -> dict:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def training_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


# ---- Adversarial steps in fp16 (GradScaler) and bf16 against fp32 ---------------------------------------------------


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("method", ["fgm", "pgd"])
def test_mixed_precision_adversarial_step_matches_fp32_weight_space_recipe(device, precision, method):
    dtype = DTYPES[precision]
    inputs, labels = token_batch(device)
    reference = bert_token_cls().to(device)
    model = copy.deepcopy(reference)

    def reference_loss():
        return mean_ce(reference(**inputs).logits, labels)

    reference_loss().backward()
    clean = flat_grad(reference)
    reference.zero_grad()
    if method == "fgm":
        weight_space_fgm(reference, reference_loss, EPSILON)
        attack = FGM(model, epsilon=EPSILON)
    else:
        weight_space_pgd(reference, reference_loss, EPSILON, ALPHA, STEPS)
        attack = PGD(model, epsilon=EPSILON, alpha=ALPHA, steps=STEPS)
    expected = flat_grad(reference)
    # The attack moves the gradient far more than the tolerance, so the comparison below can catch a broken one.
    assert rel_err(2 * clean, expected) > 5 * GRAD_RTOL[dtype]

    scaler = torch.amp.GradScaler(device, init_scale=2.0**12) if precision == "fp16" else None
    logit_dtypes = []

    def loss_fn():
        with torch.autocast(device_type=device, dtype=dtype):
            logits = model(**inputs).logits
        logit_dtypes.append(logits.dtype)
        return mean_ce(logits, labels)

    clean_loss, adv_loss = attack.step(loss_fn, grad_scaler=scaler)
    assert set(logit_dtypes) == {dtype}, "autocast did not run the model in low precision"
    assert adv_loss is not None and math.isfinite(float(adv_loss)) and float(adv_loss) > float(clean_loss)
    got = flat_grad(model) / (scaler.get_scale() if scaler is not None else 1.0)
    assert torch.isfinite(got).all()
    err = rel_err(got, expected)
    assert err <= GRAD_RTOL[dtype], f"{precision} {method}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("method", ["fgm", "pgd"])
def test_fp16_overflow_step_skips_attack_and_optimizer_step(device, method):
    inputs, labels = token_batch(device)
    model = bert_token_cls().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    attack = FGM(model, epsilon=EPSILON) if method == "fgm" else PGD(model, epsilon=EPSILON, alpha=ALPHA, steps=STEPS)
    calls = poison_first_call(model.bert.encoder.layer[0].output.dense)

    def loss_fn():
        with torch.autocast(device_type=device, dtype=torch.float16):
            return mean_ce(model(**inputs).logits, labels)

    before = snapshot(model)
    clean_loss, adv_loss = attack.step(loss_fn, grad_scaler=scaler)
    assert calls == [torch.float16], "the overflowing step must run its clean pass only"
    assert adv_loss is None and not math.isfinite(float(clean_loss))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    assert changed_parameters(before, model) == []
    assert scaler.get_scale() == 2.0**11

    # The next step is attacked and applied as usual.
    clean_loss, adv_loss = attack.step(loss_fn, grad_scaler=scaler)
    assert adv_loss is not None and math.isfinite(float(adv_loss))
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**11
    assert changed_parameters(before, model) == [name for name, _ in model.named_parameters()]


def test_trainer_fp16_overflow_step_is_skipped_and_counted(device, cuda_only, tmp_path):
    model = bert_token_cls()
    calls = poison_first_call(model.bert.encoder.layer[0].output.dense)
    args = tricks_args(tmp_path, use_cpu=False, fp16=True, adversarial="fgm", max_steps=3)
    trainer = TricksTrainer(model=model, args=args, train_dataset=token_cls_data())
    trainer.train()
    logs = training_logs(trainer)
    assert [h["adv_skipped"] for h in logs] == [1, 1, 1]
    assert "loss_adv" not in logs[0] and all(math.isfinite(h["loss_adv"]) for h in logs[1:])
    # Step 1: clean pass only (skipped attack); steps 2 and 3: clean + adversarial passes.
    assert len(calls) == 5 and set(calls) == {torch.float16}
    # The scaler skipped the optimizer step with inf/NaN gradients and halved its scale (default 2^16) once.
    assert trainer.accelerator.scaler.get_scale() == 2.0**15
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- The Trainer in fp16 / bf16 (--fp16 / --bf16 and Accelerate's --mixed_precision) ------------------------------


@pytest.mark.parametrize("precision, method", [("fp16", "fgm"), ("fp16", "pgd"), ("bf16", "fgm"), ("bf16", "pgd")])
def test_trainer_adversarial_in_mixed_precision(device, precision, method, tmp_path):
    if precision == "fp16" and device != "cuda":
        pytest.skip("Accelerate runs fp16 only on CUDA (on the CPU it silently trains in fp32)")
    model = bert_token_cls()
    dtypes = record_output_dtypes(model.classifier)
    before = snapshot(model)
    args = tricks_args(tmp_path, use_cpu=device == "cpu", adversarial=method, max_steps=3, **{precision: True})
    trainer = TricksTrainer(model=model, args=args, train_dataset=token_cls_data())
    assert trainer.accelerator.mixed_precision == precision
    assert (trainer.accelerator.scaler is not None) == (precision == "fp16")
    trainer.train()
    assert set(dtypes) == {DTYPES[precision]}
    passes = 2 if method == "fgm" else STEPS + 1
    assert len(dtypes) == 3 * passes
    logs = training_logs(trainer)
    assert len(logs) == 3
    for h in logs:
        assert h["adv_skipped"] == 0
        assert math.isfinite(h["loss_clean"]) and h["loss_adv"] > h["loss_clean"]
        assert h["loss"] == pytest.approx(h["loss_clean"], abs=1e-3)
    assert changed_parameters(before, model) == [name for name, _ in model.named_parameters()]


def test_accelerate_mixed_precision_env_selects_fp16(device, cuda_only, monkeypatch, tmp_path):
    # `accelerate launch --mixed_precision fp16` sets this variable; TrainingArguments read it.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    model = bert_token_cls()
    dtypes = record_output_dtypes(model.classifier)
    args = tricks_args(tmp_path, use_cpu=False, adversarial="fgm", max_steps=1)
    trainer = TricksTrainer(model=model, args=args, train_dataset=token_cls_data())
    assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.scaler is not None
    trainer.train()
    assert dtypes == [torch.float16, torch.float16]


# ---- Losses in float32 ----------------------------------------------------------------------------------------------


def reference_loss(loss_type, logits, labels):
    """float64 references: torch's cross-entropy, and the focal loss written out."""
    logits, keep = logits.double().flatten(0, 1), labels.flatten() != -100
    if loss_type == "ce":
        return F.cross_entropy(logits, labels.flatten(), ignore_index=-100)
    if loss_type == "label_smoothing":
        return F.cross_entropy(logits, labels.flatten(), ignore_index=-100, label_smoothing=0.1)
    log_p = torch.log_softmax(logits[keep], dim=-1).gather(1, labels.flatten()[keep].unsqueeze(1)).squeeze(1)
    return (-((1 - log_p.exp()) ** 2.0) * log_p).mean()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("loss_type", ["ce", "focal", "label_smoothing"])
def test_losses_are_float32_under_autocast(device, precision, loss_type, tmp_path):
    dtype = DTYPES[precision]
    g = torch.Generator().manual_seed(0)
    # Logits of a confident model: softmax in fp16 / bf16 would lose the small probabilities.
    logits = (8 * torch.randn(4, 16, 50, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, 50, (4, 16), generator=g).to(device)
    labels[:, 12:] = -100
    functions = {
        "ce": lambda: cross_entropy(logits, labels),
        "focal": lambda: focal_loss(logits, labels, gamma=2.0),
        "label_smoothing": lambda: label_smoothing_cross_entropy(logits, labels, epsilon=0.1),
    }
    extra = {"label_smoothing_factor": 0.1} if loss_type == "label_smoothing" else {}
    trainer = TricksTrainer(model=bert_token_cls(), args=tricks_args(tmp_path, loss_type=loss_type, **extra))
    expected = reference_loss(loss_type, logits.detach(), labels).float()
    with torch.autocast(device_type=device, dtype=dtype):
        for loss in (functions[loss_type](), trainer.compute_tricks_loss(logits, labels)):
            assert loss.dtype == torch.float32
            # float32 arithmetic on the exact low-precision logits: float32's tolerance
            torch.testing.assert_close(loss, expected)
            loss.backward()
    assert logits.grad.dtype == dtype and torch.isfinite(logits.grad).all()


# ---- Scheduled sampling ---------------------------------------------------------------------------------------------


def seq2seq_batch(model, device, n=4):
    items = list(seq2seq_data(n=n))
    inputs = {key: torch.stack([item[key] for item in items]).to(device) for key in ("input_ids", "attention_mask")}
    labels = torch.stack([item["labels"] for item in items]).to(device)
    inputs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=labels)
    return inputs, labels


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_scheduled_sampling_forward_under_autocast_matches_two_plain_passes(device, precision):
    dtype = DTYPES[precision]
    model = bart_lm().to(device).eval()
    dtypes = record_output_dtypes(model.lm_head)
    inputs, labels = seq2seq_batch(model, device)
    with torch.no_grad(), torch.autocast(device_type=device, dtype=dtype):
        got = scheduled_sampling_forward(model, inputs, labels, ratio=0.0).logits
        # Reference: a full teacher-forced pass, its argmax fed back wherever the position and the one before it are
        # labelled (ratio 0 replaces every such position but the start token), then a full pass on that input.
        first = model(**inputs).logits
        labelled = labels != -100
        replace = torch.zeros_like(labelled)
        replace[:, 1:] = labelled[:, 1:] & labelled[:, :-1]
        shifted = torch.cat([inputs["decoder_input_ids"][:, :1], first[:, :-1].argmax(-1)], dim=1)
        mixed = torch.where(replace, shifted, inputs["decoder_input_ids"])
        expected = model(**{**inputs, "decoder_input_ids": mixed}).logits
    assert set(dtypes) == {dtype} and bool(replace.any()) and not torch.equal(mixed, inputs["decoder_input_ids"])
    # Same kernels on the same inputs; the encoder runs once instead of twice: equal up to kernel nondeterminism.
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_seq2seq_trainer_scheduled_sampling_in_mixed_precision(device, precision, tmp_path):
    if precision == "fp16" and device != "cuda":
        pytest.skip("Accelerate runs fp16 only on CUDA (on the CPU it silently trains in fp32)")
    model = bart_lm()
    dtypes = record_output_dtypes(model.lm_head)
    before = snapshot(model)
    args = seq2seq_args(
        tmp_path, use_cpu=device == "cpu", scheduled_sampling="linear", ss_k=2, max_steps=3, **{precision: True}
    )
    trainer = Seq2SeqTricksTrainer(model=model, args=args, train_dataset=seq2seq_data())
    trainer.train()
    logs = training_logs(trainer)
    # linear, k=2: ratio 1 - step / 2 at steps 0, 1, 2; pass 1 runs only below ratio 1.
    assert [h["teacher_forcing_ratio"] for h in logs] == [1.0, 0.5, 0.0]
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert set(dtypes) == {DTYPES[precision]} and len(dtypes) == 1 + 2 + 2
    assert changed_parameters(before, model) == [name for name, _ in model.named_parameters()]


# ---- DataParallel: one process, several GPUs (`python recipes/ner.py` on a multi-GPU machine) ---------------------


@pytest.fixture
def two_gpus(device):
    if device != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("DataParallel needs at least 2 CUDA devices")


@pytest.mark.parametrize("method", ["fgm", "pgd"])
def test_adversarial_step_through_data_parallel_matches_weight_space_recipe(device, two_gpus, method):
    inputs, labels = token_batch(device, n=8)
    reference = bert_token_cls().to(device)
    model = copy.deepcopy(reference)
    replicated = nn.DataParallel(model)

    def reference_loss():
        return mean_ce(reference(**inputs).logits, labels)

    if method == "fgm":
        weight_space_fgm(reference, reference_loss, EPSILON)
        attack = FGM(model, epsilon=EPSILON)
    else:
        weight_space_pgd(reference, reference_loss, EPSILON, ALPHA, STEPS)
        attack = PGD(model, epsilon=EPSILON, alpha=ALPHA, steps=STEPS)
    clean_loss, adv_loss = attack.step(lambda: mean_ce(replicated(**inputs).logits, labels))
    assert adv_loss is not None
    # fp32 everywhere; only the order of the replicas' gradient sums differs (float32 rounding, ~1e-7 relative)
    err = rel_err(flat_grad(model), flat_grad(reference))
    assert err <= 1e-4, f"DataParallel {method}: relative gradient error {err:.2e}"


def test_trainer_data_parallel_adversarial(device, two_gpus, tmp_path):
    model = bert_token_cls()
    before = snapshot(model)
    args = tricks_args(tmp_path, use_cpu=False, adversarial="pgd", max_steps=3, fp16=True)
    trainer = TricksTrainer(model=model, args=args, train_dataset=token_cls_data(n=16))
    assert trainer.args.n_gpu >= 2
    trainer.train()
    assert isinstance(trainer.model_wrapped, nn.DataParallel)
    logs = training_logs(trainer)
    assert [h["adv_skipped"] for h in logs] == [0, 0, 0]
    assert all(h["loss_adv"] > h["loss_clean"] for h in logs)
    assert changed_parameters(before, model) == [name for name, _ in model.named_parameters()]


def test_seq2seq_trainer_data_parallel_scheduled_sampling(device, two_gpus, tmp_path):
    # Pass 2 goes through the DataParallel wrapper with the encoder outputs, which it scatters like the other inputs.
    model = bart_lm()
    before = snapshot(model)
    args = seq2seq_args(
        tmp_path,
        use_cpu=False,
        scheduled_sampling="linear",
        ss_k=2,
        max_steps=3,
        bf16=True,
        per_device_train_batch_size=2,
    )
    trainer = Seq2SeqTricksTrainer(model=model, args=args, train_dataset=seq2seq_data(n=16))
    assert trainer.args.n_gpu >= 2
    trainer.train()
    assert isinstance(trainer.model_wrapped, nn.DataParallel)
    logs = training_logs(trainer)
    assert [h["teacher_forcing_ratio"] for h in logs] == [1.0, 0.5, 0.0]
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert changed_parameters(before, model) == [name for name, _ in model.named_parameters()]
