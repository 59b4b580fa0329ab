"""Class weights (losses and Trainer, exact under accumulation, 'balanced') and multi-sample dropout."""

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import HfArgumentParser, RobertaConfig, RobertaForSequenceClassification, default_data_collator

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.functional.losses import balanced_class_weights, cross_entropy, label_smoothing_cross_entropy
from nlp_tricks.functional.multi_sample_dropout import MultiSampleDropout, find_classifier
from nlp_tricks.tricks.head_dropout import MultiSampleDropoutHead as MultiSampleDropoutTrick
from nlp_tricks.tricks.loss_type import LossFunction
from tiny import bert_seq_cls, bert_token_cls, seq_cls_data, token_cls_data, tricks_args

WEIGHTS = [0.5, 2.0, 1.0, 3.0, 0.25]


def _batch(dataset):
    return default_data_collator([dataset[i] for i in range(len(dataset))])


# ---- Class weights: losses -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_weighted_losses_equal_torch_cross_entropy_with_weight(reduction, epsilon):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 5, generator=g, requires_grad=True)
    labels = torch.randint(0, 5, (3, 6), generator=g)
    labels[0, :2] = -100
    w = torch.tensor(WEIGHTS)
    ref = F.cross_entropy(logits.transpose(1, 2), labels, weight=w, label_smoothing=epsilon, reduction=reduction)
    if epsilon == 0:
        ours = cross_entropy(logits, labels, weight=WEIGHTS, reduction=reduction)
    else:
        ours = label_smoothing_cross_entropy(logits, labels, epsilon=epsilon, weight=w, reduction=reduction)
    torch.testing.assert_close(ours, ref)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    torch.testing.assert_close(g_ours, g_ref)


@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_weighted_losses_divide_by_the_weight_sum_of_the_whole_batch(epsilon):
    """Two halves, each normalised by the weight sum of both, add up to F.cross_entropy(weight=) over both."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 5, generator=g)
    labels = torch.randint(0, 5, (10,), generator=g)
    labels[3] = -100
    w = torch.tensor(WEIGHTS)
    weight_sum = w[labels[labels != -100]].sum()
    loss = label_smoothing_cross_entropy if epsilon else cross_entropy
    kwargs = {"epsilon": epsilon} if epsilon else {}
    halves = sum(
        loss(logits[s], labels[s], weight=w, num_items_in_batch=weight_sum, **kwargs)
        for s in (slice(0, 4), slice(4, 10))
    )
    torch.testing.assert_close(halves, F.cross_entropy(logits, labels, weight=w, label_smoothing=epsilon))


def test_balanced_weights_are_n_samples_over_n_classes_times_count():
    labels = [[0, 0, 1, -100], [2, 0], [1, 0, 0, -100, 0]]
    flat = [x for row in labels for x in row if x != -100]
    counts = Counter(flat)
    expected = [len(flat) / (4 * counts[c]) if counts[c] else 0.0 for c in range(4)]  # class 3 never occurs
    assert balanced_class_weights(labels, 4) == pytest.approx(expected)
    assert balanced_class_weights(torch.tensor(flat), 4) == pytest.approx(expected)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        balanced_class_weights([0, 1, 2], 2)


# ---- Class weights: Trainer ----------------------------------------------------------------------------------------


def test_trainer_loss_with_class_weights_equals_torch(tmp_path):
    model = bert_token_cls()
    batch = _batch(token_cls_data())
    w = torch.tensor(WEIGHTS)
    for settings, epsilon in [({}, 0.0), ({"loss_type": "label_smoothing", "label_smoothing_factor": 0.1}, 0.1)]:
        trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, class_weights=WEIGHTS, **settings))
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ours = trainer.compute_loss(model, batch)
            counted = trainer._get_num_items_in_batch([batch, batch], torch.device("cpu"))
            halved = trainer.compute_loss(model, batch, num_items_in_batch=counted)
        ref = F.cross_entropy(logits.reshape(-1, 5), batch["labels"].reshape(-1), weight=w, label_smoothing=epsilon)
        torch.testing.assert_close(ours, ref)
        labels = batch["labels"][batch["labels"] != -100]
        torch.testing.assert_close(counted, 2 * w[labels].sum())
        torch.testing.assert_close(halved, ref / 2)


def _one_step(tmp_path, model, data, batch_size, accumulation, **settings):
    args = tricks_args(
        tmp_path,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        weight_decay=0.0,
        max_grad_norm=0.0,
        **settings,
    )
    TricksTrainer(model=model, args=args, train_dataset=data).train()
    return dict(model.named_parameters())


@pytest.mark.parametrize(
    "settings", [{}, {"loss_type": "label_smoothing", "label_smoothing_factor": 0.2}], ids=["ce", "label_smoothing"]
)
def test_class_weighted_accumulation_is_exact_and_equals_the_full_batch_reference(tmp_path, settings):
    """SGD on 8 examples = 4 x 2 = 2 x 4 micro-batches = plain SGD on F.cross_entropy(weight=) over all 8."""
    data = token_cls_data(n=8)
    base = bert_token_cls()
    ref = copy.deepcopy(base)
    batch = _batch(data)
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    epsilon = settings.get("label_smoothing_factor", 0.0)
    w = torch.tensor(WEIGHTS)
    F.cross_entropy(logits.reshape(-1, 5), batch["labels"].reshape(-1), weight=w, label_smoothing=epsilon).backward()
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    for bs, ga in [(8, 1), (4, 2), (2, 4)]:
        ours = _one_step(tmp_path / f"{bs}", copy.deepcopy(base), data, bs, ga, class_weights=WEIGHTS, **settings)
        for name, p in ref.named_parameters():
            # Summation order differs between the splits: float32 round-off only.
            torch.testing.assert_close(ours[name], p, rtol=1e-5, atol=1e-6, msg=f"{name} ({bs}x{ga})")


def test_balanced_class_weights_come_from_the_training_labels(tmp_path):
    data = seq_cls_data(n=12)
    counts = Counter(int(item["labels"]) for item in data.items)
    expected = [12 / (3 * counts[c]) for c in range(3)]
    trainer = TricksTrainer(
        model=bert_seq_cls(), args=tricks_args(tmp_path, class_weights=["balanced"]), train_dataset=data
    )
    torch.testing.assert_close(trainer.get_trick(LossFunction).class_weights, torch.tensor(expected))
    trainer.train()


def test_class_weights_arguments(tmp_path):
    (args,) = HfArgumentParser(TricksArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--class_weights", "balanced", "--report_to", "none"]
    )
    assert args.class_weights == "balanced"
    (args,) = HfArgumentParser(TricksArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--class_weights", "1", "3.5", "--report_to", "none"]
    )
    assert args.class_weights == [1.0, 3.5]
    assert tricks_args(tmp_path, class_weights="balanced").class_weights == "balanced"
    with pytest.raises(ValueError, match="class_weights"):
        tricks_args(tmp_path, class_weights=["1", "x"])
    with pytest.raises(ValueError, match="class_weights"):
        tricks_args(tmp_path, class_weights=[0.0, 0.0])
    with pytest.raises(ValueError, match="focal_alpha"):
        tricks_args(tmp_path, class_weights=[1.0, 2.0], loss_type="focal")
    with pytest.raises(
        ValueError, match="2 weights for 5 classes; give one weight per class in this order: 0=LABEL_0"
    ):
        TricksTrainer(model=bert_token_cls(), args=tricks_args(tmp_path, class_weights=[1.0, 2.0]))


# ---- Multi-sample dropout ------------------------------------------------------------------------------------------


def test_one_sample_without_dropout_equals_the_plain_model_exactly(tmp_path):
    batch = _batch(token_cls_data())
    plain, hooked = bert_token_cls(), bert_token_cls()
    msd = MultiSampleDropout.attach(hooked, samples=1, p=0.0)
    plain.train(), hooked.train()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    assert torch.equal(hooked(**inputs).logits, plain(**inputs).logits)
    assert msd.take().shape == (1, *batch["labels"].shape, 5)
    # Through the Trainer: the same loss and the same step.
    args = dict(max_steps=2, optim="sgd", learning_rate=0.1)
    a = TricksTrainer(model=plain, args=tricks_args(tmp_path / "a", **args), train_dataset=token_cls_data())
    msd.remove()
    b_args = tricks_args(tmp_path / "b", **args)
    # The trick itself at K=1, p=0 (its fields leave it off, so it is passed in as an object).
    b = TricksTrainer(
        model=hooked, args=b_args, train_dataset=token_cls_data(), tricks=[MultiSampleDropoutTrick(b_args)]
    )
    a.train(), b.train()
    for (name, p), q in zip(plain.named_parameters(), hooked.parameters()):
        assert torch.equal(p, q), name


def test_fixed_masks_give_the_mean_of_the_k_heads_losses(tmp_path):
    model = bert_token_cls()
    batch = _batch(token_cls_data())
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, head_dropout_samples=3, head_dropout=0.5))
    features = {}
    handle = model.classifier.register_forward_pre_hook(
        lambda m, args: features.setdefault("x", args[0]), prepend=True
    )
    g = torch.Generator().manual_seed(0)
    masks = (torch.rand(3, *batch["labels"].shape, 32, generator=g) > 0.5).float() / 0.5
    trainer.get_trick(MultiSampleDropoutTrick).hooks.masks = lambda x: masks
    model.train()
    loss = trainer.compute_loss(model, batch)
    handle.remove()
    x = features["x"]  # the features entering the head (this hook runs before the dropout hook)
    by_hand = [
        F.cross_entropy(F.linear(x * masks[k], model.classifier.weight, model.classifier.bias).reshape(-1, 5),
                        batch["labels"].reshape(-1))
        for k in range(3)
    ]  # fmt: skip
    torch.testing.assert_close(loss, torch.stack(by_hand).mean())
    # Evaluation: no dropout, no samples.
    model.eval()
    with torch.no_grad():
        eval_loss = trainer.compute_loss(model, batch)
        plain = F.cross_entropy(model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits.reshape(-1, 5),
                                batch["labels"].reshape(-1))  # fmt: skip
    torch.testing.assert_close(eval_loss, plain)
    assert trainer.get_trick(MultiSampleDropoutTrick).hooks.take() is None


@pytest.mark.parametrize("crf", [False, True])
def test_multi_sample_dropout_trains_every_parameter(tmp_path, crf):
    model = bert_token_cls()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = tricks_args(tmp_path, head_dropout_samples=4, head_dropout=0.3, max_steps=2, learning_rate=1e-2, crf=crf)
    trainer = TricksTrainer(model=model, args=args, train_dataset=token_cls_data(), eval_dataset=token_cls_data(n=4))
    trainer.train()
    assert "eval_loss" in trainer.evaluate()
    for name, p in model.named_parameters():
        if not name.startswith("crf."):
            assert not torch.equal(before[name], p.detach()), f"{name} did not change"


def test_the_classifier_is_found_in_common_heads():
    assert find_classifier(bert_seq_cls())[0] == "classifier"
    config = RobertaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37, num_labels=3
    )
    assert find_classifier(RobertaForSequenceClassification(config))[0] == "classifier.out_proj"


def test_multi_sample_dropout_settings_are_validated(tmp_path, caplog):
    with pytest.raises(ValueError, match="head_dropout > 0"):
        tricks_args(tmp_path, head_dropout_samples=4)
    with pytest.raises(ValueError, match="head_dropout="):
        tricks_args(tmp_path, head_dropout_samples=2, head_dropout=1.0)
    with pytest.raises(ValueError, match="head_dropout_samples="):
        tricks_args(tmp_path, head_dropout_samples=0)
    # Regression (float labels) keeps the model's own loss, with a warning naming what cannot apply.
    model = bert_seq_cls(num_labels=1)
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, head_dropout_samples=2, head_dropout=0.5))
    batch = _batch(seq_cls_data())
    batch["labels"] = batch["labels"].float()
    model.eval()
    with caplog.at_level("WARNING", logger="nlp_tricks.trainer"):
        loss = trainer.compute_loss(model, batch)
    assert "head_dropout_samples=2, head_dropout=0.5 cannot apply" in caplog.text
    torch.testing.assert_close(loss, model(**batch).loss)
