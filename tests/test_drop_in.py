"""With no group rule on, TricksTrainer's optimizer is upstream's own, so checkpoints move between plain ``Trainer``
and ``TricksTrainer`` both ways; with one on, resuming a checkpoint of other groups is refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from nlp_tricks import TricksTrainer
from tiny import bert_seq_cls, seq_cls_data, tricks_args

COMMON = dict(
    report_to="none", use_cpu=True, disable_tqdm=True, per_device_train_batch_size=4, learning_rate=1e-3,
    logging_steps=1, seed=0, dataloader_num_workers=0, weight_decay=0.01, save_strategy="steps", save_steps=2,
    train_sampling_strategy="sequential",
    lr_scheduler_type="constant",  # the two-step part runs the four-step schedule's first half
)  # fmt: skip


def _plain(out, **overrides):
    args = TrainingArguments(output_dir=str(out), **{**COMMON, **overrides})
    return Trainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=16))


def _tricks(out, **overrides):
    return TricksTrainer(
        model=bert_seq_cls(), args=tricks_args(out, **{**COMMON, **overrides}), train_dataset=seq_cls_data(n=16)
    )


def test_with_no_group_rule_the_optimizer_groups_are_upstreams(tmp_path):
    plain, ours = _plain(tmp_path / "a"), _tricks(tmp_path / "b")
    plain.create_optimizer()
    ours.create_optimizer()
    assert len(ours.optimizer.param_groups) == len(plain.optimizer.param_groups) == 2
    names = {id(p): n for n, p in plain.model.named_parameters()}
    ours_names = {id(p): n for n, p in ours.model.named_parameters()}
    for mine, theirs in zip(ours.optimizer.param_groups, plain.optimizer.param_groups):
        assert [ours_names[id(p)] for p in mine["params"]] == [names[id(p)] for p in theirs["params"]]
        assert {k: v for k, v in mine.items() if k != "params"} == {k: v for k, v in theirs.items() if k != "params"}


@pytest.mark.parametrize("first,second", [(_plain, _tricks), (_tricks, _plain)])
def test_a_checkpoint_moves_between_trainer_and_tricks_trainer(tmp_path, first, second, one_thread):
    """Two steps by one trainer, a checkpoint, two more by the other: the weights of four uninterrupted steps."""
    reference = _plain(tmp_path / "reference", max_steps=4)
    reference.train()
    first(tmp_path / "run", max_steps=2).train()
    resumed = second(tmp_path / "run", max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for (name, want), got in zip(reference.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)  # float32 AdamW, same kernels


def test_a_group_rule_cannot_resume_upstreams_groups_and_says_why(tmp_path):
    _plain(tmp_path, max_steps=2).train()
    trainer = _tricks(tmp_path, max_steps=4, layer_decay=0.5)
    with pytest.raises(
        ValueError, match=r"^resume_from_checkpoint=.*the checkpoint's optimizer has 2 parameter groups"
    ) as info:
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert "layer_decay=0.5" in str(info.value) and "\n" not in str(info.value)
