"""Every private (undocumented) name of ``transformers`` that nlp_tricks relies on, behind one small module.

Upstream may rename or drop any of these in a minor release. Going through here keeps the list in one place, and
``tests/test_upstream.py`` checks each name on the installed version, so an upgrade that removes one fails a test
naming the attribute instead of a training run failing deep inside a step.
"""

from __future__ import annotations

from transformers import Trainer
from transformers.trainer_optimizer import is_optimizer_factory

from ..functional.versions import CRF_LOADING_SINCE, require_transformers

__all__ = [
    "TRAINER_METHODS",
    "TRAINER_ATTRIBUTES",
    "TRAINING_ATTRIBUTES",
    "TRAINER_ATTRIBUTES_SINCE",
    "accumulation_steps",
    "is_optimizer_factory",
    "prepare_context_parallel_inputs",
    "prepare_inputs",
    "loss_is_scaled_for_ga",
    "count_items_for_every_model",
    "keep_signature_column",
    "loss_shifts_labels",
    "set_loss_shifts_labels",
    "reduce_item_count",
    "require_transformers",
    "CRF_LOADING_SINCE",
]

# Methods of `Trainer` we call or override (checked on the class).
TRAINER_METHODS = (
    "_prepare_context_parallel_inputs",
    "_prepare_inputs",
    "_set_signature_columns_if_needed",
    "_get_num_items_in_batch",
    "_get_grad_norm",
    "_save_checkpoint",
    "_get_output_dir",
)
# Attributes a built `Trainer` holds (checked on an instance).
TRAINER_ATTRIBUTES = (
    "model_accepts_loss_kwargs",
    "compute_loss_func",
    "_loss_shifts_labels",
)
# Attributes a `Trainer` sets while it trains (checked after one step).
TRAINING_ATTRIBUTES = ("current_gradient_accumulation_steps",)
# Attributes of a built `Trainer` that upstream added after our transformers floor, with the release that added each:
# below it the shim here does what upstream did before (checked on an instance from that release on).
TRAINER_ATTRIBUTES_SINCE = {"loss_is_scaled_for_ga": "5.19.0"}


def prepare_context_parallel_inputs(trainer: Trainer, model, inputs: dict):
    """``(context_manager, inputs)`` for context parallelism, as upstream's ``training_step`` opens it."""
    return trainer._prepare_context_parallel_inputs(model, inputs)


def prepare_inputs(trainer: Trainer, inputs: dict) -> dict:
    """The batch moved to the device, as upstream's ``training_step`` prepares it."""
    return trainer._prepare_inputs(inputs)


def loss_is_scaled_for_ga(trainer: Trainer, num_items_in_batch) -> bool:
    """Upstream's rule: the loss is already divided for gradient accumulation when it was normalised by
    ``num_items_in_batch`` (by the model or ``compute_loss_func``), unless the trainer says otherwise (transformers
    5.19 added that override; before it the rule alone decided)."""
    override = getattr(trainer, "loss_is_scaled_for_ga", None)
    if override is not None:
        return override
    return (
        trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
    ) or trainer.compute_loss_func is not None


def accumulation_steps(trainer: Trainer) -> int:
    """The number of micro-batches in the current optimizer step (the last step of an epoch may have fewer)."""
    return trainer.current_gradient_accumulation_steps


def count_items_for_every_model(trainer: Trainer) -> None:
    """Make the Trainer count ``num_items_in_batch`` for any model (it does only for models that take loss kwargs)
    and not divide the loss again by the accumulation steps: our losses normalise by that count themselves."""
    trainer.model_accepts_loss_kwargs = True


def keep_signature_column(trainer: Trainer, name: str) -> None:
    """Keep dataset column ``name`` when the Trainer drops the columns the model's forward does not take; call from an
    override of ``_set_signature_columns_if_needed`` after ``super()``."""
    if name not in trainer._signature_columns:
        trainer._signature_columns.append(name)


def loss_shifts_labels(trainer: Trainer) -> bool:
    """Whether the trained model's loss shifts labels (causal LMs: position i predicts label i + 1), as upstream
    decides it in ``Trainer.__init__`` (through ``LOSS_MAPPING``; encoder-decoder models excluded)."""
    return bool(trainer._loss_shifts_labels)


def set_loss_shifts_labels(trainer: Trainer, shifts: bool) -> None:
    """Tell the Trainer whether the loss shifts labels, so that it counts ``num_items_in_batch`` over
    ``labels[..., 1:]`` (True) or over ``labels`` (False), as the loss divides by it."""
    trainer._loss_shifts_labels = bool(shifts)


def reduce_item_count(trainer: Trainer, count, device):
    """What upstream's ``_get_num_items_in_batch`` (which TricksTrainer overrides to count other items) does with
    this process's count: the sum over processes (``average_tokens_across_devices``), the DataParallel and
    tensor / context / sequence-parallel divisions."""
    args = trainer.args
    count = count.to(device)
    if args.average_tokens_across_devices:
        if args.world_size > 1:
            count = trainer.accelerator.gather(count).sum()
    elif args.n_gpu > 1:
        count = count / args.n_gpu
    if args.n_gpu > 1 and count.dim() == 0:
        count = count.unsqueeze(0).expand(args.n_gpu, -1)
    return count / (trainer.get_tp_size() * trainer.get_cp_size() * trainer.get_sp_size())
