"""Compatibility matrix: on every architecture and task, TricksTrainer with its tricks off is plain Trainer (loss, one
SGD step, predict()), and each loss type and FGM trains a finite step that differs from plain where the trick applies.

Tiny models from config (tests/tiny_zoo.py); one optimizer step per run.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertForPreTraining,
    BertForTokenClassification,
    Trainer,
    TrainingArguments,
    default_data_collator,
)
from transformers.modeling_outputs import SequenceClassifierOutput

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.seq2seq import Seq2SeqTricksTrainer
from tiny import VOCAB, ListDataset, bart_lm, bert_seq_cls
from tiny_seq2seq import seq2seq_args
from tiny_zoo import CASES, CONFIGS, Case

TRICKS = {
    "focal": {"loss_type": "focal", "focal_gamma": 2.0},
    "label_smoothing": {"loss_type": "label_smoothing", "label_smoothing_factor": 0.1},
    "fgm": {"adversarial": "fgm", "adv_epsilon": 1.0},
}


@pytest.fixture(autouse=True, scope="module")
def _frozen_gc():
    # Every train() ends in Accelerator.free_memory(), a full gc.collect(): ~0.4 s in a test process, most of a
    # one-step run. Frozen, the objects alive before this module are not scanned again; nothing compared depends on it.
    gc.freeze()
    yield
    gc.unfreeze()


def matrix_args(args_class, output_dir, **overrides):
    kwargs = dict(
        output_dir=str(output_dir),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=1,
        optim="sgd",
        learning_rate=0.1,
        weight_decay=0.0,
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    return args_class(**{**kwargs, **overrides})


def one_step(trainer_class, args_class, base, data, output_dir, predict=True, **tricks):
    """Train a copy of ``base`` one step on ``data`` (one batch); its loss, parameters and predict() on ``data``."""
    model = copy.deepcopy(base)
    trainer = trainer_class(model=model, args=matrix_args(args_class, output_dir, **tricks), train_dataset=data)
    loss = trainer.train().training_loss
    prediction = trainer.predict(data) if predict else None
    return loss, {name: p.detach().clone() for name, p in model.named_parameters()}, prediction


def assert_nested_close(actual, expected, path="predictions"):
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_nested_close(a, e, f"{path}[{i}]")
    else:
        # Same forward, on weights that agree to float32 round-off (see the step's comparison).
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5, err_msg=path)


def _params_close(a, b) -> bool:
    return all(torch.allclose(a[name], p, rtol=1e-5, atol=1e-6) for name, p in b.items())


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_matrix(case, tmp_path, caplog):
    base, data = case.model(), case.data()
    plain_loss, plain, plain_prediction = one_step(Trainer, TrainingArguments, base, data, tmp_path / "plain")

    loss, ours, prediction = one_step(TricksTrainer, TricksArguments, base, data, tmp_path / "off")
    # The tricks' loss is a sum over the label count, the models' a mean: float32 round-off only.
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    for name, p in plain.items():
        torch.testing.assert_close(ours[name], p, rtol=1e-5, atol=1e-6, msg=f"{name} after one step")
    assert_nested_close(prediction.predictions, plain_prediction.predictions)
    assert_nested_close(prediction.label_ids, plain_prediction.label_ids, "label_ids")
    assert prediction.metrics["test_loss"] == pytest.approx(plain_prediction.metrics["test_loss"], rel=1e-5)

    for trick, settings in TRICKS.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nlp_tricks.trainer"):
            loss, ours, _ = one_step(
                TricksTrainer, TricksArguments, base, data, tmp_path / trick, predict=False, **settings
            )
        assert math.isfinite(loss), trick
        assert all(torch.isfinite(p).all() for p in ours.values()), trick
        applies = case.loss_tricks_apply or trick == "fgm"
        assert _params_close(ours, plain) != applies, f"{trick}: the step should {'' if applies else 'not '}differ"
        if not applies:
            assert f"loss_type={settings['loss_type']!r}" in caplog.text and "cannot apply" in caplog.text


# --- Crashes plain Trainer does not have ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(family, f"{prefix}ForSequenceClassification", "seq_cls"), id=prefix)
        for family, prefix in [("bart", "Bart"), ("mbart", "MBart"), ("t5", "T5")]
    ],
)
def test_encoder_decoder_classifiers_build_their_decoder_inputs_as_without_labels(case, tmp_path):
    """They have no prepare_decoder_input_ids_from_labels: the decoder reads the shifted input_ids, labels or not."""
    base, data = case.model(), case.data()
    plain_loss, plain, _ = one_step(Trainer, TrainingArguments, base, data, tmp_path / "plain", predict=False)
    loss, ours, _ = one_step(TricksTrainer, TricksArguments, base, data, tmp_path / "ours", predict=False)
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    assert _params_close(ours, plain)


def _mse_loss_backpropagates_to_integer_targets() -> bool:
    x = torch.zeros(1, requires_grad=True)
    try:
        F.mse_loss(x, torch.zeros(1, dtype=torch.long)).backward()
    except RuntimeError:  # "Found dtype Long but expected Float"
        return False
    return True


@pytest.mark.skipif(
    not _mse_loss_backpropagates_to_integer_targets(),
    reason=f"torch {torch.__version__} cannot backpropagate mse_loss to integer targets (2.11 cannot, 2.13 can): the "
    "model's own loss fails with plain Trainer too",
)
def test_regression_head_with_integer_labels_is_the_models_mse(tmp_path, caplog):
    """num_labels=1 is regression for the model (MSE on the labels cast to float), whatever the labels' dtype."""
    case = Case("bert", "BertForSequenceClassification", "seq_cls", num_labels=1)
    base = case.model()
    data = Case("bert", "BertForSequenceClassification", "seq_cls", num_labels=4).data()  # integer labels 0..3
    plain_loss, plain, _ = one_step(Trainer, TrainingArguments, base, data, tmp_path / "plain", predict=False)
    batch = default_data_collator(list(data.items))
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert plain_loss == pytest.approx(float(F.mse_loss(logits.squeeze(), batch["labels"].float())), rel=1e-5)
    for tricks in ({}, TRICKS["focal"]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nlp_tricks.trainer"):
            loss, ours, _ = one_step(
                TricksTrainer, TricksArguments, base, data, tmp_path / "ours", predict=False, **tricks
            )
        assert loss == pytest.approx(plain_loss, rel=1e-5)
        assert _params_close(ours, plain)
    assert caplog.messages == [
        "loss_type='focal' cannot apply to BertForSequenceClassification with a regression head (num_labels=1): "
        "it trains on its own loss"
    ]


class BagOfEmbeddings(nn.Module):
    """A classifier with little for dynamo to trace (its first compile in a process costs seconds as it is)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, 3)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.out(self.embed(input_ids).mean(1))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def test_fgm_under_torch_compile_after_a_compiled_run_without_it(tmp_path, monkeypatch):
    """torch.compile does not guard on module hooks: a graph compiled earlier in the process for the same forward
    (here by a run without FGM) must not be reused by FGM's passes, which would never call the embedding hook."""
    # TrainingArguments(torch_compile=True) exports these for Accelerate; they must not outlive this test.
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    monkeypatch.delenv("ACCELERATE_DYNAMO_MODE", raising=False)
    torch.manual_seed(0)
    base, data = BagOfEmbeddings(), Case("bert", "BertForSequenceClassification", "seq_cls").data()
    fgm = dict(adversarial="fgm", predict=False)
    reference_loss, reference, _ = one_step(TricksTrainer, TricksArguments, base, data, tmp_path / "eager", **fgm)
    compiled = dict(torch_compile=True, torch_compile_backend="eager")  # dynamo's graphs, no code generation
    try:
        _, plain, _ = one_step(
            TricksTrainer, TricksArguments, base, data, tmp_path / "plain", predict=False, **compiled
        )
        loss, ours, _ = one_step(TricksTrainer, TricksArguments, base, data, tmp_path / "fgm", **fgm, **compiled)
    finally:
        torch.compiler.reset()
    assert loss == pytest.approx(reference_loss, rel=1e-5)
    assert _params_close(ours, reference) and not _params_close(ours, plain)


# --- Silent wrong results ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_dict", [True, False])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case("bert", "BertForTokenClassification", "token_cls", num_labels=5), id="token_cls"),
        pytest.param(Case("bert", "BertForQuestionAnswering", "qa", num_labels=2), id="qa"),
        pytest.param(Case("bert", "BertForMultipleChoice", "multiple_choice"), id="multiple_choice"),
        pytest.param(Case("bert", "BertForSequenceClassification", "regression", num_labels=1), id="regression"),
    ],
)
def test_predictions_equal_plain_trainers_with_tuple_outputs(case, return_dict, tmp_path):
    """compute_loss's outputs carry the loss first, so prediction_step's ``outputs[1:]`` are the predictions."""
    model, data = case.model(return_dict=return_dict), case.data()
    args = matrix_args(TrainingArguments, tmp_path / "plain")
    plain = Trainer(model=model, args=args).predict(data)
    ours = TricksTrainer(model=model, args=matrix_args(TricksArguments, tmp_path / "ours")).predict(data)
    assert_nested_close(ours.predictions, plain.predictions)
    assert ours.metrics["test_loss"] == pytest.approx(plain.metrics["test_loss"], rel=1e-5)


def _weighted_ce(outputs, labels, num_items_in_batch=None):
    """A user's loss: class-weighted cross-entropy, summed over the batch's labels."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    weight = torch.tensor([1.0, 3.0, 0.5], device=logits.device)
    loss = F.cross_entropy(logits, labels, weight=weight, reduction="sum")
    return loss / (num_items_in_batch if num_items_in_batch is not None else labels.numel())


def test_compute_loss_func_is_honoured(tmp_path):
    case = Case("bert", "BertForSequenceClassification", "seq_cls")
    base, data = case.model(), case.data(n=8)
    calls = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        calls.append(labels.shape)
        return _weighted_ce(outputs, labels, num_items_in_batch)

    results = {}
    for name, trainer_class, args_class in [
        ("plain", Trainer, TrainingArguments),
        ("ours", TricksTrainer, TricksArguments),
    ]:
        model = copy.deepcopy(base)
        args = matrix_args(args_class, tmp_path / name, per_device_train_batch_size=2, gradient_accumulation_steps=4)
        trainer = trainer_class(model=model, args=args, train_dataset=data, compute_loss_func=loss_func)
        results[name] = trainer.train().training_loss, dict(model.named_parameters())
    assert len(calls) == 8  # 4 micro-batches each
    assert results["ours"][0] == pytest.approx(results["plain"][0], rel=1e-5)
    assert _params_close(results["ours"][1], results["plain"][1])

    # With FGM both passes take the user's loss.
    calls.clear()
    args = matrix_args(TricksArguments, tmp_path / "fgm", adversarial="fgm")
    TricksTrainer(model=copy.deepcopy(base), args=args, train_dataset=case.data(), compute_loss_func=loss_func).train()
    assert len(calls) == 2


@pytest.mark.parametrize(
    "tricks,named",
    [
        ({"loss_type": "focal"}, "loss_type='focal'"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
        ({"temperature": 2.0}, "temperature=2.0"),
    ],
)
def test_compute_loss_func_refuses_the_loss_tricks_it_would_replace(tmp_path, tricks, named):
    args = matrix_args(TricksArguments, tmp_path, **tricks)
    with pytest.raises(ValueError, match=f"compute_loss_func replaces the training loss, so {re.escape(named)}"):
        TricksTrainer(model=bert_seq_cls(), args=args, compute_loss_func=_weighted_ce)


def test_compute_loss_func_refuses_scheduled_sampling(tmp_path):
    args = seq2seq_args(tmp_path, scheduled_sampling="constant", ss_k=0.5)
    with pytest.raises(ValueError, match="so scheduled_sampling='constant' would not apply"):
        Seq2SeqTricksTrainer(model=bart_lm(), args=args, compute_loss_func=_weighted_ce)


def test_compute_loss_func_refuses_a_distillation_batch(tmp_path):
    case = Case("bert", "BertForSequenceClassification", "seq_cls")
    model, batch = case.model(), default_data_collator(list(case.data().items))
    trainer = TricksTrainer(model=model, args=matrix_args(TricksArguments, tmp_path), compute_loss_func=_weighted_ce)
    with pytest.raises(ValueError, match="teacher_logits"):
        trainer.compute_loss(model, {**batch, "teacher_logits": torch.zeros(4, 3)})


# --- Tricks apply where they are defined, and say so where not -----------------------------------------------------


def _focal(logits, target, gamma):
    """Focal loss written out: -(1 - p_y)^gamma log p_y, mean over the counted items."""
    log_p = logits.log_softmax(-1).gather(1, target.unsqueeze(1)).squeeze(1)
    return (-((1 - log_p.exp()) ** gamma) * log_p).mean()


@pytest.mark.parametrize("tricks", ["label_smoothing_temperature", "focal"])
def test_question_answering_takes_the_tricks_over_start_and_end_positions(tmp_path, tricks):
    case = Case("bert", "BertForQuestionAnswering", "qa", num_labels=2)
    model, batch = case.model(), default_data_collator(list(case.data().items))
    settings = (
        dict(loss_type="label_smoothing", label_smoothing_factor=0.2, temperature=2.0)
        if tricks != "focal"
        else dict(loss_type="focal", focal_gamma=2.0)
    )
    trainer = TricksTrainer(model=model, args=matrix_args(TricksArguments, tmp_path, **settings))
    with torch.no_grad():
        ours = trainer.compute_loss(model, batch)
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    losses = []
    for logits, positions in [
        (outputs.start_logits, batch["start_positions"]),
        (outputs.end_logits, batch["end_positions"]),
    ]:
        keep = (
            positions < logits.shape[1]
        )  # the model clamps an answer outside the window to its length and ignores it
        logits, positions = logits[keep], positions[keep]
        if tricks == "focal":
            losses.append(_focal(logits, positions, 2.0))
        else:
            losses.append(F.cross_entropy(logits / 2.0, positions, label_smoothing=0.2))
    assert not bool(batch["end_positions"].lt(case.data()[0]["input_ids"].numel()).all())  # one is out of range
    torch.testing.assert_close(ours, (losses[0] + losses[1]) / 2)


class TaggerWithTags(BertForTokenClassification):
    """A user's model whose labels arrive as ``tags`` (hence label_names=["tags"])."""

    def forward(self, input_ids=None, attention_mask=None, tags=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=tags, **kwargs)


def test_a_custom_label_name_is_the_labels(tmp_path):
    case = Case("bert", "BertForTokenClassification", "token_cls", num_labels=5)
    torch.manual_seed(0)
    base = TaggerWithTags(case.model().config)
    data = ListDataset([{"tags" if k == "labels" else k: v for k, v in item.items()} for item in case.data().items])
    tags = {"label_names": ["tags"]}
    plain_loss, plain, plain_prediction = one_step(Trainer, TrainingArguments, base, data, tmp_path / "p", **tags)
    loss, ours, prediction = one_step(TricksTrainer, TricksArguments, base, data, tmp_path / "o", **tags)
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    assert _params_close(ours, plain)
    assert_nested_close(prediction.predictions, plain_prediction.predictions)
    assert_nested_close(prediction.label_ids, plain_prediction.label_ids, "label_ids")

    settings = dict(loss_type="label_smoothing", label_smoothing_factor=0.2, temperature=0.5, **tags)
    trainer = TricksTrainer(model=base, args=matrix_args(TricksArguments, tmp_path / "ls", **settings))
    batch = default_data_collator(list(data.items))
    with torch.no_grad():
        ours = trainer.compute_loss(base, batch)
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reference = F.cross_entropy((logits / 0.5).reshape(-1, 5), batch["tags"].reshape(-1), label_smoothing=0.2)
    torch.testing.assert_close(ours, reference)


def test_several_label_columns_keep_the_models_loss_and_warn(tmp_path, caplog):
    torch.manual_seed(0)
    model = BertForPreTraining(CONFIGS["bert"][0](vocab_size=VOCAB, **CONFIGS["bert"][1]))
    batch = default_data_collator(list(Case("bert", "BertForMaskedLM", "mlm").data().items))
    batch["next_sentence_label"] = torch.tensor([0, 1, 1, 0])
    trainer = TricksTrainer(model=model, args=matrix_args(TricksArguments, tmp_path, **TRICKS["focal"]))
    with caplog.at_level(logging.WARNING, logger="nlp_tricks.trainer"), torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(model, batch), model(**batch).loss)
    assert "loss_type='focal' cannot apply to BertForPreTraining with several label columns" in caplog.text


def _head_variant(variant: str):
    family = variant.split("-")[0]
    model = Case(family, f"{family.title()}ForConditionalGeneration", "seq2seq").model()
    if variant.endswith("untied"):  # a user's untied output head (transformers 5 ties T5's and BART's by default)
        model.lm_head.weight = nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    return model


@pytest.mark.parametrize("variant", ["t5", "t5-untied", "bart", "bart-untied"])
def test_head_lr_scale_applies_to_an_untied_output_head_and_says_when_there_is_none(tmp_path, variant, caplog):
    """T5ForConditionalGeneration is its own base_model: its untied lm_head is the head. Tied, there is none."""
    base, data = _head_variant(variant), Case("t5", "T5ForConditionalGeneration", "seq2seq").data()
    untied = variant.endswith("untied")
    steps = {}
    for scale in (1.0, 10.0):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nlp_tricks.runtime.param_groups"):
            _, steps[scale], _ = one_step(
                TricksTrainer, TricksArguments, base, data, tmp_path / str(scale), predict=False, head_lr_scale=scale
            )
    moved = {scale: {n: p - base.get_parameter(n).detach() for n, p in step.items()} for scale, step in steps.items()}
    assert ("lm_head.weight" in moved[1.0]) == untied
    for name in moved[1.0]:
        # Plain SGD on the same gradient (clipping scales both runs alike): the head moves 10x as far, the rest alike.
        # The moves (~1e-3) are differences of float32 weights of size ~1: round-off ~1e-7, times 10.
        factor = 10.0 if name == "lm_head.weight" else 1.0
        torch.testing.assert_close(moved[10.0][name], factor * moved[1.0][name], rtol=1e-4, atol=1e-5, msg=name)
    model_name = type(base).__name__
    assert (f"head_lr_scale=10.0 cannot apply to {model_name}" in caplog.text) != untied


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.family in ("bert", "xlm-roberta") and c.task == "seq_cls"], ids=lambda c: c.family
)
def test_logged_learning_rate_is_the_bodys_on_every_model(tmp_path, case):
    """XLM-R registers its classifier first: upstream would log the head's lr there. Reference: plain Trainer's log."""
    base, data = case.model(), case.data(n=8)

    def logged(trainer_class, args_class, **tricks):
        args = matrix_args(args_class, tmp_path, max_steps=2, per_device_train_batch_size=4, **tricks)
        trainer = trainer_class(model=copy.deepcopy(base), args=args, train_dataset=data)
        trainer.train()
        return [e for e in trainer.state.log_history if "loss" in e]

    plain = [e["learning_rate"] for e in logged(Trainer, TrainingArguments)]
    for tricks in ({"head_lr_scale": 10.0}, {"head_lr_scale": 10.0, "layer_decay": 0.5}):
        logs = logged(TricksTrainer, TricksArguments, **tricks)
        assert [e["learning_rate"] for e in logs] == pytest.approx(plain)
        assert [e["lr/head"] for e in logs] == pytest.approx([10 * lr for lr in plain])
