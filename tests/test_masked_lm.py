"""Sparse prediction: the masked-LM loss and gradients from labelled positions only equal the model's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertForMaskedLM

from nlp_tricks.data import MaskedLMCollator
from nlp_tricks.masked_lm import MaskedLMTrainer, sparse_prediction
from tiny import VOCAB, bert_config, tricks_args, wordpiece_tokenizer


def mlm_model() -> BertForMaskedLM:
    torch.manual_seed(0)
    return BertForMaskedLM(bert_config())


def mlm_batch(seed=0, batch=4, length=16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (batch, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 10:] = 0
    labels = torch.where(torch.rand(batch, length, generator=g) < 0.3, input_ids, -100)
    labels[1, 10:] = -100
    input_ids = torch.where(labels != -100, 4, input_ids)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def test_sparse_logits_are_the_full_logits_at_the_labelled_positions():
    model, batch = mlm_model(), mlm_batch()
    positions = batch["labels"] != -100
    with torch.no_grad():
        full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with sparse_prediction(model, positions) as active:
            sparse = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert active and sparse.shape == (int(positions.sum()), VOCAB)
    torch.testing.assert_close(sparse, full[positions])  # same kernels on fewer rows
    with torch.no_grad():  # the hook is gone after the block
        assert model(input_ids=batch["input_ids"]).logits.shape == full.shape


@pytest.mark.parametrize("num_items_in_batch", [None, 37])
def test_masked_lm_trainer_loss_and_gradients_equal_the_models_own_loss(tmp_path, num_items_in_batch):
    model, batch = mlm_model(), mlm_batch()
    # Reference: BertForMaskedLM's own loss (a mean over labelled positions), as a sum / num_items when given.
    reference = model(**batch).loss
    if num_items_in_batch is not None:
        reference = reference * (batch["labels"] != -100).sum() / num_items_in_batch
    reference.backward()
    expected = grads(model)
    trainer = MaskedLMTrainer(model=model, args=tricks_args(tmp_path))
    loss = trainer.compute_loss(model, batch, num_items_in_batch=num_items_in_batch)
    loss.backward()
    got = grads(model)
    torch.testing.assert_close(loss, reference)
    assert got.keys() == expected.keys()
    for name in expected:  # float32 sums in another order: assert_close's default tolerance
        torch.testing.assert_close(got[name], expected[name], msg=name)


def test_models_without_a_linear_output_projection_keep_full_logits(tmp_path):
    model, batch = mlm_model(), mlm_batch()
    model.get_output_embeddings = lambda: None
    with sparse_prediction(model, batch["labels"] != -100) as active:
        assert not active
        assert model(input_ids=batch["input_ids"]).logits.shape == (*batch["input_ids"].shape, VOCAB)
    trainer = MaskedLMTrainer(model=model, args=tricks_args(tmp_path))
    torch.testing.assert_close(trainer.compute_loss(model, batch), model(**batch).loss)


def test_evaluation_with_fixed_masks_matches_the_full_logits(tmp_path):
    tokenizer = wordpiece_tokenizer()
    collator = MaskedLMCollator(tokenizer, whole_word_mask=True)
    blocks = [
        {"input_ids": [2] + [5 + (i * 7 + j) % 14 for j in range(12 - i)] + [3], "word_ids": [-1, *range(12 - i), -1]}
        for i in range(6)
    ]
    eval_set = collator.mask_once(blocks, seed=0)
    results = []
    for sparse in (True, False):
        args = tricks_args(tmp_path, per_device_eval_batch_size=4, prediction_loss_only=True)
        trainer = MaskedLMTrainer(model=mlm_model(), args=args, data_collator=collator, sparse=sparse)
        results.append(trainer.evaluate(eval_set)["eval_loss"])
    assert results[0] == pytest.approx(results[1], rel=1e-5)


@pytest.mark.slow  # a subprocess importing transformers' Trainer: tens of seconds on a loaded 2-core machine
def test_benchmark_quick_json():
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "benchmarks" / "masked_lm.py"), "--quick", "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert set(rows) == {"full_logits", "sparse_prediction", "model_loss"} and rows["full_logits"]["ratio"] == 1.0
