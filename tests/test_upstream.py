"""The private transformers names nlp_tricks relies on (nlp_tricks/runtime/upstream.py) exist on the installed version.

An upgrade that removes or renames one fails here, naming it, rather than deep inside a training step.
"""

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import Trainer

from nlp_tricks.runtime import upstream as _upstream
from tiny import bert_seq_cls, seq_cls_data, tricks_args


@pytest.mark.parametrize("name", _upstream.TRAINER_METHODS)
def test_trainer_method_exists(name):
    assert callable(getattr(Trainer, name, None)), (
        f"transformers.Trainer.{name} is gone: update nlp_tricks/runtime/upstream.py"
    )


def test_trainer_attributes_exist(tmp_path):
    trainer = Trainer(model=bert_seq_cls(), args=tricks_args(tmp_path))
    missing = [name for name in _upstream.TRAINER_ATTRIBUTES if not hasattr(trainer, name)]
    assert not missing, (
        f"transformers.Trainer instances no longer have {missing}: update nlp_tricks/runtime/upstream.py"
    )
    assert _upstream.loss_shifts_labels(trainer) is False  # a classifier's loss does not shift labels


@pytest.mark.parametrize("name", sorted(_upstream.TRAINER_ATTRIBUTES_SINCE))
def test_trainer_attributes_added_later_exist_from_their_release(tmp_path, name):
    """From the release that added it, the attribute exists (the shim reads it); before, it is absent, so the shim's
    fallback is what upstream did."""
    since = Version(_upstream.TRAINER_ATTRIBUTES_SINCE[name])
    trainer = Trainer(model=bert_seq_cls(), args=tricks_args(tmp_path))
    installed = Version(transformers.__version__)
    if installed >= since:
        assert hasattr(trainer, name), (
            f"transformers {installed}: Trainer has no {name}: update nlp_tricks/runtime/upstream.py"
        )
    else:
        assert not hasattr(trainer, name), (
            f"transformers {installed} has {name}: lower its release in nlp_tricks/runtime/upstream.py"
        )


def test_is_optimizer_factory_is_callable():
    assert callable(_upstream.is_optimizer_factory)


def test_training_attributes_exist(tmp_path):
    trainer = Trainer(model=bert_seq_cls(), args=tricks_args(tmp_path, max_steps=1), train_dataset=seq_cls_data())
    trainer.train()
    missing = [name for name in _upstream.TRAINING_ATTRIBUTES if not hasattr(trainer, name)]
    assert not missing, (
        f"transformers.Trainer no longer sets {missing} while training: update nlp_tricks/runtime/upstream.py"
    )


def test_set_loss_shifts_labels_sets_upstreams_item_count(tmp_path):
    """Handing the decision back makes upstream count `num_items_in_batch` over `labels[..., 1:]` (TricksTrainer does
    it for GPT-2-style causal LMs, whose `loss_type` upstream does not recognise)."""
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])  # 5 labels, 3 of them after position 0
    trainer = Trainer(model=bert_seq_cls(), args=tricks_args(tmp_path))
    _upstream.count_items_for_every_model(trainer)
    for shifts, count in ((True, 3), (False, 5)):
        _upstream.set_loss_shifts_labels(trainer, shifts)
        assert _upstream.loss_shifts_labels(trainer) is shifts
        _, counted = trainer.get_batch_samples(iter([{"labels": labels}]), 1, torch.device("cpu"))
        assert int(counted) == count
