"""TricksTrainer: a ``transformers.Trainer`` that runs the tricks of nlp_tricks, built from TricksArguments.

The protocol it runs (hooks, their combination rules, the loop) is declared once in :mod:`nlp_tricks.trick`; the
dispatch here reads :data:`~nlp_tricks.trick.HOOK_RULES` rather than writing a loop per hook.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from transformers import Trainer
from transformers.utils import ModelOutput

from .config import TricksArguments
from .functional.adversarial import resolve_embedding_module
from .functional.chunked_loss import HeadInputCapture
from .functional.models import unwrap_model
from .functional.multi_sample_dropout import find_classifier
from .functional.outputs import output_logits, output_loss, outputs_with_loss
from .runtime import upstream as _upstream
from .runtime.divergence import install_divergence_guard
from .runtime.drop_in import DropInLosses
from .runtime.integrity import checkpoint_written
from .runtime.lm_loss import CausalLMLossPath
from .runtime.lock import holds_output_dir
from .runtime.optimizer import OptimizerGroups
from .runtime.passes import MultiPassStep
from .runtime.preemption import PreemptionCallback, install_preemption
from .runtime.saved_weights import ChosenWeights
from .runtime.state import TRAINER_ENTRY
from .runtime.state_store import TrickStateStore
from .runtime.step_log import StepLogging
from .runtime.streams import TrickDataStream
from .trick import (
    HOOK_RULES,
    OUTPUT_REQUESTS,
    REMOVED_HOOKS,
    LossBatch,
    LossContext,
    Trick,
    capability_problem,
    merge_options,
    nested,
)
from .tricks import BuiltInTrick, built_in_tricks

__all__ = ["TricksTrainer"]

logger = logging.getLogger(__name__)

# What an `exclusive` hook does, for the refusal of two tricks implementing it.
_EXCLUSIVE_WHAT = {"training_step": "each run the whole training step", "forward": "each replace the forward pass"}


class TricksTrainer(
    DropInLosses, CausalLMLossPath, OptimizerGroups, TrickStateStore, StepLogging, ChosenWeights, Trainer
):
    """A drop-in ``transformers.Trainer`` that runs tricks: the built-in ones :class:`TricksArguments` switches on,
    and any :class:`~nlp_tricks.Trick` passed as ``tricks=[...]``, sorted by their ``order``.

    What it changes, and nothing else (training loop, mixed precision, DDP / FSDP / DeepSpeed, clipping, schedulers,
    logging and checkpoints stay upstream's):

    - :meth:`compute_loss` pops the labels, runs the model without its own loss and takes the configured loss on its
      logits in one written pipeline (:meth:`_compute_labelled_loss`, the loop in :mod:`nlp_tricks.trick`). The loss
      is a sum divided by ``num_items_in_batch`` (each trick counting its own items), so gradient accumulation is
      exact for every loss. Float labels and regression heads keep the model's own loss (a one-time warning names the
      loss tricks it skips); question answering takes the loss over start and end positions; ``compute_loss_func=``
      works as on plain Trainer (refusing the loss tricks it would replace); causal LMs score the logits at t against
      the label at t + 1.
    - :meth:`training_step` is upstream's, unless a trick takes the step (an attack's or SAM's extra passes, built on
      :meth:`multi_pass`).
    - :meth:`create_optimizer` builds :meth:`build_optimizer_groups` (no decay on biases and norms, ``head_lr_scale``,
      ``layer_decay``, the tricks' own rules) for the optimizer ``--optim`` names; with no group rule on, the groups
      are upstream's own. The logged ``learning_rate`` is the body's on every model, ``lr/<group>`` each group's.
    - :meth:`evaluate`, :meth:`predict` and the final :meth:`save_model` run with the weights the tricks choose (the
      EMA's); predictions pass through the tricks (a CRF's Viterbi paths); every ``checkpoint-N`` holds the tricks'
      states (one file), and :meth:`train` restores them on resume, once every trick's ``on_train_begin`` has
      built what holds them.
    - Run safety (docs/checkpoints.md): :meth:`train` locks ``output_dir`` for itself (one run per folder), stops at a
      non-finite loss, gradient norm or weight (``stop_on_nonfinite``: ``TrainingDivergedError``, nothing of that step
      saved), and each ``checkpoint-N`` ends with a checksum manifest that resume verifies.

    Extension points: :meth:`compute_tricks_loss`, :meth:`forward_for_loss`, :meth:`build_optimizer_groups`,
    :meth:`record_metric`, :attr:`trick_state`, :meth:`multi_pass`, :meth:`data_stream`, :attr:`loss_context`;
    upstream's signatures are kept for the methods it overrides. A trick of your own needs no subclass: see
    :class:`~nlp_tricks.Trick` and docs/tricks.md.
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
        self._take_tricks(args, tricks)
        if model is not None:
            self.call_tricks("prepare_model", model)
        super().__init__(model, args, *positional, **kwargs)
        self._check_compute_loss_func()
        self._forward_accepts_loss_kwargs = self.model_accepts_loss_kwargs  # upstream's answer, for compute_loss_func
        # compute_loss normalises by `num_items_in_batch` for every model.
        _upstream.count_items_for_every_model(self)
        # Whether the loss scores the logits at position t against the label at t + 1. Upstream's Trainer decides it
        # twice: from the model's `loss_type` (which also sets its item count over `labels[..., 1:]`) and, in its
        # label-smoothing path, from the class name among the causal LMs. The first misses causal LMs whose class name
        # names no loss type (GPT2LMHeadModel: `loss_type` None), whose count would then include position 0; both
        # rules are taken here, and the result handed back so that upstream counts the items this loss divides by.
        self.loss_shifts_labels = self._decide_loss_shifts_labels(_upstream.loss_shifts_labels(self))
        _upstream.set_loss_shifts_labels(self, self.loss_shifts_labels)
        self._start_tricks()

    def _take_tricks(self, config, tricks) -> None:
        """Take the built-in tricks ``config`` (the trick fields) switches on and the user's ``tricks``."""
        for trick in tricks:
            if not isinstance(trick, Trick):
                raise TypeError(f"tricks=[...] takes nlp_tricks.Trick objects, got {type(trick).__name__}")
        #: The trick fields of this run (``args`` itself for TricksTrainer; a host trainer's ``tricks_config``).
        self.tricks_config = config
        # Copies taken before any use: each hyperparameter-search trial starts from them (fresh state).
        self._trick_templates = [_fresh_copy(trick) for trick in tricks]
        self._streams: dict[str, TrickDataStream] = {}
        self._use_tricks(built_in_tricks(config, user_tricks=tricks))

    def _start_tricks(self) -> None:
        """Once upstream's ``__init__`` has run: the trainer's own bookkeeping, the checks at build, the tricks'
        ``setup`` and callbacks, preemption and the divergence guard."""
        self._warned = getattr(self, "_warned", set())
        # Per-step numbers of the tricks (e.g. the adversarial loss), averaged into each training log.
        self._step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        # The trainer's own cumulative numbers (a subclass's counters): logged as they are, saved in the state store.
        self._own_state: dict[str, float] = {}
        self._optimizer_groups: dict | None = None  # the group signature, saved with each checkpoint
        self._legacy_groups = False  # resuming an earlier TricksTrainer's optimizer state in its own group layout
        self._tricks_step: dict = {"batches": [], "num_items": None, "next": 0}  # the optimizer step's micro-batches
        self._resume_states_from: str | None = None  # the checkpoint whose states train() restores
        self._context: LossContext | None = None  # the loss context of the micro-batch being trained
        self._lm_loss_path: str | None = None  # decided on first use (lm_loss_path)
        self._loss_only = False  # inside a prediction step whose logits are not returned
        self._check_capabilities()
        # NEFTune: upstream's hook draws fresh noise at every forward, so a multi-pass step's passes would see other
        # noise than the clean pass they perturb; with such a trick the passes share one draw (runtime/passes.py).
        self.shared_neftune_alpha: float | None = None
        if self.neftune_noise_alpha is not None and any(t.extra_backwards for t in self.tricks):
            self.shared_neftune_alpha, self.neftune_noise_alpha = self.neftune_noise_alpha, None
        self._setup_tricks()
        # SIGTERM / SIGUSR1 / --max_time: a checkpoint at a step boundary, then stop (docs/checkpoints.md).
        self.preemption: PreemptionCallback = install_preemption(self)
        self.preempted: str | None = None  # after train(): None, or what stopped it early ("SIGTERM", "max_time")
        # Run safety: a non-finite loss, gradient norm or weight stops training (or is skipped); added last, so it
        # can overrule the saves the callbacks above decide on (runtime/divergence.py, docs/checkpoints.md).
        self.divergence = install_divergence_guard(self)

    # ---- The tricks: building and dispatch -----------------------------------------------------------------------

    def _use_tricks(self, tricks: list[Trick]) -> None:
        """Take ``tricks`` (in their order) as this run's, refusing what cannot be built: a removed hook, two
        implementations of an exclusive hook, two tricks with state under one name."""
        for trick in tricks:
            removed = [hook for hook in REMOVED_HOOKS if callable(getattr(type(trick), hook, None))]
            if removed:
                hook = removed[0]
                raise TypeError(
                    f"{trick!r} implements {hook}, which tricks no longer have; use {REMOVED_HOOKS[hook]} "
                    "(docs/tricks.md)"
                )
        for hook, rule in HOOK_RULES.items():
            if rule == "exclusive":
                owners = [trick for trick in tricks if trick.overrides(hook)]
                if len(owners) > 1:
                    what = _EXCLUSIVE_WHAT.get(hook, f"each implement {hook}")
                    raise ValueError(f"{' and '.join(map(repr, owners))} {what}; only one trick of a run may")
        names = [trick.state_name for trick in tricks if trick.has_state()]
        for name in sorted({n for n in names if names.count(n) > 1 or n == TRAINER_ENTRY}):
            holders = [repr(t) for t in tricks if t.has_state() and t.state_name == name]
            raise ValueError(
                f"{' and '.join(holders)} keep state under one name, {name!r}; give each its own (set `name` on the "
                "trick: MyTrick().name = 'a')"
                if name != TRAINER_ENTRY
                else f"{holders[0]} keeps state under {name!r}, the trainer's own entry; set another `name`"
            )
        #: The tricks of this run, in the order their hooks run.
        self.tricks: list[Trick] = tricks
        self._implementers = {hook: [t for t in tricks if t.overrides(hook)] for hook in HOOK_RULES}
        self._requests = {request for t in tricks for request in t.outputs_needed}
        unknown = self._requests - set(OUTPUT_REQUESTS)
        if unknown:
            raise ValueError(
                f"outputs_needed asks for {sorted(unknown)}; a trick may ask for {', '.join(sorted(OUTPUT_REQUESTS))}"
            )

    def _setup_tricks(self) -> None:
        for trick in self.tricks:
            self.add_callback(trick)
        self._add_state_restorer()  # after the tricks: their on_train_begin builds what it restores into
        self.call_tricks("setup")

    def _check_capabilities(self) -> None:
        """Refuse, naming the settings, the tricks whose capability flags exclude this run's optimizer (one that
        updates the weights inside backward cannot take several backwards per step), DeepSpeed (ZeRO-3) or FSDP."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None) if self.is_deepspeed_enabled else None
        engine = {
            "optim": getattr(self.args.optim, "value", self.args.optim),
            "deepspeed": self.is_deepspeed_enabled,
            "zero_stage": getattr(plugin, "zero_stage", None),
            "fsdp": self.is_fsdp_enabled,
        }
        for trick in self.tricks:
            problem = capability_problem(trick, **engine)
            if problem is not None:
                raise ValueError(problem)

    def _legacy_holders(self) -> dict[str, BuiltInTrick]:
        """The state holders a checkpoint written before the state store can restore: the built-in tricks (no other
        holder existed then), each declaring its ``legacy_state`` and ``legacy_files``."""
        return {name: h for name, h in self._state_holders().items() if isinstance(h, BuiltInTrick)}

    def get_trick(self, kind: type[Trick]) -> Trick | None:
        """The run's trick of class ``kind`` (the first one), or ``None``."""
        return next((trick for trick in self.tricks if isinstance(trick, kind)), None)

    def call_tricks(self, hook: str, *args, value=None, training: bool = True):
        """Run ``hook`` of the tricks that implement it, combined by its rule in :data:`~nlp_tricks.HOOK_RULES`.

        ``chain`` hooks get ``value`` as their last argument and return the next; in evaluation
        (``training=False``) the tricks with ``in_evaluation = False`` are skipped. An error inside a trick's hook
        carries a note naming the trick and the hook.
        """
        rule = HOOK_RULES[hook]
        tricks = self._implementers[hook]
        if not training:
            tricks = [trick for trick in tricks if trick.in_evaluation]
        if rule == "nested":
            return nested(self._call(trick, hook, args) for trick in tricks)
        if rule == "merge":
            return merge_options([(trick, self._call(trick, hook, args)) for trick in tricks])
        for trick in tricks:
            if rule == "chain":
                value = self._call(trick, hook, (*args, value))
            else:
                answer = self._call(trick, hook, args)
                if rule in ("first", "exclusive") and answer is not None:
                    return answer
        return value if rule == "chain" else None

    def _call(self, trick: Trick, hook: str, args: tuple):
        try:
            return getattr(trick, hook)(self, *args)
        except Exception as error:
            error.add_note(f"(in {trick!r}.{hook})")
            raise

    # ---- Loss ------------------------------------------------------------------------------------------------------

    @property
    def loss_context(self) -> LossContext | None:
        """Where the forward pass being computed stands (which pass, which micro-batch, the step's item count, this
        micro-batch's share, the aligned batch and logits, the captured outputs): see
        :class:`~nlp_tricks.trick.LossContext`. Set while :meth:`compute_loss` runs."""
        return self._context

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
        training = model.training and torch.is_grad_enabled()
        outer = self._context
        if outer is None or not model.training:  # a call outside a training step (evaluation, a user's own call)
            self._context = LossContext(phase="train" if model.training else "eval")
        self._context.forget_pass()
        try:
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
            if training:
                adjusted = self.adjust_loss(inputs, outputs, loss, num_items_in_batch)
                if adjusted is not loss and return_outputs:
                    outputs = self.outputs_with_loss(outputs, adjusted)
                loss = adjusted
        finally:
            if outer is None or not model.training:
                self._context = outer
        return (loss, outputs) if return_outputs else loss

    def _compute_labelled_loss(
        self, model: nn.Module, inputs: dict, label_key: str, num_items_in_batch, return_outputs
    ):
        """The loss pipeline of a batch with one label column (the loop in :mod:`nlp_tricks.trick`)."""
        lean = self.lm_loss_path if label_key == "labels" and "teacher_logits" not in inputs else None
        if lean == "model":  # the causal LM's own loss, as under plain Trainer (scaled for the devices there)
            return super().compute_loss(model, inputs, True, num_items_in_batch)
        original = inputs
        inputs = dict(inputs)
        labels = inputs.pop(label_key)
        loss_labels = self.labels_for_logits(labels, inputs.pop("shift_labels", None))
        teacher_logits = inputs.pop("teacher_logits", None)
        num_items = self._normalizer(num_items_in_batch)
        own_loss_reason = self._model_loss_reason(model, labels)
        if own_loss_reason is not None:
            distilling = teacher_logits is not None
            loss, outputs = self._model_own_loss(
                model, inputs, label_key, labels, num_items, own_loss_reason, distilling
            )
        else:
            training = model.training
            self._add_decoder_input_ids(model, inputs, labels)
            batch = LossBatch(inputs, labels, loss_labels, teacher_logits, num_items)
            batch = self.call_tricks("prepare_loss_batch", value=batch, training=training)
            self._context.batch = batch
            # A causal LM with a loss trick on: the loss in chunks from the last hidden state, in training forwards
            # and in evaluation forwards whose logits nobody reads.
            chunk = lean == "chunked" and (training or self._loss_only)
            head = self._lm_head(model) if chunk else None
            capture = HeadInputCapture(head) if head is not None else contextlib.nullcontext()
            with (
                self.call_tricks("forward_context", batch, training=training),
                self._capturing(model, batch),
                capture,
            ):
                outputs = self.forward_for_loss(model, batch.inputs, batch.labels)
            logits = None if batch.loss_in_outputs else output_logits(outputs)
            if head is not None and logits is not None:
                logits = capture.logits(logits, batch.loss_labels.shape)
                if logits is None:
                    return self._full_logits_after_all(model, original, label_key, num_items_in_batch, capture)
                if isinstance(outputs, ModelOutput):
                    outputs["logits"] = None  # the model computed the last position's only
            loss, outputs = self._loss_of_forward(outputs, logits, batch, training, return_outputs)
        # DDP averages gradients over processes: a loss normalised by the all-process count is scaled back up.
        if num_items is not None:
            loss = loss * self.loss_scale_for_devices()
        return loss, outputs

    def _loss_of_forward(self, outputs, logits, batch: LossBatch, training: bool, return_outputs: bool):
        """The loss of one forward: the one a forward context computed inside it (``batch.loss_in_outputs``), else
        each head's configured loss on ``logits`` with the tricks' terms, averaged over the heads."""
        context = self._context
        if batch.loss_in_outputs:
            context.logits = output_logits(outputs)
            return output_loss(outputs), outputs
        context.logits = logits if torch.is_tensor(logits) else None
        losses = []
        for sample in self.head_samples(logits):
            loss = self.compute_tricks_loss(sample, batch.loss_labels, num_items_in_batch=batch.num_items)
            losses.append(self.call_tricks("adjust_logits_loss", sample, batch, value=loss, training=training))
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if return_outputs:  # as a model given labels returns them
            outputs = self.outputs_with_loss(outputs, loss)
        return loss, outputs

    @contextlib.contextmanager
    def _capturing(self, model: nn.Module, batch: LossBatch) -> Iterator[None]:
        """Capture what the tricks' ``outputs_needed`` ask for, in training forwards only, into the loss context."""
        if not self._requests or not model.training:
            yield
            return
        context, handles = self._context, []
        unwrapped = unwrap_model(model, peft=True)
        if "hidden_states" in self._requests:
            batch.inputs = {**batch.inputs, "output_hidden_states": True}
        if "embedding_output" in self._requests:
            # Registered now, so it runs after every other hook of the module (NEFTune, an attack's perturbation).
            module = resolve_embedding_module(unwrapped)
            handles.append(module.register_forward_hook(lambda m, a, out: setattr(context, "embedding_output", out)))
        if "pooled" in self._requests:
            # First among the head's pre-hooks: the features before multi-sample dropout's masks.
            head = find_classifier(unwrapped)[1]
            handles.append(head.register_forward_pre_hook(lambda m, a: setattr(context, "pooled", a[0]), prepend=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def adjust_loss(self, inputs: dict, outputs, loss: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The training loss with every trick's ``adjust_loss`` term.

        The tricks see the micro-batch's mean loss per item; what they add is weighed by the micro-batch's share of
        the step's items (``local items / num_items_in_batch``, times the device scaling: ``loss_context.share``), as
        the loss itself is, so their terms stay exact under gradient accumulation and DDP. ``inputs`` and ``outputs``
        have the same rows (under R-Drop: the doubled batch, labels included). A trick that returns the loss
        unchanged leaves it bitwise unchanged.
        """
        if not self._implementers["adjust_loss"]:
            return loss
        context = self._context
        weight = self._micro_batch_weight(inputs, num_items_in_batch)
        context.share = weight
        if context.batch is not None:  # the rows the forward ran on (R-Drop: the doubled batch), labels included
            batch, label_key = context.batch, self._label_key(inputs)
            inputs = {k: v for k, v in batch.inputs.items() if k != "output_hidden_states" or k in inputs}
            inputs[label_key] = batch.labels
            if batch.teacher_logits is not None:
                inputs["teacher_logits"] = batch.teacher_logits
        if context.hidden_states is None and isinstance(outputs, Mapping):
            context.hidden_states = outputs.get("hidden_states")
        mean = loss if weight is None else loss / weight
        adjusted = self.call_tricks("adjust_loss", inputs, outputs, value=mean)
        self.record_raw_loss(loss, weight)  # `loss_raw` beside the logged `loss`
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
        count = self.call_tricks("count_items", labels)
        return labels.ne(-100).sum() if count is None else count

    def forward_for_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor):
        """The forward pass whose logits the loss is taken on; ``inputs`` no longer hold ``labels``.

        ``labels`` are the batch's, unshifted. Extension point; by default the trick's ``forward`` (scheduled
        sampling's two passes in training), else ``model(**inputs)``.
        """
        outputs = self.call_tricks("forward", model, inputs, labels, training=model.training)
        return model(**inputs) if outputs is None else outputs

    def head_samples(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """The logits of each head of the last forward the loss averages over (multi-sample dropout's K heads), or
        just ``[logits]``."""
        return self.call_tricks("head_samples", logits, training=self.model.training) or [logits]

    def compute_tricks_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The configured loss on ``logits`` (float32): a mean, or ``sum / num_items_in_batch``; the first trick's
        ``compute_loss`` (the CRF's, distillation's, a user trick's, else the ``loss_type`` one)."""
        return self.call_tricks("compute_loss", logits, labels, num_items_in_batch, training=self.model.training)

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

    def _set_signature_columns_if_needed(self):
        # Keep `teacher_logits` when the Trainer drops dataset columns the model's forward does not take.
        super()._set_signature_columns_if_needed()
        _upstream.keep_signature_column(self, "teacher_logits")

    def _add_decoder_input_ids(self, model: nn.Module, inputs: dict, labels: torch.Tensor) -> None:
        """Encoder-decoder models build decoder inputs from ``labels``; with labels popped we build them here.

        Only models that do so (those with ``prepare_decoder_input_ids_from_labels``, the generation heads): BART / T5
        sequence classification build theirs from ``input_ids`` with or without labels, so they are left to it.
        """
        unwrapped = unwrap_model(model)
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

    outputs_with_loss = staticmethod(outputs_with_loss)  # the outputs as a model given labels returns them

    # ---- Model, items, predictions ---------------------------------------------------------------------------------

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        self._lm_loss_path = None  # decided again for this model
        if trial is None or self.hp_search_backend is None:  # a trial's tricks are built by _hp_search_setup
            self.call_tricks("prepare_model", model)
        return model

    def _hp_search_setup(self, trial) -> None:
        """Upstream sets the trial's arguments on ``args``; the tricks are then checked and built again from them
        (every trick field applies in a trial, a bad value is refused naming the field), and each of your tricks
        starts the trial as a fresh copy of the one you passed (no state carried over from an earlier trial)."""
        super()._hp_search_setup(trial)
        if self.hp_search_backend is None or trial is None:
            return
        self.tricks_config.revalidate()
        for trick in self.tricks:
            self.remove_callback(trick)
        self._streams.clear()
        fresh = [_fresh_copy(t) for t in self._trick_templates]
        self._use_tricks(built_in_tricks(self.tricks_config, user_tricks=fresh))
        self._lm_loss_path = None
        self.call_tricks("prepare_model", self.model)
        self._check_capabilities()
        self._setup_tricks()

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Upstream's, keeping the optimizer step's micro-batches for the loss context (``step_batches``)."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._tricks_step = {"batches": batch_samples, "num_items": num_items_in_batch, "next": 0, "counts": {}}
        return batch_samples, num_items_in_batch

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
        """Upstream counts labelled positions; a trick may count other items (a CRF's sentences, class weights' weight
        sums), so each loss's divisor is its own item count over the whole accumulated, all-process batch."""
        labels = [batch.get("labels") for batch in batch_samples]
        if labels and all(torch.is_tensor(x) and not x.is_floating_point() for x in labels):
            if self.loss_shifts_labels:  # causal LMs: position t is scored against label t + 1
                labels = [x[..., 1:] for x in labels]
            counts = [self.call_tricks("count_items", x.to(device)) for x in labels]
            if all(count is not None for count in counts):
                return _upstream.reduce_item_count(self, sum(counts), device)
        return super()._get_num_items_in_batch(batch_samples, device)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Upstream's step, with the logits passed through the tricks (a CRF's Viterbi paths as one-hot scores)."""
        self._loss_only = prediction_loss_only  # the chunked loss needs no logits then
        try:
            loss, logits, labels = super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys
            )
        finally:
            self._loss_only = False
        if self._implementers["adjust_predictions"] and logits is not None:
            first = logits[0] if isinstance(logits, (tuple, list)) else logits
            first = self.call_tricks("adjust_predictions", inputs, value=first, training=False)
            logits = type(logits)([first, *logits[1:]]) if isinstance(logits, (tuple, list)) else first
        return loss, logits, labels

    def create_optimizer(self, model=None):
        """The optimizer ``--optim`` names, over :meth:`build_optimizer_groups`' groups (upstream's own optimizer
        when no group rule is on and the method is not overridden, so checkpoints move between ``Trainer`` and
        ``TricksTrainer`` both ways)."""
        opt_model = self.model if model is None else model
        if self.optimizer is not None:
            return self.optimizer
        if self._upstream_groups_do(opt_model):
            optimizer = super().create_optimizer(model)
            self._optimizer_groups = self._group_signature(optimizer.param_groups)
            return optimizer
        self.optimizer = self._grouped_optimizer(opt_model)
        return self.optimizer

    @holds_output_dir  # one run per output folder, locked for the whole call (runtime/lock.py)
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        """Upstream ``train``; ``resume_from_checkpoint=True`` picks the newest COMPLETE ``checkpoint-N``, and the
        tricks' state is restored from it.

        Upstream takes the highest-numbered folder, even one a crash left half-written; here newer incomplete
        folders are skipped with a warning naming them and what is wrong (see
        :func:`~nlp_tricks.resume.checkpoint_problem`), and a named checkpoint that is incomplete raises.
        """
        checkpoint = self._resume_checkpoint(resume_from_checkpoint)
        if checkpoint is not None and self.model is not None:
            self._check_optimizer_groups(checkpoint)
        self._resume_states_from = checkpoint  # restored after every trick's on_train_begin (runtime/state_store.py)
        resume = checkpoint if checkpoint is not None else resume_from_checkpoint  # True: the one chosen above
        with self.preemption.signal_handlers():  # restored even if training raises
            output = super().train(
                resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
            )
        self.divergence.raise_if_diverged()  # a diverged run returns nothing that looks finished
        self.preempted = self.preemption.stopped_by
        if self.preempted is None:  # a stopped run is not finished: no SWA average, no best EMA
            self.call_tricks("train_end")
        return output

    # ---- The training step ---------------------------------------------------------------------------------------

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Upstream's training step, unless a trick runs the step (``--adversarial``: the attack's passes added;
        the returned, logged loss is the clean one)."""
        step = self._tricks_step
        batches = step.get("batches") or []
        self._context = LossContext(
            phase="train",
            micro_batch=step.get("next", 0),
            num_micro_batches=max(len(batches), 1),
            num_items_in_batch=self._normalizer(num_items_in_batch),
            step_batches=batches,
            _reduce=self._sum_over_processes,
            _counts=step.setdefault("counts", {}),
        )
        step["next"] = step.get("next", 0) + 1
        try:
            loss = self.call_tricks("training_step", model, inputs, num_items_in_batch)
            if loss is None:
                loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._context = None
        self.divergence.record_loss(loss)  # the raw loss (upstream's logging_nan_inf_filter hides a NaN)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        """Upstream's gradient norm of the step, before its optimizer step; the divergence guard checks it."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.divergence.record_grad_norm(grad_norm)
        return grad_norm

    def _save_checkpoint(self, model, trial) -> None:
        """Upstream's checkpoint save, then its checksum manifest; a full disk is one line and leaves no torn
        ``checkpoint-N`` (runtime/integrity.py)."""
        with checkpoint_written(self, trial):
            super()._save_checkpoint(model, trial)

    def step_context(self) -> LossContext:
        """The loss context of the micro-batch being trained (for a trick's :meth:`multi_pass` passes)."""
        if self._context is None:
            raise RuntimeError("step_context() is only available inside training_step")
        return self._context

    @contextlib.contextmanager
    def using_step_context(self, context: LossContext) -> Iterator[None]:
        """Make ``context`` the current one (SAM replays a kept micro-batch at the end of the step)."""
        outer, self._context = self._context, context
        try:
            yield
        finally:
            self._context = outer

    def multi_pass(
        self, model: nn.Module, inputs: dict, num_items_in_batch=None, *, extra_pass: str = "extra", **options
    ) -> MultiPassStep:
        """A training step of several forward / backward passes over this micro-batch, with upstream's preamble,
        the micro-batch boundary and the passes' shared draws: see :class:`~nlp_tricks.runtime.passes.MultiPassStep`
        (``options``: ``share_dropout``)."""
        return MultiPassStep(self, model, inputs, num_items_in_batch, extra_pass=extra_pass, **options)

    def _sum_over_processes(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(self.args.device)
        if self.accelerator.num_processes > 1:
            value = self.accelerator.reduce(value, reduction="sum")
        return value


def _fresh_copy(trick: Trick) -> Trick:
    """A copy of ``trick`` with none of the state a run gives it (a trick that cannot be copied is reused)."""
    try:
        return copy.deepcopy(trick)
    except Exception:  # a trick holding something uncopyable (a model, an open file): its own responsibility
        return trick
