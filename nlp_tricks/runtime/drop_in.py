"""The loss paths of TricksTrainer for batches its pipeline does not take as they are: a ``compute_loss_func``,
question answering's start / end positions, several label columns, float labels and regression heads (the model's
own loss, with a one-time warning naming the loss tricks it skips). A mixin of :class:`~nlp_tricks.TricksTrainer`."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..functional.models import unwrap_model
from ..functional.outputs import output_loss
from . import upstream as _upstream

__all__ = ["DropInLosses"]

logger = logging.getLogger("nlp_tricks.trainer")


class DropInLosses:
    """What ``compute_loss`` does where the tricks' pipeline cannot apply (see the module docstring)."""

    def _labelled_pipeline_tricks(self) -> list[str]:
        """The loss tricks that act through the labelled pipeline's stages other than ``compute_loss`` (R-Drop's
        doubled batch, a CRF's forward, multi-sample dropout's heads): what a batch without one label column skips."""
        stages = ("prepare_loss_batch", "forward_context", "forward", "head_samples", "adjust_logits_loss")
        return [
            setting
            for trick in self.tricks
            if trick.changes_loss and any(trick.overrides(stage) for stage in stages)
            for setting in trick.summary()
        ]

    def _loss_tricks_in_use(self) -> list[str]:
        """The tricks that change the loss, as ``field=value``: what a model's own loss or compute_loss_func skips."""
        return [setting for trick in self.tricks if trick.changes_loss for setting in trick.summary()]

    def _check_compute_loss_func(self) -> None:
        """A ``compute_loss_func`` replaces the training loss: refuse the tricks it would silently switch off."""
        if self.compute_loss_func is None:
            return
        refused = self._loss_tricks_in_use()
        if refused:
            raise ValueError(
                f"compute_loss_func replaces the training loss, so {', '.join(refused)} would not apply; "
                "reset them to their defaults or drop compute_loss_func (override compute_tricks_loss to add a loss "
                "to the tricks' one)"
            )

    def _model_own_loss(self, model, inputs: dict, label_key: str, labels, num_items, reason: str, distilling: bool):
        """Float labels, a regression or multi-label head: the model's own loss (a mean over its label elements,
        weighed by this batch's share of the step's items), with a one-time warning naming the tricks it skips."""
        self._warn_tricks_do_not_apply(model, reason, distilling)
        outputs = model(**inputs, **{label_key: labels})
        loss = output_loss(outputs)
        if num_items is not None:
            loss = loss * labels.ne(-100).sum() / num_items
        return loss, outputs

    def _compute_loss_with_loss_func(self, model, inputs, num_items_in_batch):
        """Upstream's compute_loss with ``compute_loss_func``: the same call, inputs and loss as plain Trainer."""
        if "teacher_logits" in inputs:
            raise ValueError(
                "a batch carries teacher_logits (distillation), but compute_loss_func replaces the training loss; "
                "drop one of them"
            )
        # Upstream hands `num_items_in_batch` to the forward only if the forward takes loss kwargs, and pops `labels`
        # from the dict it is given (the adversarial passes reuse theirs).
        self.model_accepts_loss_kwargs = self._forward_accepts_loss_kwargs
        try:
            return super().compute_loss(model, dict(inputs), True, num_items_in_batch)
        finally:
            _upstream.count_items_for_every_model(self)

    def _label_key(self, inputs: dict) -> str | None:
        """The input holding the labels: the one column ``label_names`` names, else ``labels``; None if neither."""
        names = self.label_names
        if len(names) == 1 and inputs.get(names[0]) is not None:
            return names[0]
        if len(names) > 1 and "labels" in names and all(inputs.get(name) is not None for name in names):
            return None  # several label columns (e.g. pre-training heads): only the model knows its loss
        return "labels" if inputs.get("labels") is not None else None

    def _compute_loss_without_labels(self, model: nn.Module, inputs: dict):
        """No single label column: question answering's positions, several label columns, or none at all."""
        names = self.label_names
        if set(names) == {"start_positions", "end_positions"} and all(inputs.get(n) is not None for n in names):
            return self._question_answering_loss(model, inputs)
        if model.training:
            skipped = self._labelled_pipeline_tricks()
            if skipped:
                self._warn_once(
                    f"{', '.join(skipped)} cannot apply to batches without one label column (question answering, "
                    "several label columns): they train without it"
                )
        if len(names) > 1 and any(inputs.get(name) is not None for name in names):
            self._warn_tricks_do_not_apply(model, f"several label columns ({', '.join(names)})")
            outputs = model(**inputs)  # not upstream's compute_loss: its label smoother would take `labels` alone
            return output_loss(outputs), outputs
        return super().compute_loss(model, inputs, return_outputs=True)

    def _question_answering_loss(self, model: nn.Module, inputs: dict):
        """The configured loss over start and over end positions, and their mean: the model's loss for ``ce``.

        As the models do, positions are clamped to ``[0, sequence length]`` and those at the length are ignored.
        """
        inputs = dict(inputs)
        positions = [inputs.pop("start_positions"), inputs.pop("end_positions")]
        outputs = model(**inputs)
        if isinstance(outputs, dict) and not {"start_logits", "end_logits"} <= set(outputs.keys()):
            # A beam-search span head (XLNet): only the model knows its loss.
            self._warn_tricks_do_not_apply(model, "a question-answering head without start / end logits")
            inputs.update(start_positions=positions[0], end_positions=positions[1])
            return super().compute_loss(model, inputs, return_outputs=True)
        logits = (outputs["start_logits"], outputs["end_logits"]) if isinstance(outputs, dict) else outputs[:2]
        losses = []
        for logit, position in zip(logits, positions):
            if position.dim() > 1:
                position = position.squeeze(-1)
            ignored = logit.size(1)
            position = position.to(logit.device).clamp(0, ignored)
            losses.append(self.compute_tricks_loss(logit, position.masked_fill(position == ignored, -100)))
        loss = (losses[0] + losses[1]) / 2
        return loss, self.outputs_with_loss(outputs, loss)

    def _model_loss_reason(self, model: nn.Module, labels: torch.Tensor) -> str | None:
        """Why the model's own loss is used instead of the configured one; None when the configured one applies.

        Follows the models' ``problem_type`` rule: float labels, a regression or multi-label ``problem_type``, or a
        sequence-classification head with one output (regression, MSE even on integer labels).
        """
        if labels.is_floating_point():
            return "float labels (regression / multi-label)"
        unwrapped = unwrap_model(model)
        config = getattr(unwrapped, "config", None)
        problem_type = getattr(config, "problem_type", None)
        if problem_type in ("regression", "multi_label_classification"):
            return f"problem_type={problem_type!r}"
        if (
            problem_type is None
            and getattr(config, "num_labels", None) == 1
            and type(unwrapped).__name__.endswith("ForSequenceClassification")
        ):
            return "a regression head (num_labels=1)"
        return None

    def _warn_tricks_do_not_apply(self, model: nn.Module, reason: str, distilling: bool = False) -> None:
        tricks = self._loss_tricks_in_use() + (["distillation (teacher_logits)"] if distilling else [])
        if tricks:
            name = type(unwrap_model(model)).__name__
            self._warn_once(f"{', '.join(tricks)} cannot apply to {name} with {reason}: it trains on its own loss")

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)
