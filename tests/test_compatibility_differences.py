"""The deliberate differences from plain Trainer that docs/compatibility.md lists, each checked against plain Trainer
on the same tiny model: what upstream's own trainer tests would see with TricksTrainer in its place."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from nlp_tricks import Trick, TricksArguments, TricksTrainer
from nlp_tricks.runtime.divergence import DivergenceGuard
from nlp_tricks.runtime.preemption import PreemptionCallback
from tiny import ListDataset, bert_seq_cls, seq_cls_data
from tiny_causal import VOCAB, gpt2_lm, llama_lm

LENGTH = 16


def _fully_labelled(n=4, seed=0) -> ListDataset:
    """Sequences whose every position carries a label, position 0 included (the labels of a plain LM collator)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(5, VOCAB, (LENGTH,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(LENGTH, dtype=torch.long), "labels": ids.clone()})
    return ListDataset(rows)


def _losses(trainer_class, args_class, model, data, tmp_path) -> tuple[float, float]:
    """The eval loss of the untrained model, then the training loss of one SGD step, as ``trainer_class`` has them."""
    args = args_class(
        output_dir=str(tmp_path / trainer_class.__name__), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=1, optim="sgd",
        learning_rate=0.1, logging_steps=1, seed=0,
    )  # fmt: skip
    trainer = trainer_class(model=copy.deepcopy(model), args=args, train_dataset=data)
    evaluated = trainer.evaluate(data)["eval_loss"]
    return evaluated, trainer.train().training_loss


@pytest.mark.parametrize("build, upstream_counts_position_0", [(gpt2_lm, True), (llama_lm, False)])
def test_a_causal_lm_whose_class_names_no_loss_type_gets_its_own_loss(build, upstream_counts_position_0, tmp_path):
    """GPT2LMHeadModel's class name names no loss type, so upstream counts ``num_items_in_batch`` over every label,
    position 0 included, which the shifted loss never scores: its loss is the sum over L - 1 positions per sequence
    divided by L. TricksTrainer counts the scored positions: the model's own loss (``model(**batch).loss``).
    LlamaForCausalLM names its loss type: there both are the model's own."""
    model, data = build(), _fully_labelled()
    batch = {key: torch.stack([row[key] for row in data]) for key in data[0]}
    with torch.no_grad():
        own = model.eval()(**batch).loss.item()
    ours = _losses(TricksTrainer, TricksArguments, model, data, tmp_path)
    plain = _losses(Trainer, TrainingArguments, model, data, tmp_path)
    assert ours[0] == pytest.approx(own, rel=1e-6)  # the same forward: float32 round-off of the sum's order
    factor = (LENGTH - 1) / LENGTH if upstream_counts_position_0 else 1.0
    for theirs, mine in zip(plain, ours):  # the eval loss, then the training loss of the step
        assert theirs == pytest.approx(mine * factor, rel=1e-6)


def _callbacks(trainer_class, args_class, tmp_path, **settings) -> list[TrainerCallback]:
    args = args_class(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, **settings)
    return trainer_class(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data()).callback_handler.callbacks


@pytest.mark.parametrize("jit", [False, True])
def test_the_callbacks_are_upstreams_then_the_tricks_preemption_and_the_guard(jit, tmp_path):
    """With every trick off: upstream's default callbacks in their order (but its JIT-checkpoint callback, which the
    preemption callback replaces), then the run's tricks (each a callback), the preemption callback, the guard."""
    plain = [type(c).__name__ for c in _callbacks(Trainer, TrainingArguments, tmp_path, enable_jit_checkpoint=jit)]
    ours = _callbacks(TricksTrainer, TricksArguments, tmp_path, enable_jit_checkpoint=jit)
    assert ("JITCheckpointCallback" in plain) == jit
    upstream = [name for name in plain if name != "JITCheckpointCallback"]
    assert [type(c).__name__ for c in ours[: len(upstream)]] == upstream
    added = ours[len(upstream) :]
    assert isinstance(added[-2], PreemptionCallback) and isinstance(added[-1], DivergenceGuard)
    # The state store's restorer: the tricks' checkpointed state, restored after every trick's on_train_begin.
    assert type(added[-3]).__name__ == "_RestoreAfterTrainBegin"
    assert all(isinstance(callback, Trick) for callback in added[:-3])
