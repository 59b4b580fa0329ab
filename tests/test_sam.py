"""SAM / ASAM (sam_rho, sam_adaptive) against the classic implementations written out here, standalone and in
TricksTrainer: exact under gradient accumulation, under a grad scaler and bf16 autocast, skipped on inf."""

import copy
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from transformers import default_data_collator

from nlp_tricks import Trick, TricksArguments
from nlp_tricks.functional.sam import SAM
from tiny import bert_seq_cls, bert_token_cls, one_sgd_step_trainer, seq_cls_data, token_cls_data

# ---- References: the classic implementations written out ------------------------------------------------------------


class ClassicSAM(torch.optim.Optimizer):
    """The common SAM optimizer wrapper (davda54/sam, README usage): ``first_step`` moves each parameter by
    ``rho * g / (||g|| + 1e-12)`` after backing it up, the closure's backward takes the gradient there,
    ``second_step`` restores the weights and steps the base optimizer."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)

    @torch.no_grad()
    def first_step(self):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.norm(torch.stack([g.norm(p=2) for g in grads]))
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()

    def step(self, closure):
        closure = torch.enable_grad()(closure)
        closure()
        self.first_step()
        closure()
        self.second_step()


class ClassicASAM:
    """ASAM as its authors' code runs it (SamsungLabs/ASAM, asam.py): ``T = |w| + eta`` for parameters named
    "weight", 1 for the rest; the ascent ``rho * T^2 g / (||T g|| + 1e-16)``, subtracted again in ``descent_step``."""

    def __init__(self, optimizer, model, rho=0.5, eta=0.01):
        self.optimizer, self.model, self.rho, self.eta = optimizer, model, rho, eta
        self.state = defaultdict(dict)

    @torch.no_grad()
    def ascent_step(self):
        wgrads = []
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            t_w = self.state[p].get("eta")
            if t_w is None:
                t_w = torch.clone(p).detach()
                self.state[p]["eta"] = t_w
            if "weight" in n:
                t_w[...] = p[...]
                t_w.abs_().add_(self.eta)
                p.grad.mul_(t_w)
            wgrads.append(torch.norm(p.grad, p=2))
        wgrad_norm = torch.norm(torch.stack(wgrads), p=2) + 1.0e-16
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            t_w = self.state[p].get("eta")
            if "weight" in n:
                p.grad.mul_(t_w)
            eps = t_w
            eps[...] = p.grad[...]
            eps.mul_(self.rho / wgrad_norm)
            p.add_(eps)
        self.optimizer.zero_grad()

    @torch.no_grad()
    def descent_step(self):
        for p in self.model.parameters():
            if p.grad is None:
                continue
            p.sub_(self.state[p]["eta"])
        self.optimizer.step()
        self.optimizer.zero_grad()


def _batch(data, start=0, stop=None):
    return default_data_collator([data[i] for i in range(start, len(data) if stop is None else stop)])


def _assert_same_weights(model, ref, **tolerance):
    for name, p in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), p, msg=name, **tolerance)


# ---- The module -----------------------------------------------------------------------------------------------------


def test_module_equals_the_classic_sam_wrapper():
    data = seq_cls_data(n=8)
    base = bert_seq_cls()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    classic = ClassicSAM(ref.parameters(), torch.optim.SGD, rho=0.3, lr=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sam = SAM(model, rho=0.3)
    for step in range(2):
        batch = _batch(data, 4 * step, 4 * step + 4)
        classic.step(lambda batch=batch: ref(**batch).loss.backward())
        clean, sam_loss = sam.step([lambda batch=batch: model(**batch).loss])
        assert sam_loss is not None and sam_loss > clean
        optimizer.step()
        optimizer.zero_grad()
    # The classic's 1e-12 in the norm and the order of its products: float32 round-off only.
    _assert_same_weights(model, ref, rtol=1e-5, atol=1e-6)


def test_module_asam_equals_the_authors_code():
    data = seq_cls_data(n=8)
    base = bert_seq_cls()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    classic = ClassicASAM(ref_opt, ref, rho=1.0, eta=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sam = SAM(model, rho=1.0, adaptive=True)
    for step in range(2):
        batch = _batch(data, 4 * step, 4 * step + 4)
        ref(**batch).loss.backward()
        classic.ascent_step()
        ref(**batch).loss.backward()
        classic.descent_step()
        sam.step([lambda batch=batch: model(**batch).loss])
        optimizer.step()
        optimizer.zero_grad()
    # The authors subtract the step again (we restore bitwise) and add 1e-16: float32 round-off only.
    _assert_same_weights(model, ref, rtol=1e-5, atol=1e-6)


def test_module_unscales_restores_bitwise_and_skips_inf():
    model = bert_seq_cls()
    batch = _batch(seq_cls_data(n=4))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(**batch).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    sam = SAM(model, rho=0.2)
    assert sam.perturb()
    moved = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())
    sam.restore()
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    # The same gradients scaled by 2^12, unscaled by grad_scale: the same move.
    for n, p in model.named_parameters():
        p.grad = grads[n] * 2.0**12
    assert sam.perturb(grad_scale=2.0**12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), moved[n], rtol=1e-6, atol=1e-7, msg=n)
    sam.restore()
    # An inf (fp16 overflow): nothing moves, the gradients stay.
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    model.classifier.weight.grad[0, 0] = float("inf")
    assert not sam.perturb()
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert model.classifier.weight.grad is not None


# ---- In TricksTrainer -----------------------------------------------------------------------------------------------


def _train(tmp_path, model, data, grad_scaler=None, tricks=(), **overrides):
    trainer = one_sgd_step_trainer(tmp_path, model, data, tricks, **overrides)
    if grad_scaler is not None:  # Accelerate builds its fp16 scaler on CUDA only: the same path, on the CPU
        trainer.accelerator.scaler = grad_scaler
    trainer.train()
    return trainer


def _reference_step(model, data, rho, bf16=False):
    """The classic SAM wrapper on the whole batch of 8: `sum CE / labelled tokens`, forwards under bf16 autocast
    when `bf16` (as Accelerate runs the model's forward)."""
    batch = _batch(data)
    labels = batch.pop("labels")
    total = int((labels != -100).sum())

    def closure():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(**batch).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        (loss / total).backward()

    ClassicSAM(model.parameters(), torch.optim.SGD, rho=rho, lr=0.5).step(closure)


def test_trainer_step_is_exact_under_accumulation_8_4x2_2x4(tmp_path):
    """The ascent uses the step's whole gradient: 4 micro-batches of 2 (label counts differ) equal the classic SAM
    step on one batch of 8."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    _reference_step(ref, data, rho=0.5)
    for bs, ga in [(8, 1), (4, 2), (2, 4)]:
        model = copy.deepcopy(base)
        split = dict(per_device_train_batch_size=bs, gradient_accumulation_steps=ga)
        trainer = _train(tmp_path / f"{bs}", model, data, sam_rho=0.5, **split)
        assert trainer.trick_state["sam_skipped"] == 0
        # Summation order differs between the splits: float32 round-off only.
        _assert_same_weights(model, ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(model.classifier.weight, base.classifier.weight)


def test_trainer_with_grad_scaler_equals_the_reference(tmp_path):
    """fp16's GradScaler path on the CPU: the scale (a power of two, exact in float32) is divided out before the
    norm; a gradient left scaled would move the weights 4096 times too far and fail here."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    _reference_step(ref, data, rho=0.5)
    model = copy.deepcopy(base)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    _train(tmp_path, model, data, scaler, per_device_train_batch_size=4, gradient_accumulation_steps=2, sam_rho=0.5)
    assert scaler.get_scale() == 2.0**12  # no overflow: the step was taken
    _assert_same_weights(model, ref, rtol=1e-5, atol=1e-6)


def test_trainer_bf16_autocast_on_cpu(tmp_path):
    data = token_cls_data(n=8)
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    _reference_step(ref, data, rho=0.5, bf16=True)
    model = copy.deepcopy(base)
    _train(tmp_path, model, data, per_device_train_batch_size=8, bf16=True, sam_rho=0.5)
    # The moved weights differ from the reference's by float32 round-off, which a bf16 cast may round to the
    # neighbouring bf16 value: up to ~2e-6 here, against 3e-4 between this run and a float32 one.
    _assert_same_weights(model, ref, rtol=1e-5, atol=2e-5)


class InfLoss(Trick):
    """Makes the loss inf: every gradient inf / NaN, as an fp16 overflow."""

    def adjust_loss(self, trainer, inputs, outputs, loss):
        return loss * float("inf")


def test_trainer_skips_the_ascent_on_inf(tmp_path):
    data = token_cls_data(n=8)
    model = bert_token_cls()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    trainer = _train(
        tmp_path, model, data, scaler, tricks=[InfLoss()], per_device_train_batch_size=4, sam_rho=0.05, logging_steps=1
    )
    assert trainer.trick_state["sam_skipped"] == 1
    assert scaler.get_scale() < 2.0**12  # the scaler saw the inf and skipped the step
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_trainer_logs_loss_at_the_perturbed_weights(tmp_path):
    trainer = _train(
        tmp_path,
        bert_token_cls(),
        token_cls_data(n=8),
        max_steps=2,
        learning_rate=1e-3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        sam_rho=0.5,
        sam_adaptive=True,
    )
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2
    assert all(e["loss_sam"] > e["loss"] and e["sam_skipped"] == 0 for e in logged)


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(sam_rho=-0.1), r"^sam_rho=-0\.1 is not allowed; it must be >= 0"),
        (dict(sam_adaptive=True), r"^sam_adaptive=True needs sam_rho > 0"),
        (dict(sam_rho=0.05, adversarial="fgm"), r"^sam_rho=0\.05 and adversarial='fgm' each run the whole training"),
        (dict(sam_rho=0.05, optim="lomo"), r"^sam_rho=0\.05 runs several backward passes per step, but optim='lomo'"),
    ],
)
def test_bad_settings_name_the_field(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message) as info:
        TricksArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **settings)
    assert "\n" not in str(info.value)
