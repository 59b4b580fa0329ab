"""TricksTrainer: a ``transformers.Trainer`` that runs the tricks of nlp_tricks, built from TricksArguments."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections import defaultdict

import torch
from torch import nn
from transformers import Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_utils import unwrap_peft_model
from transformers.utils import ModelOutput

from .config import TricksArguments
from .functional.losses import distillation_loss
from .functional.outputs import output_logits, output_loss
from .runtime import upstream as _upstream
from .runtime.averaging import AVERAGING_INFO_NAME, EMA, write_averaging_info
from .runtime.divergence import install_divergence_guard
from .runtime.integrity import checkpoint_written
from .runtime.lock import holds_output_dir
from .runtime.param_groups import NO_DECAY_PATTERNS, build_param_groups, group_learning_rates, group_signature
from .runtime.preemption import PreemptionCallback, install_preemption
from .runtime.resume import (
    CHECKPOINT_RE,
    TrickStateCallback,
    checkpoint_problem,
    get_last_complete_checkpoint,
    optimizer_groups_problem,
)
from .tricks import BUILT_IN_TRICKS, LossBatch, Trick, built_in_tricks
from .tricks.averaging import ExponentialMovingAverage
from .tricks.base import TRICKS_STATE_NAME, checkpoint_trick_states, nested, save_trick_states, tricks_section

__all__ = ["TricksTrainer"]

logger = logging.getLogger(__name__)


class TricksTrainer(Trainer):
    """A drop-in ``transformers.Trainer`` that runs tricks: the built-in ones :class:`TricksArguments` switches on,
    and any :class:`~nlp_tricks.Trick` passed as ``tricks=[...]``.

    What it changes, and nothing else (training loop, mixed precision, DDP / FSDP / DeepSpeed, clipping, schedulers,
    logging and checkpoints stay upstream's):

    - :meth:`compute_loss` pops the labels, runs the model without its own loss and takes the configured loss on its
      logits in one written pipeline (:meth:`_compute_labelled_loss`: the tricks' batch, the forward, each head's loss
      with its terms, their mean, the device scaling; then, in training, the tricks' ``adjust_loss``). The loss is a
      sum divided by ``num_items_in_batch`` (each trick counting its own items), so gradient accumulation is exact
      for every loss. Float labels and regression heads keep the model's own loss (a one-time warning names the loss
      tricks it skips); ``teacher_logits`` batches get :func:`~nlp_tricks.losses.distillation_loss`; question
      answering the loss over start and end positions; ``compute_loss_func=`` works as on plain Trainer (refusing
      the loss tricks it would replace); causal LMs score the logits at t against the label at t + 1.
    - :meth:`training_step` is upstream's, unless a trick takes the step (adversarial training's extra passes).
    - :meth:`create_optimizer` builds :meth:`build_optimizer_groups` (no decay on biases and norms, ``head_lr_scale``,
      ``layer_decay``, the tricks' own rules) for the optimizer ``--optim`` names. The logged ``learning_rate`` is the
      body's on every model, ``lr/<group>`` each group's.
    - :meth:`evaluate`, :meth:`predict` and the final :meth:`save_model` run with the weights the tricks choose (the
      EMA's); predictions pass through the tricks (a CRF's Viterbi paths); every ``checkpoint-N`` holds the tricks'
      files and states, and :meth:`train` restores them on resume.
    - Run safety (docs/checkpoints.md): :meth:`train` locks ``output_dir`` for itself (one run per folder), stops at a
      non-finite loss, gradient norm or weight (``stop_on_nonfinite``: ``TrainingDivergedError``, nothing of that step
      saved), and each ``checkpoint-N`` ends with a checksum manifest that resume verifies.

    Extension points: :meth:`compute_tricks_loss`, :meth:`forward_for_loss`, :meth:`build_optimizer_groups`,
    :meth:`record_metric`, :attr:`trick_state`; upstream's signatures are kept for the methods it overrides. A trick
    of your own needs no subclass: see :class:`~nlp_tricks.Trick` and docs/tricks.md.
    """

    def __init__(
        self,
        model=None,
        args: TricksArguments | None = None,
        *positional,
        tricks: list[Trick] | tuple[Trick, ...] = (),
        **kwargs,
    ):
        if args is None:
            args = TricksArguments(output_dir="tmp_trainer")
        if not isinstance(args, TricksArguments):
            raise TypeError(
                f"TricksTrainer needs TricksArguments (a TrainingArguments subclass), got {type(args).__name__}; "
                "build it with the same fields: TricksArguments(output_dir=..., ...)"
            )
        for trick in tricks:
            if not isinstance(trick, Trick):
                raise TypeError(f"tricks=[...] takes nlp_tricks.Trick objects, got {type(trick).__name__}")
        #: The tricks of this run, in the order their hooks run (the built-in ones, then ``tricks=``).
        self.tricks: list[Trick] = built_in_tricks(args, user_tricks=tricks)
        if model is not None:
            for trick in self.tricks:
                trick.prepare_model(self, model)
        super().__init__(model, args, *positional, **kwargs)
        self._check_compute_loss_func()
        self._forward_accepts_loss_kwargs = self.model_accepts_loss_kwargs  # upstream's answer, for compute_loss_func
        self._warned: set[str] = set()
        # compute_loss normalises by `num_items_in_batch` for every model.
        _upstream.count_items_for_every_model(self)
        # Whether the loss scores the logits at position t against the label at t + 1. Upstream's Trainer decides it
        # twice: from the model's `loss_type` (which also sets its item count over `labels[..., 1:]`) and, in its
        # label-smoothing path, from the class name among the causal LMs. The first misses causal LMs whose class name
        # names no loss type (GPT2LMHeadModel: `loss_type` None), whose count would then include position 0; both
        # rules are taken here, and the result handed back so that upstream counts the items this loss divides by.
        self.loss_shifts_labels = self._decide_loss_shifts_labels(_upstream.loss_shifts_labels(self))
        _upstream.set_loss_shifts_labels(self, self.loss_shifts_labels)
        # Per-step numbers of the tricks (e.g. the adversarial loss), averaged into each training log.
        self._step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        # Cumulative state of the tricks (counters, schedules): logged as is, saved with checkpoints.
        self.trick_state: dict[str, float] = {}
        stepping = [trick for trick in self.tricks if trick.overrides("training_step")]
        if len(stepping) > 1:
            raise ValueError(
                f"{' and '.join(map(repr, stepping))} each run the whole training step; only one trick of a run may"
            )
        for trick in self.tricks:
            self.add_callback(trick)
            trick.setup(self)
        # SIGTERM / SIGUSR1 / --max_time: a checkpoint at a step boundary, then stop (docs/checkpoints.md).
        self.preemption: PreemptionCallback = install_preemption(self)
        self.preempted: str | None = None  # after train(): None, or what stopped it early ("SIGTERM", "max_time")
        # Run safety: a non-finite loss, gradient norm or weight stops training (or is skipped); added last, so it
        # can overrule the saves the callbacks above decide on (runtime/divergence.py, docs/checkpoints.md).
        self.divergence = install_divergence_guard(self)

    def get_trick(self, kind: type[Trick]) -> Trick | None:
        """The run's trick of class ``kind`` (the first one), or ``None``."""
        return next((trick for trick in self.tricks if isinstance(trick, kind)), None)

    def _first(self, hook: str, *args):
        """The first answer other than ``None`` of the tricks' ``hook``, in their order."""
        for trick in self.tricks:
            answer = getattr(trick, hook)(self, *args)
            if answer is not None:
                return answer
        return None

    # ---- Logging ---------------------------------------------------------------------------------------------------

    def record_metric(self, name: str, value: torch.Tensor | float) -> None:
        """Record a per-step number; the next training log shows its mean since the previous log (over processes)."""
        value = value.detach().float() if torch.is_tensor(value) else torch.tensor(float(value))
        self._step_metrics[name].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log (not eval, not the end-of-training summary)
            if self._step_metrics:
                names = sorted(self._step_metrics)
                means = torch.stack(
                    [torch.stack([v.to(self.args.device) for v in self._step_metrics[n]]).mean() for n in names]
                )
                if self.accelerator.num_processes > 1:
                    means = self.accelerator.reduce(means, reduction="mean")
                logs.update({n: round(float(m), 4) for n, m in zip(names, means)})
                self._step_metrics.clear()
            logs.update(self.trick_state)
            if self.optimizer is not None and "learning_rate" in logs:
                logs.update(group_learning_rates(self.optimizer.param_groups, logs["learning_rate"]))
        super().log(logs, start_time)

    # ---- Loss ------------------------------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """Run the model without its own loss and apply the configured loss to its logits.

        Returns the loss (and, with ``return_outputs``, the model's outputs with that loss first, as upstream's
        ``prediction_step`` expects). The labels are ``labels`` or the one column ``args.label_names`` names; question
        answering takes the loss over ``start_positions`` / ``end_positions`` as the model does. Where a trick cannot
        apply (float labels, a regression head) the model's own loss is used and a one-time warning says so. Inputs
        without labels go to the model as they are; a ``compute_loss_func`` given to the constructor is upstream's.
        In training, the tricks' ``adjust_loss`` then add their terms (:meth:`adjust_loss`).
        """
        if self.compute_loss_func is not None:
            loss, outputs = self._compute_loss_with_loss_func(model, inputs, num_items_in_batch)
        else:
            label_key = self._label_key(inputs)
            if label_key is None:
                loss, outputs = self._compute_loss_without_labels(model, inputs)
            else:
                loss, outputs = self._compute_labelled_loss(
                    model, inputs, label_key, num_items_in_batch, return_outputs
                )
        if model.training and torch.is_grad_enabled():
            adjusted = self.adjust_loss(inputs, outputs, loss, num_items_in_batch)
            if adjusted is not loss and return_outputs:
                outputs = self.outputs_with_loss(outputs, adjusted)
            loss = adjusted
        return (loss, outputs) if return_outputs else loss

    def _compute_labelled_loss(
        self, model: nn.Module, inputs: dict, label_key: str, num_items_in_batch, return_outputs
    ):
        """The loss pipeline of a batch with one label column; the order of its stages is the contract."""
        inputs = dict(inputs)
        labels = inputs.pop(label_key)
        loss_labels = self.labels_for_logits(labels, inputs.pop("shift_labels", None))
        teacher_logits = inputs.pop("teacher_logits", None)
        num_items = self._normalizer(num_items_in_batch)
        own_loss_reason = self._model_loss_reason(model, labels)
        if own_loss_reason is not None:
            # Regression / multi-label: the model's own loss is a mean over its label elements.
            self._warn_tricks_do_not_apply(model, own_loss_reason, teacher_logits is not None)
            outputs = model(**inputs, **{label_key: labels})
            loss = output_loss(outputs)
            if num_items is not None:
                loss = loss * labels.ne(-100).sum() / num_items
        else:
            self._add_decoder_input_ids(model, inputs, labels)
            batch = LossBatch(inputs, labels, loss_labels, teacher_logits, num_items)
            # 1. The batch (R-Drop: doubled).
            for trick in self.tricks:
                batch = trick.prepare_loss_batch(self, batch)
            # 2. The forward; a trick may compute its loss inside it (the CRF, so DDP / FSDP see its scores used).
            in_forward = self._first("loss_in_forward", batch)
            with in_forward or contextlib.nullcontext():
                outputs = self.forward_for_loss(model, batch.inputs, batch.labels)
            if in_forward is not None:
                loss = output_loss(outputs)
            else:
                # 3. The loss of each head's logits (multi-sample dropout: K heads), with the tricks' terms on them
                # (R-Drop's KL), then their mean.
                losses = []
                for logits in self.head_samples(output_logits(outputs)):
                    if batch.teacher_logits is not None:
                        sample_loss = self.compute_distillation_loss(logits, batch)
                    else:
                        sample_loss = self.compute_tricks_loss(logits, batch.loss_labels, num_items_in_batch=num_items)
                    for trick in self.tricks:
                        sample_loss = trick.adjust_logits_loss(self, logits, batch, sample_loss)
                    losses.append(sample_loss)
                loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
                if return_outputs:  # as a model given labels returns them
                    outputs = self.outputs_with_loss(outputs, loss)
        # 4. DDP averages gradients over processes: a loss normalised by the all-process count is scaled back up.
        if num_items is not None:
            loss = loss * self.loss_scale_for_devices()
        return loss, outputs

    def adjust_loss(self, inputs: dict, outputs, loss: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The training loss with every trick's ``adjust_loss`` term.

        The tricks see the micro-batch's mean loss per item; what they add is weighed by the micro-batch's share of
        the step's items (``local items / num_items_in_batch``, times the device scaling), as the loss itself is, so
        their terms stay exact under gradient accumulation and DDP. A trick that returns the loss unchanged leaves it
        bitwise unchanged.
        """
        adjusters = [trick for trick in self.tricks if trick.overrides("adjust_loss")]
        if not adjusters:
            return loss
        weight = self._micro_batch_weight(inputs, num_items_in_batch)
        mean = loss if weight is None else loss / weight
        adjusted = mean
        for trick in adjusters:
            adjusted = trick.adjust_loss(self, inputs, outputs, adjusted)
        if weight is None:
            return adjusted
        return loss + (adjusted - mean) * weight

    def _micro_batch_weight(self, inputs: dict, num_items_in_batch) -> torch.Tensor | None:
        """This micro-batch's share of the step's loss: its item count over ``num_items_in_batch``, times the
        device scaling; ``None`` where the loss is this batch's mean already."""
        num_items = self._normalizer(num_items_in_batch)
        label_key = self._label_key(inputs)
        if num_items is None or label_key is None:
            return None
        labels = self.labels_for_logits(inputs[label_key], inputs.get("shift_labels"))
        return self.count_items(labels) / num_items * self.loss_scale_for_devices()

    def count_items(self, labels: torch.Tensor) -> torch.Tensor:
        """The items of ``labels`` (shifted for a causal LM) the loss divides by: the first trick's count (a CRF's
        sentences, class weights' weight sum), else the labelled positions."""
        count = self._first("count_items", labels)
        return labels.ne(-100).sum() if count is None else count

    def forward_for_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor):
        """The forward pass whose logits the loss is taken on; ``inputs`` no longer hold ``labels``.

        ``labels`` are the batch's, unshifted. Extension point; by default the first trick's ``forward`` (scheduled
        sampling's two passes in training), else ``model(**inputs)``.
        """
        outputs = self._first("forward", model, inputs, labels)
        return model(**inputs) if outputs is None else outputs

    def head_samples(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """The logits of each head of the last forward the loss averages over (multi-sample dropout's K heads), or
        just ``[logits]``."""
        return self._first("head_samples", logits) or [logits]

    def compute_tricks_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The configured loss on ``logits`` (float32): a mean, or ``sum / num_items_in_batch``; the first trick's
        ``compute_loss`` (the CRF's, a user trick's, else the ``loss_type`` one)."""
        return self._first("compute_loss", logits, labels, num_items_in_batch)

    def compute_distillation_loss(self, logits: torch.Tensor, batch: LossBatch) -> torch.Tensor:
        """The loss of a batch that carries ``teacher_logits`` (self-training with soft labels)."""
        return distillation_loss(
            logits,
            batch.teacher_logits,
            batch.loss_labels,
            temperature=self.args.distill_temperature,
            alpha=self.args.distill_alpha,
            num_items_in_batch=batch.num_items,
        )

    # --- Causal LM ---

    def labels_for_logits(self, labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        """The label each logit position is scored against: ``shift_labels`` when the collator gives them
        (padding-free collators); for a model whose loss shifts labels (causal LMs), ``labels`` moved one position
        left with -100 at the end, so the logits at t predict the token at t + 1 and the last position nothing;
        otherwise ``labels``. Shifting the labels rather than slicing ``logits[:, :-1]`` keeps the (B, L, V) logits as
        the model returned them: no vocab-sized copy.
        """
        if shift_labels is not None:
            return shift_labels
        if not self.loss_shifts_labels:
            return labels
        return nn.functional.pad(labels[..., 1:], (0, 1), value=-100)

    def _decide_loss_shifts_labels(self, by_loss_type: bool) -> bool:
        """Upstream's rule from the loss type, or the (PEFT-unwrapped) class is a causal LM; never encoder-decoder."""
        model = unwrap_peft_model(self.model)
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        return bool(by_loss_type) or type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    def _set_signature_columns_if_needed(self):
        # Keep `teacher_logits` when the Trainer drops dataset columns the model's forward does not take.
        super()._set_signature_columns_if_needed()
        _upstream.keep_signature_column(self, "teacher_logits")

    def _add_decoder_input_ids(self, model: nn.Module, inputs: dict, labels: torch.Tensor) -> None:
        """Encoder-decoder models build decoder inputs from ``labels``; with labels popped we build them here.

        Only models that do so (those with ``prepare_decoder_input_ids_from_labels``, the generation heads): BART / T5
        sequence classification build theirs from ``input_ids`` with or without labels, so they are left to it.
        """
        unwrapped = self.accelerator.unwrap_model(model)
        config = getattr(unwrapped, "config", None)
        if (
            getattr(config, "is_encoder_decoder", False)
            and hasattr(unwrapped, "prepare_decoder_input_ids_from_labels")
            and "decoder_input_ids" not in inputs
            and "decoder_inputs_embeds" not in inputs
        ):
            inputs["decoder_input_ids"] = unwrapped.prepare_decoder_input_ids_from_labels(labels=labels)

    def _normalizer(self, num_items_in_batch):
        """The label count of the whole batch, as the loss's divisor (None: use a per-batch mean)."""
        if num_items_in_batch is None:
            return None
        if self.args.n_gpu > 1:
            # DataParallel: the Trainer hands one copy per replica, but our loss sees the gathered logits.
            if torch.is_tensor(num_items_in_batch) and num_items_in_batch.dim() > 0:
                num_items_in_batch = num_items_in_batch.reshape(-1)[0]
            if not self.args.average_tokens_across_devices:
                num_items_in_batch = num_items_in_batch * self.args.n_gpu
        return num_items_in_batch

    def loss_scale_for_devices(self) -> int:
        """DDP averages gradients over processes; a loss normalised by the all-process count is scaled back up."""
        if self.args.average_tokens_across_devices and self.args.n_gpu <= 1:
            return self.accelerator.num_processes // self.get_tp_size()
        return 1

    # ---- Drop-in compatibility -------------------------------------------------------------------------------------

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
        if model.training and self.args.rdrop_alpha > 0:
            self._warn_once(
                f"rdrop_alpha={self.args.rdrop_alpha} cannot apply to batches without one label column "
                "(question answering, several label columns): they train without it"
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
        unwrapped = self.accelerator.unwrap_model(model)
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
            name = type(self.accelerator.unwrap_model(model)).__name__
            self._warn_once(f"{', '.join(tricks)} cannot apply to {name} with {reason}: it trains on its own loss")

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

    @staticmethod
    def outputs_with_loss(outputs, loss: torch.Tensor):
        """The outputs as the model returns them given labels: the loss first (upstream's ``prediction_step`` takes
        a tuple's ``outputs[1:]`` as the predictions)."""
        if isinstance(outputs, ModelOutput):
            if "loss" in {f.name for f in dataclasses.fields(outputs)}:
                return type(outputs)(**{**outputs, "loss": loss})
            return outputs
        if isinstance(outputs, dict):
            return {"loss": loss, **outputs}
        if isinstance(outputs, (tuple, list)):
            return (loss, *outputs)
        return (loss, outputs)

    # ---- Model, items, predictions ---------------------------------------------------------------------------------

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if trial is None or self.hp_search_backend is None:  # a trial's tricks are built by _hp_search_setup
            for trick in self.tricks:
                trick.prepare_model(self, model)
        return model

    def _hp_search_setup(self, trial) -> None:
        """Upstream sets the trial's arguments on ``args``; the tricks are then checked and built again from them
        (every trick field applies in a trial, and a bad value is refused naming the field)."""
        super()._hp_search_setup(trial)
        if self.hp_search_backend is None or trial is None:
            return
        self.args.revalidate()
        built_in = tuple(BUILT_IN_TRICKS)
        for trick in self.tricks:
            self.remove_callback(trick)
        self.tricks = built_in_tricks(self.args, user_tricks=[t for t in self.tricks if not isinstance(t, built_in)])
        for trick in self.tricks:
            trick.prepare_model(self, self.model)
            self.add_callback(trick)
            trick.setup(self)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
        """Upstream counts labelled positions; a trick may count other items (a CRF's sentences, class weights' weight
        sums), so each loss's divisor is its own item count over the whole accumulated, all-process batch."""
        labels = [batch.get("labels") for batch in batch_samples]
        if labels and all(torch.is_tensor(x) and not x.is_floating_point() for x in labels):
            if self.loss_shifts_labels:  # causal LMs: position t is scored against label t + 1
                labels = [x[..., 1:] for x in labels]
            counts = [self._first("count_items", x.to(device)) for x in labels]
            if all(count is not None for count in counts):
                return _upstream.reduce_item_count(self, sum(counts), device)
        return super()._get_num_items_in_batch(batch_samples, device)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Upstream's step, with the logits passed through the tricks (a CRF's Viterbi paths as one-hot scores)."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        changing = [trick for trick in self.tricks if trick.overrides("prediction_step")]
        if changing and logits is not None:
            first = logits[0] if isinstance(logits, (tuple, list)) else logits
            for trick in changing:
                first = trick.prediction_step(self, first, inputs)
            logits = type(logits)([first, *logits[1:]]) if isinstance(logits, (tuple, list)) else first
        return loss, logits, labels

    # ---- Optimizer -------------------------------------------------------------------------------------------------

    def build_optimizer_groups(self, model: nn.Module) -> list[dict]:
        """Parameter groups for the optimizer, from :func:`~nlp_tricks.build_param_groups`, the arguments and the
        tricks' rules (a CRF's scores: their own lr, no weight decay)."""
        no_decay, module_lr_scales = NO_DECAY_PATTERNS, {}
        for trick in self.tricks:
            options = trick.param_group_options(self, model)
            no_decay = no_decay + tuple(options.get("no_decay", ()))
            module_lr_scales.update(options.get("module_lr_scales") or {})
        groups = build_param_groups(
            model,
            learning_rate=self.args.learning_rate,
            weight_decay=self.args.weight_decay,
            head_lr_scale=self.args.head_lr_scale,
            layer_decay=self.args.layer_decay,
            no_decay=no_decay,
            module_lr_scales=module_lr_scales or None,
        )
        for group in groups:
            group.pop("names")
        return groups

    def create_optimizer(self, model=None):
        """The optimizer ``--optim`` names, over :meth:`build_optimizer_groups`' groups."""
        opt_model = self.model if model is None else model
        if self.optimizer is not None:
            return self.optimizer
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        builds_own_groups = _upstream.is_optimizer_factory(optimizer_cls) or any(
            key in optimizer_kwargs for key in ("params", "model", "optimizer_dict")
        )
        if builds_own_groups:
            if self.args.head_lr_scale != 1.0 or self.args.layer_decay != 1.0:
                raise ValueError(
                    f"optim={self.args.optim!r} builds its own parameter groups, so head_lr_scale and layer_decay "
                    "cannot apply; set both to 1.0 or choose another optimizer"
                )
            return super().create_optimizer(model)
        groups = self.build_optimizer_groups(opt_model)
        # Saved with each checkpoint: a resume whose settings would build other groups is refused, naming them.
        self._trick_state_callback().optimizer_groups = self._group_signature(groups)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def _group_signature(self, groups: list[dict]) -> dict:
        settings = {name: getattr(self.args, name) for name in ("head_lr_scale", "layer_decay", "weight_decay")}
        return group_signature(groups, {**settings, "tricks": [s for t in self.tricks for s in t.summary()]})

    # --- Checkpoints ---

    @property
    def trick_state(self) -> dict[str, float]:
        """Cumulative numbers of the tricks (counters, schedules): logged as they are, saved with each checkpoint in
        ``trainer_state.json`` and restored on resume (held by a :class:`~nlp_tricks.resume.TrickStateCallback`).
        """
        return self._trick_state_callback().trick_state

    @trick_state.setter
    def trick_state(self, value: dict[str, float]) -> None:
        self._trick_state_callback().trick_state = dict(value)

    def _trick_state_callback(self) -> TrickStateCallback:
        # Looked up each time: with `restore_callback_states_from_checkpoint` the Trainer swaps in a new instance.
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, TrickStateCallback):
                return callback
        callback = TrickStateCallback()
        self.add_callback(callback)
        return callback

    def _trick_states_file_needed(self) -> bool:
        return any(trick.has_state() for trick in self.tricks)

    @property
    def required_checkpoint_files(self) -> tuple[str, ...]:
        """Files the tricks of this run need in a ``checkpoint-N`` folder to resume from it (their saved state)."""
        files = [name for trick in self.tricks for name in trick.checkpoint_files(self)]
        if self._trick_states_file_needed():
            files.append(TRICKS_STATE_NAME)
        return tuple(files)

    @holds_output_dir  # run safety: one run per output folder, locked for the whole call (runtime/lock.py)
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        """Upstream ``train``; ``resume_from_checkpoint=True`` picks the newest COMPLETE ``checkpoint-N``, and the
        tricks' state is restored from it.

        Upstream takes the highest-numbered folder, even one a crash left half-written; here newer incomplete
        folders are skipped with a warning naming them and what is wrong (see
        :func:`~nlp_tricks.resume.checkpoint_problem`), and a named checkpoint that is incomplete raises.
        """
        required = self.required_checkpoint_files
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_complete_checkpoint(self.args.output_dir, required)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output directory ({self.args.output_dir})")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            problem = checkpoint_problem(resume_from_checkpoint, required)
            if problem is not None:
                raise ValueError(f"resume_from_checkpoint={str(resume_from_checkpoint)!r} is incomplete: {problem}")
        checkpoint = os.fspath(resume_from_checkpoint) if resume_from_checkpoint else None
        if checkpoint is not None and self.model is not None:
            current = self._group_signature(self.build_optimizer_groups(self.model))
            problem = optimizer_groups_problem(checkpoint, current)
            if problem is not None:
                raise ValueError(f"resume_from_checkpoint={checkpoint!r}: {problem}")
        for trick in self.tricks:
            trick.resume(self, checkpoint)
        if checkpoint is not None and self._trick_states_file_needed():
            states = checkpoint_trick_states(checkpoint) or {}
            for trick in self.tricks:
                if trick.has_state() and trick.state_name in states:
                    trick.load_state_dict(states[trick.state_name])
        with self.preemption.signal_handlers():  # restored even if training raises
            output = super().train(
                resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
            )
        self.divergence.raise_if_diverged()  # run safety: a diverged run returns nothing that looks finished
        self.preempted = self.preemption.stopped_by
        if self.preempted is None:  # a stopped run is not finished: no SWA average, no best EMA
            for trick in self.tricks:
                trick.train_end(self)
        return output

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Upstream's training step, unless a trick runs the step (``--adversarial``: the attack's passes added;
        the returned, logged loss is the clean one)."""
        loss = None
        for trick in self.tricks:
            if trick.overrides("training_step"):
                loss = trick.training_step(self, model, inputs, num_items_in_batch)
                if loss is not None:
                    break
        if loss is None:
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.divergence.record_loss(loss)  # run safety: the raw loss (upstream's logging_nan_inf_filter hides NaN)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        """Upstream's gradient norm of the step, before its optimizer step; the divergence guard checks it."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.divergence.record_grad_norm(grad_norm)  # run safety
        return grad_norm

    def _save_checkpoint(self, model, trial) -> None:
        """Upstream's checkpoint save, then its checksum manifest; a full disk is one line and leaves no torn
        ``checkpoint-N`` (runtime/integrity.py)."""
        with checkpoint_written(self, trial):  # run safety
            super()._save_checkpoint(model, trial)

    # ---- Evaluation and saving -------------------------------------------------------------------------------------

    @property
    def ema(self) -> EMA | None:
        """The :class:`~nlp_tricks.averaging.EMA` of the model (``--ema_decay``), built when training starts."""
        trick = self.get_trick(ExponentialMovingAverage)
        return None if trick is None else trick.ema

    def _eval_weights(self):
        """The weights the tricks choose for evaluation and the final model (the EMA's with ``--ema_eval``)."""
        return nested(trick.eval_weights(self) for trick in self.tricks)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval", **kwargs):
        """Upstream ``evaluate``, with the weights the tricks choose (``--ema_eval``: the EMA's; the raw ones are
        restored bitwise after)."""
        with self._eval_weights():
            return super().evaluate(
                eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs
            )

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test", **kwargs):
        """Upstream ``predict``, with the weights the tricks choose (as :meth:`evaluate`)."""
        with self._eval_weights():
            return super().predict(
                test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs
            )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Upstream ``save_model``, plus the tricks' files.

        - Into a ``checkpoint-N`` folder: the raw weights, each trick's files (the EMA's ``ema_state.safetensors``)
          and the states of tricks that keep one (``tricks_state.safetensors``), all written before
          ``trainer_state.json``, so a complete checkpoint holds them.
        - Anywhere else (the final model): the weights the tricks choose (the EMA's with ``--ema_eval``, the
          checkpoint average after ``--swa_last_k``), with an ``averaging.json`` beside them saying so.
        """
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if CHECKPOINT_RE.match(os.path.basename(os.path.normpath(output_dir))):
            super().save_model(output_dir, _internal_call)
            if self.args.should_save:
                for trick in self.tricks:
                    trick.save_checkpoint(self, output_dir)
                if self._trick_states_file_needed():
                    states = {trick.state_name: trick.state_dict() for trick in self.tricks if trick.has_state()}
                    save_trick_states(os.path.join(output_dir, TRICKS_STATE_NAME), states)
            return
        info = self._first("saved_weights_info")
        with self._eval_weights():
            super().save_model(output_dir, _internal_call)
        if self.args.should_save and os.path.isdir(output_dir):
            if info is not None:
                write_averaging_info(output_dir, info)
            elif os.path.isfile(os.path.join(output_dir, AVERAGING_INFO_NAME)):
                os.remove(os.path.join(output_dir, AVERAGING_INFO_NAME))  # left by an earlier run: no longer true

    def create_model_card(self, *args, tags: str | list[str] | None = None, **kwargs) -> None:
        """Upstream's model card, tagged ``nlp-tricks``, with a section naming the tricks of the run and which
        weights were saved (the EMA's, a checkpoint average)."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        super().create_model_card(*args, tags=[*tags, "nlp-tricks"], **kwargs)
        path = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.isfile(path):
            return
        with open(path, "a", encoding="utf-8") as f:
            f.write(tricks_section(self.tricks, self._first("saved_weights_info")))
