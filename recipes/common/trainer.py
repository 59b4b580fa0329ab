"""The trainer every recipe builds the same way: evaluated on its validation split (or not at all), with the
user's ``--trick`` tricks, a trick's refusal of the model as one line."""

from __future__ import annotations

from transformers import IntervalStrategy

from .errors import refusals_of_the_model
from .user_tricks import user_tricks


def build_trainer(trainer_class, training_args, train_dataset, eval_datasets: dict, **kwargs):
    """``trainer_class`` (a ``TricksTrainer``) over ``train_dataset``, evaluating ``eval_datasets["validation"]``
    during training; without validation data nothing is evaluated during training. ``kwargs`` go to the trainer
    (model, collator, metrics, ...); ``tricks`` are the ``--trick`` ones (:func:`user_tricks`)."""
    if "validation" not in eval_datasets:
        training_args.eval_strategy = IntervalStrategy.NO  # no validation data: nothing to evaluate during training
    with refusals_of_the_model():
        return trainer_class(
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_datasets.get("validation"),
            tricks=user_tricks(training_args),
            **kwargs,
        )
