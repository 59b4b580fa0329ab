"""Losses against torch's own functions and against plain reference implementations written here."""

import copy

import pytest
import torch
import torch.nn.functional as F

from nlp_tricks import FocalLoss, LabelSmoothingCrossEntropy, focal_loss, label_smoothing_cross_entropy
from nlp_tricks.functional.chunked_loss import LMHeadLogits
from nlp_tricks.functional.losses import cross_entropy, dft_loss, distillation_loss, poly1_loss
from tiny import bert_token_cls, one_sgd_step_trainer, token_cls_data


def _data(shape=(6, 5), num_classes=7, ignore_frac=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, num_classes, generator=g) * 3
    labels = torch.randint(0, num_classes, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignore_frac] = -100
    return logits.requires_grad_(), labels


def _ce_reference(logits, labels, reduction, **kw):
    """F.cross_entropy over flattened items, reshaped like labels for reduction='none'."""
    out = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction=reduction, **kw)
    return out.reshape(labels.shape) if reduction == "none" else out


def _focal_reference(logits, labels, gamma, alpha=None, ignore_index=-100):
    """Per-item loop: -alpha_y (1 - p_y)^gamma log p_y, weighted mean."""
    flat, ys = logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1)
    total, weight = 0.0, 0.0
    for row, y in zip(flat, ys):
        if y == ignore_index:
            continue
        p = torch.softmax(row, -1)[y]
        a = 1.0 if alpha is None else alpha[y]
        total = total - a * (1 - p) ** gamma * torch.log(p)
        weight += a
    return total / weight


@pytest.mark.parametrize("shape", [(10,), (3, 5)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_focal_gamma0_equals_cross_entropy(shape, reduction):
    logits, labels = _data(shape)
    ours = focal_loss(logits, labels, gamma=0.0, reduction=reduction)
    ref = _ce_reference(logits, labels, reduction)
    torch.testing.assert_close(ours, ref)
    g_ours = torch.autograd.grad(ours.sum(), logits)[0]
    g_ref = torch.autograd.grad(ref.sum(), logits)[0]
    torch.testing.assert_close(g_ours, g_ref)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_focal_gamma0_alpha_equals_weighted_cross_entropy(reduction):
    logits, labels = _data((4, 6))
    alpha = torch.tensor([0.25, 1.0, 2.0, 0.5, 1.5, 1.0, 3.0])
    ours = focal_loss(logits, labels, gamma=0.0, alpha=alpha, reduction=reduction)
    torch.testing.assert_close(ours, _ce_reference(logits, labels, reduction, weight=alpha))


@pytest.mark.parametrize("gamma", [0.5, 2.0, 5.0])
def test_focal_matches_plain_reference(gamma):
    logits, labels = _data((4, 6))
    alpha = [0.25, 1.0, 2.0, 0.5, 1.5, 1.0, 3.0]
    # The reference runs in float64 and ours in float32: compare at float32 tolerance.
    torch.testing.assert_close(
        focal_loss(logits, labels, gamma=gamma), _focal_reference(logits, labels, gamma).float()
    )
    torch.testing.assert_close(
        focal_loss(logits, labels, gamma=gamma, alpha=alpha), _focal_reference(logits, labels, gamma, alpha).float()
    )


def test_focal_gradient_matches_autograd_of_reference():
    logits, labels = _data((8,), ignore_frac=0.0)
    ours = torch.autograd.grad(focal_loss(logits, labels, gamma=2.0), logits)[0]
    ref = torch.autograd.grad(_focal_reference(logits, labels, 2.0), logits)[0]
    torch.testing.assert_close(ours, ref.float())  # float64 reference, float32 tolerance


@pytest.mark.parametrize("shape", [(10,), (3, 5)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.5])
def test_label_smoothing_equals_torch(shape, reduction, epsilon):
    logits, labels = _data(shape)
    ours = label_smoothing_cross_entropy(logits, labels, epsilon=epsilon, reduction=reduction)
    ref = _ce_reference(logits, labels, reduction, label_smoothing=epsilon)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), logits)[0], torch.autograd.grad(ref.sum(), logits)[0])


def test_ignored_positions_contribute_nothing():
    logits, labels = _data((4, 6), ignore_frac=0.5)
    for fn in (
        lambda x: label_smoothing_cross_entropy(x, labels, epsilon=0.3, reduction="sum"),
        lambda x: focal_loss(x, labels, gamma=2.0, reduction="sum"),
    ):
        grad = torch.autograd.grad(fn(logits), logits)[0]
        assert grad[labels == -100].abs().max() == 0


def test_custom_ignore_index():
    logits, labels = _data((12,), ignore_frac=0.0)
    labels[:4] = 3
    torch.testing.assert_close(
        label_smoothing_cross_entropy(logits, labels, epsilon=0.2, ignore_index=3),
        F.cross_entropy(logits, labels, label_smoothing=0.2, ignore_index=3),
    )
    torch.testing.assert_close(
        focal_loss(logits, labels, gamma=0.0, ignore_index=3), F.cross_entropy(logits, labels, ignore_index=3)
    )


@pytest.mark.parametrize("fn", [focal_loss, label_smoothing_cross_entropy, cross_entropy, dft_loss, poly1_loss])
def test_num_items_in_batch_divides_the_sum(fn):
    logits, labels = _data((3, 5))
    ours = fn(logits, labels, num_items_in_batch=37)
    torch.testing.assert_close(ours, fn(logits, labels, reduction="sum") / 37)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_computed_in_float32(dtype):
    logits, labels = _data((3, 5))
    low = logits.detach().to(dtype)
    ref_input = low.float()
    out = label_smoothing_cross_entropy(low, labels, epsilon=0.1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.cross_entropy(ref_input.reshape(-1, 7), labels.reshape(-1), label_smoothing=0.1))
    out = focal_loss(low, labels, gamma=0.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.cross_entropy(ref_input.reshape(-1, 7), labels.reshape(-1)))


def test_modules_equal_functions():
    logits, labels = _data((3, 5))
    alpha = [1.0, 2.0, 0.5, 1.0, 1.0, 1.0, 0.1]
    torch.testing.assert_close(
        FocalLoss(gamma=1.5, alpha=alpha)(logits, labels), focal_loss(logits, labels, gamma=1.5, alpha=alpha)
    )
    torch.testing.assert_close(
        LabelSmoothingCrossEntropy(epsilon=0.2, reduction="sum")(logits, labels),
        F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), label_smoothing=0.2, reduction="sum"),
    )


def test_bad_arguments():
    logits, labels = _data((4,))
    with pytest.raises(ValueError, match="gamma"):
        focal_loss(logits, labels, gamma=-1)
    with pytest.raises(ValueError, match="alpha"):
        focal_loss(logits, labels, alpha=[1.0, 2.0])
    with pytest.raises(ValueError, match="epsilon"):
        label_smoothing_cross_entropy(logits, labels, epsilon=1.5)
    with pytest.raises(ValueError, match="reduction"):
        label_smoothing_cross_entropy(logits, labels, reduction="avg")
    with pytest.raises(ValueError, match="shape"):
        focal_loss(logits, labels[:2])


def _distill_reference(s, t, labels, T, alpha):
    """F.kl_div / F.cross_entropy over the non-ignored items."""
    keep = labels.reshape(-1) != -100
    s2, t2 = s.reshape(-1, s.shape[-1])[keep], t.reshape(-1, t.shape[-1])[keep]
    kl = F.kl_div(F.log_softmax(s2 / T, -1), F.log_softmax(t2 / T, -1), log_target=True, reduction="batchmean")
    return alpha * T * T * kl + (1 - alpha) * F.cross_entropy(s2, labels.reshape(-1)[keep])


@pytest.mark.parametrize("shape", [(10,), (3, 5)])
@pytest.mark.parametrize("T,alpha", [(1.0, 0.5), (2.0, 0.7), (4.0, 1.0), (3.0, 0.0)])
def test_distillation_matches_reference(shape, T, alpha):
    s, labels = _data(shape)
    t = torch.randn_like(s) * 2
    ours = distillation_loss(s, t, labels, temperature=T, alpha=alpha)
    ref = _distill_reference(s, t, labels, T, alpha)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad(ours, s)[0], torch.autograd.grad(ref, s)[0])
    n = int((labels != -100).sum())
    torch.testing.assert_close(
        distillation_loss(s, t, labels, temperature=T, alpha=alpha, num_items_in_batch=2 * n), ref / 2
    )


def test_distillation_without_labels_is_the_soft_term():
    s, _ = _data((6,))
    t = torch.randn_like(s)
    ref = 9.0 * F.kl_div(F.log_softmax(s / 3, -1), F.log_softmax(t / 3, -1), log_target=True, reduction="batchmean")
    torch.testing.assert_close(distillation_loss(s, t, temperature=3.0), ref)


def test_distillation_temperature_squared_keeps_gradients_comparable():
    """Hinton et al.: for zero-mean logits and large T, d(T^2 KL)/ds -> (s - t) / C per item, whatever T."""
    g = torch.Generator().manual_seed(1)
    C = 7
    s = torch.randn(16, C, generator=g)
    t = torch.randn(16, C, generator=g)
    s, t = (s - s.mean(-1, keepdim=True)).requires_grad_(), t - t.mean(-1, keepdim=True)
    limit = (s.detach() - t) / C / 16  # the batch mean divides by 16 items
    errors = []
    for T in (10.0, 20.0, 40.0):
        grad = torch.autograd.grad(distillation_loss(s, t, temperature=T), s)[0]
        errors.append(float((grad - limit).norm() / limit.norm()))
    # The limit is exact only as T -> inf: the relative error is first order in 1/T, so it halves as T doubles.
    assert errors[0] < 0.3 and errors[1] < 0.6 * errors[0] and errors[2] < 0.6 * errors[1], errors
    grads = [torch.autograd.grad(distillation_loss(s, t, temperature=T), s)[0].norm() for T in (2.0, 10.0)]
    assert 0.5 < float(grads[0] / grads[1]) < 2.0


# ---- DFT ---------------------------------------------------------------------------------------------------------


def _dft_reference(logits, labels, ignore_index=-100):
    """Per-item loop, in float64: the item's cross-entropy times its own probability held constant,
    -sg(p_y) log p_y (Wu et al. 2025, Eq. 9); the mean over counted items."""
    flat, ys = logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1)
    total, count = 0.0, 0
    for row, y in zip(flat, ys):
        if y == ignore_index:
            continue
        log_p = torch.log_softmax(row, -1)[y]
        total = total - log_p.detach().exp() * log_p
        count += 1
    return total / count


@pytest.mark.parametrize("shape", [(10,), (3, 5)])
def test_dft_equals_its_formula_in_value_and_gradient(shape):
    logits, labels = _data(shape)
    ours = dft_loss(logits, labels)
    (grad,) = torch.autograd.grad(ours, logits)
    ref_logits = logits.detach().double().requires_grad_()
    want = _dft_reference(ref_logits, labels)
    (want_grad,) = torch.autograd.grad(want, ref_logits)
    torch.testing.assert_close(ours, want.float())
    # d/dx of -sg(p) log p = p * (softmax - onehot): cross-entropy's gradient, scaled by the item's probability.
    torch.testing.assert_close(grad, want_grad.float())
    torch.testing.assert_close(
        dft_loss(logits, labels, num_items_in_batch=37), dft_loss(logits, labels, reduction="sum") / 37
    )
    per_item = dft_loss(logits, labels, reduction="none")
    assert per_item.shape == labels.shape and (per_item[labels == -100] == 0).all()


def test_dft_one_step_on_4_equals_2_x_2_accumulated(tmp_path):
    """Token classification (the configured loss_type): one SGD step on 4 sentences (different label counts) equals
    2 micro-batches of 2, as the loss is a sum over the step's item count."""
    _assert_4x1_equals_2x2(tmp_path, loss_type="dft")


def _assert_4x1_equals_2x2(tmp_path, **settings):
    base = bert_token_cls()
    runs = {}
    for bs, ga in ((4, 1), (2, 2)):
        model = copy.deepcopy(base)
        trainer = one_sgd_step_trainer(
            tmp_path / f"{bs}x{ga}", model, token_cls_data(n=4), per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga, **settings,
        )  # fmt: skip
        trainer.train()
        runs[(bs, ga)] = model
    changed = False
    for name, p in runs[(4, 1)].named_parameters():
        # Float32 sums in another order (two micro-batches): round-off only.
        torch.testing.assert_close(runs[(2, 2)].get_parameter(name), p, rtol=1e-5, atol=1e-7, msg=name)
        changed |= not torch.equal(p, base.get_parameter(name))
    assert changed


# ---- Poly-1 ------------------------------------------------------------------------------------------------------


def _poly1_reference(logits, labels, epsilon, smoothing=0.0, weight=None, reduction="mean"):
    """Poly-1 written out with torch.log_softmax (Leng et al. 2022, Eq. 3 and the appendix's label smoothing): per
    counted item CE(q) + epsilon * sum_c q_c (1 - p_c) with q = (1 - s) one_hot(y) + s / C, times w_y with class
    weights; the mean divides by the counted items' weights."""
    x, y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    num_classes = x.shape[-1]
    valid = y != -100
    log_p = torch.log_softmax(x, dim=-1)
    q = F.one_hot(y.clamp(min=0), num_classes).to(x.dtype) * (1 - smoothing) + smoothing / num_classes
    w = torch.ones(num_classes, dtype=x.dtype) if weight is None else torch.as_tensor(weight, dtype=x.dtype)
    # F.cross_entropy's weighting of a smoothed target: (1 - s) w_y (-log p_y) + s / C sum_c w_c (-log p_c).
    ce = (1 - smoothing) * w[y.clamp(min=0)] * -log_p.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
    ce = ce + smoothing / num_classes * (w * -log_p).sum(-1)
    poly = ce + epsilon * w[y.clamp(min=0)] * (q * (1 - log_p.exp())).sum(-1)
    poly = torch.where(valid, poly, 0.0)
    if reduction == "none":
        return poly.reshape(labels.shape)
    if reduction == "sum":
        return poly.sum()
    return poly.sum() / torch.where(valid, w[y.clamp(min=0)], 0.0).sum()


@pytest.mark.parametrize("shape", [(10,), (3, 5)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("epsilon", [1.0, 2.0, -1.0])
def test_poly1_equals_its_formula_in_value_and_gradient(shape, reduction, epsilon):
    logits, labels = _data(shape)
    ours = poly1_loss(logits, labels, epsilon=epsilon, reduction=reduction)
    ref_logits = logits.detach().double().requires_grad_()
    want = _poly1_reference(ref_logits, labels, epsilon, reduction=reduction)
    # The reference in float64, ours in float32: float32 tolerance.
    torch.testing.assert_close(ours, want.float())
    (grad,) = torch.autograd.grad(ours.sum(), logits)
    (want_grad,) = torch.autograd.grad(want.sum(), ref_logits)
    torch.testing.assert_close(grad, want_grad.float())
    if reduction == "none":
        assert (ours[labels == -100] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_poly1_with_label_smoothing_and_class_weights_equals_its_formula(reduction):
    logits, labels = _data((4, 6))
    weight = [0.25, 1.0, 2.0, 0.5, 1.5, 1.0, 3.0]
    ref_logits = logits.detach().double().requires_grad_()
    for kwargs in ({"label_smoothing": 0.2}, {"weight": weight}, {"label_smoothing": 0.1, "weight": weight}):
        ours = poly1_loss(logits, labels, epsilon=2.0, reduction=reduction, **kwargs)
        want = _poly1_reference(
            ref_logits, labels, 2.0, kwargs.get("label_smoothing", 0.0), kwargs.get("weight"), reduction
        )
        torch.testing.assert_close(ours, want.float(), msg=str(kwargs))
        (grad,) = torch.autograd.grad(ours, logits)
        (want_grad,) = torch.autograd.grad(want, ref_logits)
        torch.testing.assert_close(grad, want_grad.float(), msg=str(kwargs))


def test_poly1_at_epsilon_0_is_cross_entropy_exactly():
    """epsilon=0 adds nothing: bitwise the cross-entropy of the same statistics (label_smoothing_cross_entropy, with
    and without smoothing and class weights), values and gradients; and F.cross_entropy up to float round-off."""
    logits, labels = _data((3, 5))
    weight = torch.tensor([0.25, 1.0, 2.0, 0.5, 1.5, 1.0, 3.0])
    for smoothing, w in ((0.0, None), (0.1, None), (0.0, weight), (0.2, weight)):
        ours = poly1_loss(logits, labels, epsilon=0.0, label_smoothing=smoothing, weight=w)
        ce = label_smoothing_cross_entropy(logits, labels, epsilon=smoothing, weight=w)
        assert torch.equal(ours, ce), (smoothing, w)
        assert torch.equal(torch.autograd.grad(ours, logits)[0], torch.autograd.grad(ce, logits)[0])
        torch.testing.assert_close(ours, _ce_reference(logits, labels, "mean", label_smoothing=smoothing, weight=w))


def test_poly1_on_lm_head_logits_equals_the_full_logits():
    """In chunks from a linear head's input (3 rows a chunk), as the causal-LM path takes it: the loss and the
    gradients of the hidden states, the weight and the bias equal those on the materialised logits."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=g).requires_grad_()
    weight = torch.randn(11, 8, generator=g).requires_grad_()
    bias = torch.randn(11, generator=g).requires_grad_()
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :2] = -100
    kwargs = dict(epsilon=1.5, label_smoothing=0.1, weight=torch.rand(11, generator=g) + 0.5, num_items_in_batch=13)
    ours = poly1_loss(LMHeadLogits(hidden, weight, bias, chunk_size=3), labels, **kwargs)
    grads = torch.autograd.grad(ours, (hidden, weight, bias))
    full = poly1_loss(F.linear(hidden, weight, bias), labels, **kwargs)
    want_grads = torch.autograd.grad(full, (hidden, weight, bias))
    # Float32 sums in another order (per chunk): round-off only.
    torch.testing.assert_close(ours, full, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_poly1_one_step_on_4_equals_2_x_2_accumulated(tmp_path):
    """loss_type='poly1' with label smoothing and class weights on a token classifier: one SGD step on 4 sentences
    equals 2 micro-batches of 2 (the sum over the step's weighted item count)."""
    _assert_4x1_equals_2x2(
        tmp_path, loss_type="poly1", poly1_epsilon=2.0, label_smoothing_factor=0.1, class_weights=[1, 2, 3, 1, 0.5]
    )


def test_poly1_bad_arguments():
    logits, labels = _data((4,))
    with pytest.raises(ValueError, match="epsilon must be >= -1"):
        poly1_loss(logits, labels, epsilon=-1.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        poly1_loss(logits, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="weight"):
        poly1_loss(logits, labels, weight=[1.0, 2.0])
