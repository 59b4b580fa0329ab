"""TricksTrainer: a ``transformers.Trainer`` that wires the tricks of nlp_tricks in, driven by TricksArguments."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import weakref
from collections import defaultdict

import torch
from accelerate.utils import DistributedType, is_compiled_module
from accelerate.utils.memory import clear_device_cache
from torch import nn
from transformers import Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_utils import unwrap_peft_model
from transformers.utils import ModelOutput

from . import _upstream
from .adversarial import AWP, FGM, PGD, FreeLB  # --- Adversarial ---
from .averaging import (  # --- Weight averaging ---
    AVERAGING_INFO_NAME,
    EMA,
    EMA_STATE_NAME,
    EMACallback,
    average_into,
    ema_unsupported_reason,
    last_complete_checkpoints,
    write_averaging_info,
)
from .config import TricksArguments
from .crf import CRF, add_crf, compact, expand  # --- Heads and labels ---
from .heads import MultiSampleDropout
from .losses import (
    balanced_class_weights,
    cross_entropy,
    distillation_loss,
    focal_alpha_weights,
    focal_loss,
    label_smoothing_cross_entropy,
    rdrop_kl,
)
from .neftune import NEFTuneNoise  # --- NEFTune with adversarial ---
from .outputs import output_logits, output_loss
from .param_groups import NO_DECAY_PATTERNS, build_param_groups
from .preemption import PreemptionCallback, install_preemption  # --- Preemption ---
from .resume import CHECKPOINT_RE, TrickStateCallback, checkpoint_problem, get_last_complete_checkpoint
from .scheduled_sampling import (  # --- Scheduled sampling ---
    ScheduledSampler,
    ScheduledSamplingDraw,
    causal_scheduled_sampling_forward,
)

__all__ = ["TricksTrainer"]

logger = logging.getLogger(__name__)


class TricksTrainer(Trainer):
    """A drop-in ``transformers.Trainer`` whose tricks are switched on by :class:`TricksArguments`.

    What it changes, and nothing else (training loop, mixed precision, DDP / FSDP / DeepSpeed, clipping, schedulers,
    logging and checkpoints stay upstream's):

    - :meth:`compute_loss` pops ``labels``, runs the model without its own loss and applies ``args.loss_type``
      (cross-entropy, focal or label smoothing) to ``logits / args.temperature``. The loss is a sum divided by
      ``num_items_in_batch`` (the label count of the whole accumulated, all-process batch), so gradient accumulation
      is exact for every loss. Float labels (regression, multi-label) and regression heads keep the model's own loss,
      rescaled likewise, and warn once if a loss trick is set. A batch that carries ``teacher_logits`` (self-training
      with soft labels) gets :func:`~nlp_tricks.losses.distillation_loss` at ``args.distill_temperature`` /
      ``args.distill_alpha`` instead. Question answering gets the loss over start and end positions (their mean, as
      the models' own); a single custom ``label_names`` column is the labels. ``compute_loss_func=`` works as on
      plain Trainer (and refuses the loss tricks it would replace). See docs/compatibility.md.
      For causal LMs (PEFT-wrapped ones too) every loss scores the logits at position t against the label at
      t + 1 (or the collator's ``shift_labels``), as the model's own loss does; the item count is over those labels.
    - Heads and labels (docs/heads.md): ``crf`` attaches a CRF (``model.crf``) whose negative log-likelihood over
      the labelled positions is the loss (per sentence) and whose Viterbi paths are the predictions (one-hot scores
      from :meth:`prediction_step`); ``class_weights`` weigh ``ce`` / ``label_smoothing`` like
      ``F.cross_entropy(weight=)``; ``head_dropout_samples`` averages the losses of K dropout masks on the head's
      input. Their item counts (sentences, weight sums) replace the token count in ``num_items_in_batch``.
    - Scheduled sampling on decoder-only causal LMs (``--scheduled_sampling``, ``--ss_*``): in training,
      :meth:`forward_for_loss` runs the model teacher-forced under ``no_grad``, replaces each completion token (label
      not -100) by its prediction with probability ``1 - ratio`` and returns a second pass on that input, whose logits
      the configured loss is taken on. With FGM / PGD every pass of a micro-batch reuses the clean pass's draw.
    - :meth:`create_optimizer` builds the groups of :func:`~nlp_tricks.build_param_groups` (no decay on biases and
      norms, ``head_lr_scale``, ``layer_decay``) for the optimizer ``--optim`` names. Schedulers scale every group's
      lr by the same factor, so the ratios hold through warmup and decay. The logged ``learning_rate`` is the body's
      (``args.learning_rate`` times the schedule) on every model, ``lr/<group>`` each group's.
    - Weight averaging (``--ema_decay``, ``--ema_eval``, ``--swa_last_k``; :mod:`nlp_tricks.averaging`): an
      :class:`~nlp_tricks.averaging.EMA` updated after every optimizer step, saved in every checkpoint and restored
      on resume; :meth:`evaluate`, :meth:`predict` and the final :meth:`save_model` swap it in (the raw weights come
      back bitwise); or the average of the last checkpoints loaded at the end of training.

    Extension points for subclasses:

    - :meth:`compute_tricks_loss` ``(logits, labels, num_items_in_batch=None)``: the loss on the logits. Override it to
      add a loss; call ``super()`` for the built-in ones.
    - :meth:`build_optimizer_groups` ``(model)``: the optimizer's parameter groups.
    - ``compute_loss`` / ``create_optimizer`` keep upstream's signatures and may be overridden as on any Trainer.

    Example::

        from nlp_tricks import TricksArguments, TricksTrainer, focal_loss

        class MyTrainer(TricksTrainer):
            def compute_tricks_loss(self, logits, labels, num_items_in_batch=None):
                loss = super().compute_tricks_loss(logits, labels, num_items_in_batch=num_items_in_batch)
                # e.g. add an auxiliary focal term on the same logits
                return loss + 0.1 * focal_loss(logits, labels, gamma=1.0, num_items_in_batch=num_items_in_batch)

        args = TricksArguments(output_dir="out", loss_type="label_smoothing", label_smoothing_factor=0.1,
                               layer_decay=0.9, head_lr_scale=10.0, warmup_ratio=0.1)
        MyTrainer(model=model, args=args, train_dataset=train, data_collator=collator).train()
    """

    def __init__(self, model=None, args: TricksArguments | None = None, *positional, **kwargs):
        if args is None:
            args = TricksArguments(output_dir="tmp_trainer")
        if not isinstance(args, TricksArguments):
            raise TypeError(
                f"TricksTrainer needs TricksArguments (a TrainingArguments subclass), got {type(args).__name__}; "
                "build it with the same fields: TricksArguments(output_dir=..., ...)"
            )
        self._msd: MultiSampleDropout | None = None  # --- Heads and labels ---
        self._crf_hook: _CRFLossHook | None = None
        if model is not None:
            self._prepare_heads(model, args)
        super().__init__(model, args, *positional, **kwargs)
        # --- Drop-in compatibility ---
        self._check_compute_loss_func()
        self._forward_accepts_loss_kwargs = self.model_accepts_loss_kwargs  # upstream's answer, for compute_loss_func
        self._warned: set[str] = set()
        self._class_weights = self._resolve_class_weights()
        # compute_loss normalises by `num_items_in_batch` for every model.
        _upstream.count_items_for_every_model(self)
        # --- Causal LM ---
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
        # --- Adversarial ---
        self._adversary: FGM | PGD | AWP | FreeLB | None = None
        if self.args.adversarial != "none":
            self.trick_state.setdefault("adv_skipped", 0)
            if self.args.adv_start_step > 0:
                self.trick_state.setdefault("adv_plain_steps", 0)
        # --- R-Drop ---
        self._rdrop_checked = False  # the first R-Drop batch checks that the model has active dropout
        # --- NEFTune with adversarial ---
        # Upstream's NEFTune hook draws fresh noise at every forward, so the attack's passes would see other noise
        # than the clean pass they perturb. training_step adds the noise itself instead: drawn in the clean pass,
        # replayed in the adversarial ones (nlp_tricks.neftune). Without --adversarial upstream's hook stays.
        self._attack_neftune_alpha = None
        if self.neftune_noise_alpha is not None and self.args.adversarial != "none":
            self._attack_neftune_alpha, self.neftune_noise_alpha = self.neftune_noise_alpha, None
        # --- Weight averaging ---
        self._ema_callback: EMACallback | None = None
        self._swa_checkpoints: list[str] | None = None
        if self.args.ema_decay > 0:
            problem = ema_unsupported_reason(self)
            if problem is not None:
                raise ValueError(problem)
            self._ema_callback = EMACallback(self.args.ema_decay, warmup=self.args.ema_warmup)
            self.add_callback(self._ema_callback)
        # --- Preemption ---: replaces upstream's in-step JIT save (docs/checkpoints.md)
        self.preemption: PreemptionCallback = install_preemption(self)
        self.preempted: str | None = None  # after train(): None, or what stopped it early ("SIGTERM", "max_time")
        # --- Scheduled sampling ---
        self.scheduled_sampler: ScheduledSampler | None = None
        # While one micro-batch's passes share a draw (FGM / PGD): {"draw": the first pass's draw}; else None.
        self._ss_shared: dict | None = None
        if self.args.scheduled_sampling != "none":
            args = self.args
            self.scheduled_sampler = ScheduledSampler(args.scheduled_sampling, args.ss_k, args.ss_min_ratio)
            if self.model is not None:
                self._check_scheduled_sampling_model(self.accelerator.unwrap_model(self.model))

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
                self._log_learning_rates(logs)
        super().log(logs, start_time)

    def _log_learning_rates(self, logs: dict[str, float]) -> None:
        """``learning_rate``: the body's (``args.learning_rate`` times the schedule) whichever group comes first.

        Upstream logs group 0's lr, which is the head's on models that register their head first (XLM-R) and the
        embeddings' with layer-wise decay. With the groups of :meth:`build_optimizer_groups` (they carry
        ``lr_scale``) it is the body's on every model, and ``lr/<label>`` gives each group's when they differ.
        """
        groups = self.optimizer.param_groups
        initial = [g.get("initial_lr", g["lr"]) for g in groups]
        if initial[0] <= 0:
            return
        if groups[0].get("lr_scale", 0) > 0:
            logs["learning_rate"] = logs["learning_rate"] / groups[0]["lr_scale"]
            reference = initial[0] / groups[0]["lr_scale"]
        else:  # groups built elsewhere: relative to group 0, as upstream's `learning_rate`
            reference = initial[0]
        if len(set(initial)) > 1:
            for i, group in enumerate(groups):
                logs[f"lr/{group.get('label', i)}"] = logs["learning_rate"] * initial[i] / reference

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
        """
        if self.compute_loss_func is not None:
            return self._compute_loss_with_loss_func(model, inputs, return_outputs, num_items_in_batch)
        label_key = self._label_key(inputs)
        if label_key is None:
            if self.args.rdrop_alpha > 0 and model.training:  # --- R-Drop ---
                self._warn_once(
                    f"rdrop_alpha={self.args.rdrop_alpha} cannot apply to batches without one label column "
                    "(question answering, several label columns): they train without it"
                )
            return self._compute_loss_without_labels(model, inputs, return_outputs)
        inputs = dict(inputs)
        labels = inputs.pop(label_key)
        loss_labels = self.labels_for_logits(labels, inputs.pop("shift_labels", None))  # --- Causal LM ---
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
            if teacher_logits is not None and (self.args.crf or self._class_weights is not None):
                raise ValueError("crf and class_weights do not apply to batches with teacher_logits (distillation)")
            rdrop = self.args.rdrop_alpha > 0 and model.training  # --- R-Drop ---
            if rdrop:
                inputs, labels, loss_labels, teacher_logits = self._rdrop_double(
                    inputs, labels, loss_labels, teacher_logits
                )
            if self._crf_hook is not None:
                # The CRF's loss is computed inside the model's forward (a hook), as a built-in CRF head would, so
                # DDP / FSDP see its scores used by the forward; the outputs come back with that loss.
                with self._crf_hook.computing(loss_labels, num_items):
                    outputs = self.forward_for_loss(model, inputs, labels)
                loss = output_loss(outputs)
            else:
                outputs = self.forward_for_loss(model, inputs, labels)
                # Multi-sample dropout: the mean of the K heads' losses (the returned logits are the first head's).
                losses = []
                samples = self._head_samples(output_logits(outputs))
                for logits in samples:
                    if teacher_logits is not None:
                        losses.append(
                            distillation_loss(
                                logits,
                                teacher_logits,
                                loss_labels,
                                temperature=self.args.distill_temperature,
                                alpha=self.args.distill_alpha,
                                num_items_in_batch=num_items,
                            )
                        )
                    else:
                        losses.append(self.compute_tricks_loss(logits, loss_labels, num_items_in_batch=num_items))
                loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
                if rdrop:  # --- R-Drop ---: the loss summed both passes per item (a mean over the doubled batch: x 2)
                    kl = [
                        self.compute_rdrop_loss(logits, loss_labels, num_items_in_batch=num_items)
                        for logits in samples
                    ]
                    loss = (loss if num_items is not None else 2 * loss) + (
                        kl[0] if len(kl) == 1 else torch.stack(kl).mean()
                    )
                if return_outputs:
                    outputs = self._outputs_with_loss(outputs, loss)
        if num_items is not None:
            loss = loss * self._loss_scale_for_devices()
        return (loss, outputs) if return_outputs else loss

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

    def forward_for_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor):
        """The forward pass whose logits the loss is taken on; ``inputs`` no longer hold ``labels``.

        ``labels`` are the batch's, unshifted. Extension point: in training with ``scheduled_sampling`` this runs its
        two passes (causal LMs here, encoder-decoders in Seq2SeqTricksTrainer), see :meth:`scheduled_sampling_passes`.
        """
        if self.scheduled_sampler is not None and model.training:  # --- Scheduled sampling ---
            outputs = self._scheduled_sampling_forward(model, inputs, labels)
            if outputs is not None:
                return outputs
        return model(**inputs)

    def compute_tricks_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The configured loss on ``logits / temperature`` (float32): a mean, or ``sum / num_items_in_batch``."""
        args = self.args
        if args.crf:
            return self.crf_loss(logits, labels, num_items_in_batch=num_items_in_batch)
        if args.temperature != 1.0:
            logits = logits / args.temperature
        if args.loss_type == "focal":
            return focal_loss(
                logits,
                labels,
                gamma=args.focal_gamma,
                alpha=self._focal_alpha(),
                num_items_in_batch=num_items_in_batch,
            )
        if args.loss_type == "label_smoothing" or args.label_smoothing_factor > 0:
            return label_smoothing_cross_entropy(
                logits,
                labels,
                epsilon=args.label_smoothing_factor,
                num_items_in_batch=num_items_in_batch,
                weight=self._class_weights,
            )
        return cross_entropy(logits, labels, num_items_in_batch=num_items_in_batch, weight=self._class_weights)

    def _focal_alpha(self) -> list[float] | None:
        """``args.focal_alpha``, one weight per class of the model (:func:`~nlp_tricks.losses.focal_alpha_weights`)."""
        if self.args.focal_alpha is None:
            return None
        id2label = getattr(self.accelerator.unwrap_model(self.model).config, "id2label", None) or {}
        names = [str(id2label[i]) for i in sorted(id2label)]
        return focal_alpha_weights(self.args.focal_alpha, names)

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

    def _loss_scale_for_devices(self) -> int:
        """DDP averages gradients over processes; a loss normalised by the all-process count is scaled back up."""
        if self.args.average_tokens_across_devices and self.args.n_gpu <= 1:
            return self.accelerator.num_processes // self.get_tp_size()
        return 1

    # --- Drop-in compatibility ---

    def _loss_tricks_in_use(self) -> list[str]:
        """The loss tricks switched on, as ``field=value``: what the model's own loss or compute_loss_func skips."""
        args = self.args
        tricks = []
        if args.loss_type != "ce":
            tricks.append(f"loss_type={args.loss_type!r}")
        if args.label_smoothing_factor > 0:
            tricks.append(f"label_smoothing_factor={args.label_smoothing_factor}")
        if args.temperature != 1.0:
            tricks.append(f"temperature={args.temperature}")
        # --- Heads and labels ---
        if args.crf:
            tricks.append("crf=True")
        if args.class_weights is not None:
            tricks.append(f"class_weights={args.class_weights!r}")
        if args.head_dropout_samples > 1 or args.head_dropout > 0:
            tricks.append(f"head_dropout_samples={args.head_dropout_samples}, head_dropout={args.head_dropout}")
        if args.rdrop_alpha > 0:  # --- R-Drop ---
            tricks.append(f"rdrop_alpha={args.rdrop_alpha}")
        return tricks

    def _check_compute_loss_func(self) -> None:
        """A ``compute_loss_func`` replaces the training loss: refuse the tricks it would silently switch off."""
        if self.compute_loss_func is None:
            return
        refused = self._loss_tricks_in_use()
        if getattr(self.args, "scheduled_sampling", "none") != "none":
            refused.append(f"scheduled_sampling={self.args.scheduled_sampling!r}")
        if refused:
            raise ValueError(
                f"compute_loss_func replaces the training loss, so {', '.join(refused)} would not apply; "
                "reset them to their defaults or drop compute_loss_func (override compute_tricks_loss to add a loss "
                "to the tricks' one)"
            )

    def _compute_loss_with_loss_func(self, model, inputs, return_outputs, num_items_in_batch):
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
            return super().compute_loss(model, dict(inputs), return_outputs, num_items_in_batch)
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

    def _compute_loss_without_labels(self, model: nn.Module, inputs: dict, return_outputs: bool):
        """No single label column: question answering's positions, several label columns, or none at all."""
        names = self.label_names
        if set(names) == {"start_positions", "end_positions"} and all(inputs.get(n) is not None for n in names):
            return self._question_answering_loss(model, inputs, return_outputs)
        if len(names) > 1 and any(inputs.get(name) is not None for name in names):
            self._warn_tricks_do_not_apply(model, f"several label columns ({', '.join(names)})")
            outputs = model(**inputs)  # not upstream's compute_loss: its label smoother would take `labels` alone
            loss = output_loss(outputs)
            return (loss, outputs) if return_outputs else loss
        return super().compute_loss(model, inputs, return_outputs=return_outputs)

    def _question_answering_loss(self, model: nn.Module, inputs: dict, return_outputs: bool):
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
            return super().compute_loss(model, inputs, return_outputs=return_outputs)
        logits = (outputs["start_logits"], outputs["end_logits"]) if isinstance(outputs, dict) else outputs[:2]
        losses = []
        for logit, position in zip(logits, positions):
            if position.dim() > 1:
                position = position.squeeze(-1)
            ignored = logit.size(1)
            position = position.to(logit.device).clamp(0, ignored)
            losses.append(self.compute_tricks_loss(logit, position.masked_fill(position == ignored, -100)))
        loss = (losses[0] + losses[1]) / 2
        return (loss, self._outputs_with_loss(outputs, loss)) if return_outputs else loss

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
    def _outputs_with_loss(outputs, loss: torch.Tensor):
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

    # --- Heads and labels -------------------------------------------------------------------------------------------

    def _prepare_heads(self, model: nn.Module, args: TricksArguments) -> None:
        """Attach the CRF (``model.crf``) and the multi-sample dropout hooks the arguments ask for."""
        if args.crf:
            add_crf(model, bio_constraints=args.crf_bio_constraints)
            if self._crf_hook is not None:
                self._crf_hook.remove()
            self._crf_hook = _CRFLossHook(self, model)
        if args.head_dropout_samples > 1 or args.head_dropout > 0:
            if self._msd is not None:
                self._msd.remove()
            self._msd = MultiSampleDropout.attach(model, args.head_dropout_samples, args.head_dropout)

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        self._prepare_heads(model, self.args)
        return model

    def _head_samples(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """The logits of each multi-sample dropout head of the last forward (just ``[logits]`` without it)."""
        samples = self._msd.take() if self._msd is not None else None
        if samples is None:
            return [logits]
        if samples.shape[1:] != logits.shape:
            raise ValueError(
                f"head_dropout_samples: the head's output {tuple(samples.shape[1:])} is not the model's logits "
                f"{tuple(logits.shape)}; multi-sample dropout needs a model that returns its head's output as logits"
            )
        return list(samples.unbind(0))

    def crf_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The CRF's negative log-likelihood of the word-level tags (positions labelled -100 skipped), summed over
        sentences and divided by ``num_items_in_batch`` (sentences with a label in the whole batch; without it the
        mean over this batch's sentences)."""
        if logits.dim() != 3 or labels.dim() != 2:
            raise ValueError(
                f"crf needs token classification logits (batch, length, num_labels) and labels (batch, length); got "
                f"{tuple(logits.shape)} and {tuple(labels.shape)}"
            )
        emissions, tags, lengths, _ = compact(logits, labels)
        nll = -self.model.crf.log_likelihood_lengths(emissions, tags, lengths).sum()
        if num_items_in_batch is None:
            return nll / (lengths > 0).sum().clamp(min=1)
        return nll / num_items_in_batch

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Upstream's step; with ``crf`` the logits returned are the Viterbi paths as one-hot scores at the labelled
        positions (argmax of the logits elsewhere), so argmax-based metrics score the paths."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self.args.crf and logits is not None:
            if isinstance(logits, (tuple, list)):
                logits = type(logits)([self._viterbi_one_hot(logits[0], inputs)] + list(logits[1:]))
            else:
                logits = self._viterbi_one_hot(logits, inputs)
        return loss, logits, labels

    def _viterbi_one_hot(self, logits: torch.Tensor, inputs: dict) -> torch.Tensor:
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(
                "crf prediction decodes the labelled positions (each word's first sub-token), so the batch needs "
                "`labels` (any tag id there, -100 elsewhere); for raw text call model.crf.decode(logits, word_mask)"
            )
        labels = labels.to(logits.device)
        emissions, _, lengths, order = compact(logits, labels)
        paths = self.model.crf.viterbi_lengths(emissions, lengths)
        tags = expand(paths, order, lengths.to(logits.device), logits.argmax(dim=-1))
        return torch.nn.functional.one_hot(tags, logits.shape[-1]).to(logits.dtype)

    def _resolve_class_weights(self) -> torch.Tensor | None:
        """``args.class_weights`` as a float32 (C,) tensor; 'balanced' is computed from the training labels."""
        weights = self.args.class_weights
        if weights is None:
            return None
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        num_labels = getattr(config, "num_labels", None)
        if weights == "balanced":
            labels = _dataset_labels(self.train_dataset)
            if labels is None or num_labels is None:
                raise ValueError(
                    "class_weights='balanced' counts the `labels` of the training dataset and needs the model's "
                    "config.num_labels; pass train_dataset (with a `labels` column) or give the weights as numbers"
                )
            weights = balanced_class_weights(labels, num_labels)
            logger.info(f"class_weights='balanced': {[round(w, 4) for w in weights]}")
        elif num_labels is not None and len(weights) != num_labels:
            id2label = getattr(config, "id2label", None) or {}
            order = ", ".join(f"{i}={id2label.get(i, i)}" for i in range(num_labels))
            raise ValueError(
                f"class_weights has {len(weights)} weights for {num_labels} classes; give one weight per class in "
                f"this order: {order}"
            )
        return torch.tensor(weights, dtype=torch.float32, device=self.args.device)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
        """Upstream counts labelled tokens; with ``crf`` an item is a sentence with a label, and with
        ``class_weights`` a token weighs its class's weight, so each loss's divisor is its own item count (or weight
        sum) over the whole accumulated, all-process batch, as F.cross_entropy(weight=...) over that batch."""
        labels = [batch.get("labels") for batch in batch_samples]
        counted = (self.args.crf or self._class_weights is not None) and labels
        if not counted or not all(torch.is_tensor(x) and not x.is_floating_point() for x in labels):
            return super()._get_num_items_in_batch(batch_samples, device)
        if self.loss_shifts_labels:  # causal LMs: position t is scored against label t + 1
            labels = [x[..., 1:] for x in labels]
        if self.args.crf:
            count = sum(x.ne(-100).any(dim=-1).sum() for x in labels)
        else:
            weight = self._class_weights.to(device)
            count = sum(weight[x.to(device).clamp(min=0)].mul(x.to(device).ne(-100)).sum() for x in labels)
        return _upstream.reduce_item_count(self, count, device)

    # ---- Optimizer -------------------------------------------------------------------------------------------------

    def build_optimizer_groups(self, model: nn.Module) -> list[dict]:
        """Parameter groups for the optimizer, from :func:`~nlp_tricks.build_param_groups` and the arguments."""
        crf = self.args.crf and isinstance(getattr(model, "crf", None), CRF)
        groups = build_param_groups(
            model,
            learning_rate=self.args.learning_rate,
            weight_decay=self.args.weight_decay,
            head_lr_scale=self.args.head_lr_scale,
            layer_decay=self.args.layer_decay,
            # The CRF's scores are biases of the tag sequence: their own lr, no weight decay.
            no_decay=NO_DECAY_PATTERNS + ((r"^crf\.",) if crf else ()),
            module_lr_scales={"crf": self.args.crf_lr_scale} if crf else None,
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
        self.optimizer = optimizer_cls(self.build_optimizer_groups(opt_model), **optimizer_kwargs)
        return self.optimizer

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

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        """Upstream ``train``; ``resume_from_checkpoint=True`` picks the newest COMPLETE ``checkpoint-N``.

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
        # --- Weight averaging ---
        self._swa_checkpoints = None
        if self._ema_callback is not None:
            self._ema_callback.resume_from = os.fspath(resume_from_checkpoint) if resume_from_checkpoint else None
        with self.preemption.signal_handlers():  # --- Preemption --- (restored even if training raises)
            output = super().train(
                resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
            )
        self.preempted = self.preemption.stopped_by  # --- Preemption ---
        if self.preempted is None:  # --- Preemption --- (a stopped run is not averaged)
            self._finish_weight_averaging()
        return output

    # ---- Adversarial -----------------------------------------------------------------------------------------------

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Upstream's training step, with ``--adversarial fgm|pgd|awp|freelb`` adding the adversarial passes.

        With adversarial training the gradient is the sum of the clean and the adversarial gradients (each loss
        normalised like the clean one, so accumulation stays exact), and the returned loss, hence the logged
        ``loss``, is the CLEAN loss. ``loss_clean`` and ``loss_adv`` are logged as well (``loss_adv`` averaged over
        the attacked micro-batches; FreeLB's is the mean of its K passes); ``adv_skipped`` counts the micro-batches
        whose attack was skipped because the clean gradient was 0, inf or NaN (fp16 overflow). Every backward but
        the step's last runs under ``no_sync``: one all-reduce per optimizer step, as in plain training. With
        ``neftune_noise_alpha`` the passes of a micro-batch share one NEFTune noise draw
        (:class:`~nlp_tricks.neftune.NEFTuneNoise`). Optimizer steps before ``adv_start_step`` are plain, counted as
        ``adv_plain_steps``.
        """
        if self.args.adversarial == "none":
            return super().training_step(model, inputs, num_items_in_batch)
        if self.state.global_step < self.args.adv_start_step:
            # Plain until adv_start_step; the count of such optimizer steps so far (each micro-batch sets the same).
            self.trick_state["adv_plain_steps"] = self.state.global_step + 1
            return super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError("adversarial training is not supported with DeepSpeed (its engine owns the backward)")
        if self.args.adversarial == "awp" and self.accelerator.distributed_type == DistributedType.FSDP:
            raise ValueError(
                "adversarial='awp' is not supported with FSDP: it takes per-tensor norms of weights FSDP shards"
            )

        cp_context, inputs = _upstream.prepare_context_parallel_inputs(self, model, inputs)
        with cp_context():
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            inputs = _upstream.prepare_inputs(self, inputs)
            # As upstream: divide by the accumulation steps only if the loss was not normalised by the item count.
            scaled_for_ga = _upstream.loss_is_scaled_for_ga(self, num_items_in_batch)

            def loss_fn() -> torch.Tensor:
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                if self.args.n_gpu > 1:
                    loss = loss.mean()
                if not scaled_for_ga:
                    loss = loss / _upstream.accumulation_steps(self)
                return loss

            no_sync = (
                functools.partial(self.accelerator.no_sync, model=model) if self.accelerator.use_distributed else None
            )
            noise = self._attack_neftune(model)  # --- NEFTune with adversarial ---
            # --- Scheduled sampling --- the attack perturbs the clean pass's mixed input, not a new draw.
            adversary = self._get_adversary(model)
            # FreeLB's random start covers the positions the attention mask keeps.
            extra = {"attention_mask": inputs.get("attention_mask")} if isinstance(adversary, FreeLB) else {}
            with noise or contextlib.nullcontext(), self._shared_scheduled_sampling_draw():
                clean, adv = adversary.step(
                    noise.each_pass(loss_fn) if noise else loss_fn,
                    self.accelerator.backward,
                    no_sync=no_sync,
                    grad_scaler=self.accelerator.scaler,
                    **extra,
                )
            if (
                self.args.torch_empty_cache_steps is not None
                and self.state.global_step % self.args.torch_empty_cache_steps == 0
            ):
                clear_device_cache()

        # Each micro-batch's loss is its share of the step's loss; times the micro-batch count, the mean over the
        # step's micro-batches is the step's loss, comparable with the logged `loss`.
        share = _upstream.accumulation_steps(self)
        self.record_metric("loss_clean", clean * share)
        if adv is None:
            self.trick_state["adv_skipped"] = self.trick_state.get("adv_skipped", 0) + 1
        else:
            self.record_metric("loss_adv", adv * share)
        return clean

    def _attack_neftune(self, model: nn.Module) -> NEFTuneNoise | None:
        """NEFTune noise shared by the passes of one micro-batch (None without ``neftune_noise_alpha``); on the
        module upstream's hook would use."""
        if self._attack_neftune_alpha is None:
            return None
        embeddings = unwrap_peft_model(self.accelerator.unwrap_model(model)).get_input_embeddings()
        return NEFTuneNoise(embeddings, self._attack_neftune_alpha)

    def _get_adversary(self, model: nn.Module) -> FGM | PGD | AWP | FreeLB:
        """The attacker of the unwrapped model (built once; rebuilt if the model was replaced)."""
        unwrapped = self.accelerator.unwrap_model(model)
        if self._adversary is None or self._adversary.model is not unwrapped:
            if self.args.torch_compile or is_compiled_module(model):
                # torch.compile does not guard on module hooks: a graph compiled in this process without the
                # attack's embedding hook (an earlier run, even of another model of the same class) would be reused
                # and never call it. Compiled graphs are rebuilt on their next call.
                torch.compiler.reset()
            args = self.args
            if args.adversarial == "fgm":
                self._adversary = FGM(unwrapped, epsilon=args.adv_epsilon, norm=args.adv_norm, target=args.adv_target)
            elif args.adversarial == "awp":
                self._adversary = AWP(unwrapped, gamma=args.awp_gamma, target=args.awp_target)
            elif args.adversarial == "freelb":
                self._adversary = FreeLB(
                    unwrapped,
                    epsilon=args.adv_epsilon,
                    alpha=args.adv_alpha,
                    steps=args.adv_steps,
                    init_mag=args.adv_init_mag,
                    clean_pass=args.freelb_clean_pass,
                    target=args.adv_target,
                )
            else:
                self._adversary = PGD(
                    unwrapped,
                    epsilon=args.adv_epsilon,
                    alpha=args.adv_alpha,
                    steps=args.adv_steps,
                    norm=args.adv_norm,
                    target=args.adv_target,
                )
        return self._adversary

    # --- Weight averaging ---

    @property
    def required_checkpoint_files(self) -> tuple[str, ...]:
        """Files the tricks of this run need in a ``checkpoint-N`` folder to resume from it (their saved state)."""
        return (EMA_STATE_NAME,) if self._ema_callback is not None else ()

    @property
    def ema(self) -> EMA | None:
        """The :class:`~nlp_tricks.averaging.EMA` of the model (``--ema_decay``), built when training starts."""
        return None if self._ema_callback is None else self._ema_callback.ema

    @contextlib.contextmanager
    def _ema_weights_if_eval(self):
        """The EMA weights in the model for the block when ``--ema_eval`` (and an EMA exists), else nothing."""
        ema = self.ema if self.args.ema_eval else None
        if ema is None:
            yield
        else:
            with ema.swapped_in():
                yield

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval", **kwargs):
        """Upstream ``evaluate``; with ``--ema_eval`` on the EMA weights (the raw ones are restored bitwise after)."""
        with self._ema_weights_if_eval():
            return super().evaluate(
                eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs
            )

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test", **kwargs):
        """Upstream ``predict``; with ``--ema_eval`` on the EMA weights (the raw ones are restored bitwise after)."""
        with self._ema_weights_if_eval():
            return super().predict(
                test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs
            )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Upstream ``save_model``, plus the weight averages.

        - Into a ``checkpoint-N`` folder: the raw weights, and the EMA state as ``ema_state.safetensors`` (written
          before ``trainer_state.json``, so a complete checkpoint always holds it).
        - Anywhere else (the final model): with ``--ema_eval`` the EMA weights, after ``--swa_last_k`` the
          checkpoint average, each with an ``averaging.json`` beside it saying so.
        """
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if CHECKPOINT_RE.match(os.path.basename(os.path.normpath(output_dir))):
            super().save_model(output_dir, _internal_call)
            if self.ema is not None and self.args.should_save:
                self.ema.save(os.path.join(output_dir, EMA_STATE_NAME))
            return
        info = None
        if self._swa_checkpoints is not None:
            info = {"weights": "swa", "checkpoints": [os.path.basename(p) for p in self._swa_checkpoints]}
        elif self.args.ema_eval and self.ema is not None:
            ema = self.ema
            info = {"weights": "ema", "ema_decay": ema.decay, "ema_warmup": ema.warmup, "updates": ema.num_updates}
        with self._ema_weights_if_eval():  # (swa_last_k excludes ema_eval)
            super().save_model(output_dir, _internal_call)
        if self.args.should_save and os.path.isdir(output_dir):
            if info is not None:
                write_averaging_info(output_dir, info)
            elif os.path.isfile(os.path.join(output_dir, AVERAGING_INFO_NAME)):
                os.remove(os.path.join(output_dir, AVERAGING_INFO_NAME))  # left by an earlier run: no longer true

    def _finish_weight_averaging(self) -> None:
        """After training: ``--swa_last_k`` loads the checkpoint average; best-model loading also takes its EMA."""
        args = self.args
        if args.swa_last_k > 0:
            self.accelerator.wait_for_everyone()  # the main process may still be writing the last checkpoint
            paths = last_complete_checkpoints(args.output_dir, args.swa_last_k, max_step=self.state.global_step)
            if not paths:
                logger.warning(f"swa_last_k={args.swa_last_k}: no complete checkpoint in {args.output_dir}; skipped")
                return
            if len(paths) < args.swa_last_k:
                logger.warning(
                    f"swa_last_k={args.swa_last_k} but only {len(paths)} complete checkpoints exist; averaging those"
                )
            average_into(self.model, paths)
            self._swa_checkpoints = paths
            logger.info(f"swa_last_k: the model now holds the average of {', '.join(paths)}")
        elif self.ema is not None and args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            # The best checkpoint's raw weights are loaded upstream; its EMA goes with them.
            self.ema.load(os.path.join(self.state.best_model_checkpoint, EMA_STATE_NAME))

    # ---- Scheduled sampling ----------------------------------------------------------------------------------------

    def _check_scheduled_sampling_model(self, model: nn.Module) -> None:
        """Raise if ``model`` is not one :meth:`scheduled_sampling_passes` can run (here: a causal LM, i.e. a model
        whose loss shifts labels, as :attr:`loss_shifts_labels` decides it)."""
        if not self.loss_shifts_labels:
            seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
            hint = " (for encoder-decoder models use Seq2SeqTricksTrainer)" if seq2seq else ""
            raise ValueError(
                f"scheduled_sampling={self.args.scheduled_sampling!r} needs a decoder-only causal LM with "
                f"TricksTrainer{hint}, got {type(model).__name__}"
            )

    def scheduled_sampling_passes(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        labels: torch.Tensor,
        ratio: float,
        forward: nn.Module,
        draw: ScheduledSamplingDraw | None,
    ):
        """Scheduled sampling's passes at teacher-forcing ``ratio``: ``(pass-2 outputs, the draw used)``.

        ``model`` is the unwrapped model (pass 1 runs on it, under ``no_grad``), ``forward`` the wrapped one (pass 2).
        A ``draw`` given is reused instead of running pass 1. Here: a causal LM
        (:func:`~nlp_tricks.scheduled_sampling.causal_scheduled_sampling_forward`); Seq2SeqTricksTrainer overrides it
        with the encoder-decoder passes.
        """
        return causal_scheduled_sampling_forward(
            model,
            inputs,
            labels,
            ratio,
            mode=self.args.ss_mode,
            temperature=self.args.ss_temperature,
            forward=forward,
            draw=draw,
            return_draw=True,
        )

    def _scheduled_sampling_forward(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor):
        """The pass-2 outputs at the ratio of ``state.global_step`` (logged), or None at ratio 1 (plain forward)."""
        ratio = self.scheduled_sampler.ratio(self.state.global_step)
        self.record_metric("teacher_forcing_ratio", ratio)
        if ratio >= 1.0:
            return None
        shared = self._ss_shared
        draw = shared.get("draw") if shared is not None else None
        # Pass 1 (and the encoder of an encoder-decoder) run on the unwrapped model (no DDP forward without a
        # backward), under the autocast accelerate otherwise applies in the wrapped forward; pass 2 goes through
        # the wrapper.
        with self.accelerator.autocast():
            outputs, draw = self.scheduled_sampling_passes(
                self.accelerator.unwrap_model(model), inputs, labels, ratio, forward=model, draw=draw
            )
        if shared is not None:
            shared["draw"] = draw
        return outputs

    @contextlib.contextmanager
    def _shared_scheduled_sampling_draw(self):
        """Within: the forwards (all on one micro-batch) reuse the first one's draw: mask and pass-1 predictions."""
        self._ss_shared = {}
        try:
            yield
        finally:
            self._ss_shared = None

    # ---- R-Drop ----------------------------------------------------------------------------------------------------

    def compute_rdrop_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """R-Drop's consistency term on the doubled batch's logits and labels (the same ones the loss was taken on,
        shifted for a causal LM): ``rdrop_alpha / 2 * (KL(p_a || p_b) + KL(p_b || p_a))`` per counted item, ``a`` and
        ``b`` the two halves, on ``logits / temperature``, in float32 (:func:`~nlp_tricks.losses.rdrop_kl`). Logs
        ``loss_kl`` (the term without ``rdrop_alpha``, per item, comparable with ``loss``).

        Extension point, called by :meth:`compute_loss` beside :meth:`compute_tricks_loss` with the same arguments.
        """
        if self.args.temperature != 1.0:
            logits = logits / self.args.temperature
        logits_a, logits_b = logits.chunk(2)
        if not self._rdrop_checked:
            if torch.equal(logits_a, logits_b):
                raise ValueError(
                    f"rdrop_alpha={self.args.rdrop_alpha} needs dropout, but the two passes over the batch gave "
                    f"identical logits: {type(self.accelerator.unwrap_model(self.model)).__name__} has no active "
                    "dropout (e.g. hidden_dropout_prob=0 in its config); give it a dropout probability > 0 or set "
                    "rdrop_alpha=0"
                )
            self._rdrop_checked = True
        kl = rdrop_kl(logits_a, logits_b, labels.chunk(2)[0], num_items_in_batch=num_items_in_batch)
        if num_items_in_batch is not None:
            # A share of the step's per-item mean: x micro-batches (and processes) makes it comparable with `loss`.
            try:
                micro_batches = _upstream.accumulation_steps(self)
            except AttributeError:  # called outside the training loop
                micro_batches = 1
            self.record_metric("loss_kl", kl * micro_batches * self._loss_scale_for_devices())
        else:
            self.record_metric("loss_kl", kl)
        return self.args.rdrop_alpha * kl

    def _rdrop_double(self, inputs: dict, *per_example: torch.Tensor | None):
        """The batch concatenated with itself along the batch dimension (one forward gives both dropout passes),
        and each of ``per_example`` (labels, teacher logits; None stays None) likewise."""
        batch = per_example[0].shape[0]
        doubled = {}
        for key, value in inputs.items():
            if torch.is_tensor(value) and value.dim() > 0:
                if value.shape[0] != batch:
                    raise ValueError(
                        f"rdrop_alpha > 0 runs the two passes as one doubled batch, but input {key!r} of shape "
                        f"{tuple(value.shape)} has no batch dimension of size {batch}"
                    )
                value = torch.cat([value, value])
            doubled[key] = value
        return doubled, *(None if t is None else torch.cat([t, t]) for t in per_example)


def _dataset_labels(dataset):
    """The ``labels`` of every item of a map-style dataset (a ``datasets.Dataset`` column at once), or ``None``."""
    if dataset is None:
        return None
    if "labels" in (getattr(dataset, "column_names", None) or ()):
        return dataset["labels"]
    try:
        return [dataset[i]["labels"] for i in range(len(dataset))]
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None


class _CRFLossHook:
    """A forward hook on the model that fills ``outputs.loss`` with the CRF loss while :meth:`computing` is open.

    It holds the trainer weakly: ``copy.deepcopy(model)`` copies the hook, not the trainer.
    """

    def __init__(self, trainer: TricksTrainer, model: nn.Module):
        self._trainer = weakref.ref(trainer)
        self._pending = None
        self._handle = model.register_forward_hook(self)

    @contextlib.contextmanager
    def computing(self, labels: torch.Tensor, num_items_in_batch):
        self._pending = (labels, num_items_in_batch)
        try:
            yield
        finally:
            self._pending = None

    def __call__(self, module: nn.Module, args: tuple, outputs):
        trainer = self._trainer()
        if self._pending is None or trainer is None:
            return None
        labels, num_items = self._pending
        self._pending = None  # one forward per request (a nested call of the same model stays plain)
        samples = trainer._head_samples(output_logits(outputs))
        losses = [trainer.crf_loss(logits, labels, num_items_in_batch=num_items) for logits in samples]
        return trainer._outputs_with_loss(outputs, losses[0] if len(losses) == 1 else torch.stack(losses).mean())

    def remove(self) -> None:
        self._handle.remove()
