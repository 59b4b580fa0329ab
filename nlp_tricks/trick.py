"""The trick protocol: what a :class:`Trick` may do, when :class:`~nlp_tricks.TricksTrainer` calls it, and how the
answers of several tricks combine (:data:`HOOK_RULES`).

The training loop with every hook in its place (``order``: see :class:`Trick`; upstream's ``Trainer`` runs
everything not named here, unchanged)::

    TricksTrainer(model, args, tricks=[...])
        tricks = the built-ins args switch on + yours, sorted by `order`    (ties: built-ins first, then as given)
        refused here, naming the settings: two tricks with one state name, two tricks implementing an `exclusive`
            hook, a trick whose capability flags exclude DeepSpeed / ZeRO-3 / FSDP / this optimizer, a removed hook
        prepare_model(trainer, model)                      all      before the Trainer wraps the model
        setup(trainer)                                     all      the Trainer is built: check, build
    trainer.train(resume_from_checkpoint)
        on_train_begin(args, state, control, ...)          all      (every TrainerCallback event, in order) build
                                                                    what holds state, from the weights training
                                                                    starts from (a resumed run: the checkpoint's)
        load_state_dict(state)                             own      on resume, after every on_train_begin: each
                                                                    trick its entry of tricks_state.safetensors
        for each optimizer step:
            for each micro-batch:
                training_step(trainer, model, inputs, n)   exclusive   None: upstream's step; several passes:
                                                                       trainer.multi_pass(...) (runtime/passes.py)
                    compute_loss of each forward pass:
                        batch = prepare_loss_batch(trainer, batch)                 chain
                        with forward_context(trainer, batch):                      nested
                            outputs = forward(trainer, model, inputs, labels)      exclusive   None: model(**inputs)
                        if not batch.loss_in_outputs:            (a forward context may compute the loss, e.g. a CRF)
                            for logits in head_samples(trainer, logits) or [logits]:       first
                                loss_k = compute_loss(trainer, logits, labels, n)          first
                                loss_k = adjust_logits_loss(trainer, logits, batch, loss_k)  chain
                            loss = mean of loss_k
                        loss = adjust_loss(trainer, inputs, outputs, loss)   chain   training forwards only;
                                                                                     trainer.loss_context says which
                    backward                                         (inside no_sync unless the step's last)
            (Trainer) clip, optimizer.step, on_optimizer_step, scheduler, zero_grad, on_step_end, log, save:
                checkpoint-N/tricks_state.safetensors <- state_dict()             own
        train_end(trainer)                                 all      not when stopped early (SIGTERM, --max_time)
    the step's item count n (num_items_in_batch):  count_items(trainer, labels)                       first
    create_optimizer:  param_group_options(trainer, model)                                            merge
    evaluate / predict / save_model:
        with eval_weights(trainer):                        nested   (the EMA swapped in)
            prediction_step's logits = adjust_predictions(trainer, inputs, logits)                    chain
        saved_weights_info(trainer)                        first    (averaging.json beside the final model)

Loss hooks (``prepare_loss_batch`` to ``adjust_logits_loss``, and ``count_items``) run in evaluation forwards too,
unless the trick sets ``in_evaluation = False``; ``adjust_loss`` runs in training forwards only.

A causal LM whose run has no trick that ``needs_logits`` takes a lean path through this loop (decided once, as
``trainer.lm_loss_path``): with every loss trick off the model gets its labels and computes its own loss, as under
plain ``Trainer``; with a loss trick on, the training forwards' ``logits`` are an ``LMHeadLogits`` (the last hidden
state and the head's weight) and the configured loss is computed in chunks of tokens, never holding the full logits
(docs/decoder_only.md).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import TrainerCallback

if TYPE_CHECKING:
    from .trainer import TricksTrainer

__all__ = [
    "Trick",
    "HOOK_RULES",
    "RULES",
    "HOOKS",
    "REMOVED_HOOKS",
    "OUTPUT_REQUESTS",
    "LOGITS_HOOKS",
    "LossBatch",
    "LossContext",
    "DEFAULT_ORDER",
    "nested",
    "merge_options",
    "capability_problem",
    "STEPS_INSIDE_BACKWARD",
    "LossInForward",
]

#: How the answers of several tricks to one hook combine.
RULES = {
    "all": "every trick's hook runs, in order; what it returns is ignored",
    "chain": "each trick gets the previous trick's result as its last argument and returns the next",
    "first": "the first trick (in order) that returns something other than None decides; later ones are not asked",
    "exclusive": "at most one trick of a run implements it (two are refused when the trainer is built); its None "
    "means upstream's behaviour",
    "merge": "the returned dicts are combined: lists and tuples concatenated, mappings merged (a key set by two "
    "tricks is refused)",
    "nested": "each trick's context manager (None: none) is entered in order and exited in reverse",
    "own": "each trick answers for itself: its entry of the state store, under its state_name",
}

#: Hook name -> its combination rule (one of :data:`RULES`). The trainer's dispatch reads this table.
HOOK_RULES = {
    # Building.
    "prepare_model": "all",
    "setup": "all",
    # The loss of a forward pass.
    "prepare_loss_batch": "chain",
    "forward_context": "nested",
    "forward": "exclusive",
    "head_samples": "first",
    "compute_loss": "first",
    "adjust_logits_loss": "chain",
    "adjust_loss": "chain",
    "count_items": "first",
    # The training step.
    "training_step": "exclusive",
    # The optimizer.
    "param_group_options": "merge",
    # Evaluation, prediction, the final model.
    "adjust_predictions": "chain",
    "eval_weights": "nested",
    "saved_weights_info": "first",
    "train_end": "all",
    # State carried by checkpoints.
    "state_dict": "own",
    "load_state_dict": "own",
}

#: Hooks of earlier versions, and what took their place (a trick implementing one is refused, naming it).
REMOVED_HOOKS = {
    "loss_in_forward": "forward_context (set batch.loss_in_outputs when the forward computed the loss)",
    "micro_batch": "trainer.loss_context.shared (a dict shared by the passes of one micro-batch)",
    "prediction_step": "adjust_predictions(trainer, inputs, logits)",
    "save_checkpoint": "state_dict() (tensors included: saved in every checkpoint-N)",
    "checkpoint_files": "state_dict() (one file holds every trick's state)",
    "resume": "load_state_dict(state) (called on resume) and on_train_begin",
}

#: What a trick may ask the trainer to capture in training forwards (``Trick.outputs_needed``), read from
#: ``trainer.loss_context`` in the loss hooks.
OUTPUT_REQUESTS = {
    "hidden_states": "every layer's hidden states (the model runs with output_hidden_states=True)",
    "embedding_output": "the output of the input embedding module, as the layers get it (after NEFTune's noise or "
    "an attack's perturbation)",
    "pooled": "the features entering the classification head's last linear layer (the pooled vector of a sequence "
    "classifier), before multi-sample dropout",
}

#: The hooks that get the logits, the outputs or the batch around them: a trick implementing one keeps a causal LM's
#: full logits (:attr:`Trick.needs_logits`).
LOGITS_HOOKS = (
    "prepare_loss_batch",
    "forward_context",
    "forward",
    "head_samples",
    "compute_loss",
    "adjust_logits_loss",
    "adjust_loss",
    "count_items",
)

#: The ``order`` of a trick that sets none: after the model's shape and the loss-term tricks (pooling, re-init,
#: scheduled sampling, CRF, multi-sample dropout, R-Drop, SMART, distillation), before the configured loss, the
#: attacks, SAM, the weight averages and freezing.
DEFAULT_ORDER = 750


@dataclass
class LossBatch:
    """One batch on its way through :meth:`TricksTrainer.compute_loss`.

    Attributes:
        inputs: what the model's forward gets (labels removed).
        labels: the batch's labels as given (unshifted).
        loss_labels: the label each logit position is scored against (shifted for a causal LM).
        teacher_logits: a distillation batch's teacher scores, else ``None``.
        num_items: the loss's divisor: the item count of the whole accumulated, all-process batch (``None``: the
            loss is a mean over this batch).
        loss_in_outputs: set by a forward context that computed the loss inside the forward (``outputs.loss``).
    """

    inputs: dict[str, Any]
    labels: torch.Tensor
    loss_labels: torch.Tensor
    teacher_logits: torch.Tensor | None
    num_items: torch.Tensor | int | None
    loss_in_outputs: bool = False

    def replace(self, **changes) -> LossBatch:
        return replace(self, **changes)


@dataclass
class LossContext:
    """Where a forward pass stands, for the loss hooks: ``trainer.loss_context`` while :meth:`compute_loss` runs.

    Attributes:
        phase: ``"train"`` or ``"eval"``.
        pass_kind: ``"clean"`` (a plain step, or the first pass of a multi-pass step), else the extra pass's kind
            (``"adversarial"``, ``"sam"``, or the name a trick gave ``trainer.multi_pass``).
        pass_index: 0 for the clean pass, then 1, 2, ... within the micro-batch.
        micro_batch: this micro-batch's index in the optimizer step; ``num_micro_batches`` of them.
        num_items_in_batch: the step's item count (every micro-batch, every process), or ``None``.
        share: this micro-batch's share of the step's loss (its items / ``num_items_in_batch``, times the device
            scaling): what ``adjust_loss`` terms are weighed by; ``None`` where the loss is a per-batch mean.
        batch: the :class:`LossBatch` after ``prepare_loss_batch`` (R-Drop: the doubled batch), so that ``inputs``,
            ``labels`` and ``outputs`` have the same rows.
        logits: the logits the loss was taken on (after ``temperature``; multi-sample dropout: the first head's).
        hidden_states, embedding_output, pooled: what the tricks' ``outputs_needed`` asked for (training forwards).
        shared: a dict shared by every pass of this micro-batch (a trick keeps its random draws there so that an
            attack's passes perturb the clean pass's input, not a new draw).
        step_batches: the optimizer step's micro-batches as the data loader gave them (see :meth:`step_count`).
    """

    phase: str = "train"
    pass_kind: str = "clean"
    pass_index: int = 0
    micro_batch: int = 0
    num_micro_batches: int = 1
    num_items_in_batch: torch.Tensor | int | None = None
    share: torch.Tensor | None = None
    batch: LossBatch | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    embedding_output: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    shared: dict = field(default_factory=dict)
    step_batches: list[dict] = field(default_factory=list)
    _reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    _counts: dict = field(default_factory=dict, repr=False)

    def forget_pass(self) -> None:
        """Clear what the previous forward pass left (a new pass of the same micro-batch begins)."""
        self.batch = self.logits = self.hidden_states = self.embedding_output = self.pooled = self.share = None

    @property
    def inputs(self) -> dict | None:
        return None if self.batch is None else self.batch.inputs

    @property
    def labels(self) -> torch.Tensor | None:
        """The labels each logit position is scored against (shifted for a causal LM), aligned with ``logits``."""
        return None if self.batch is None else self.batch.loss_labels

    def step_count(self, count: Callable[[dict], torch.Tensor | int], key: str | None = None) -> torch.Tensor:
        """``count(batch)`` summed over this optimizer step's micro-batches and every process: the denominator of a
        term with items of its own (sentences where the loss counts tokens), so that ``sum / step_count`` is exact
        under gradient accumulation and DDP. Computed once per step and ``key`` (default: the function)."""
        key = count if key is None else key
        if key not in self._counts:
            total = sum(torch.as_tensor(count(b)).float().sum() for b in self.step_batches) if self.step_batches else 0
            total = torch.as_tensor(total, dtype=torch.float32)
            self._counts[key] = self._reduce(total) if self._reduce is not None else total
        return self._counts[key]


class Trick(TrainerCallback):
    """One trick, wired into :class:`~nlp_tricks.TricksTrainer`: pass it as ``TricksTrainer(..., tricks=[...])``.

    A trick is a :class:`~transformers.TrainerCallback` (the trainer adds it as one, so every callback event such as
    ``on_optimizer_step`` is there) with hooks callbacks cannot have: change the loss, run the training step's
    passes, add optimizer-group rules, change predictions, swap the weights used for evaluation and saving, keep state
    that checkpoints carry. Every hook is optional (the default leaves things as they are); how the hooks of several
    tricks combine is :data:`HOOK_RULES`, and the loop they run in is this module's docstring.

    The hook most tricks need::

        class LogitPenalty(Trick):
            def adjust_loss(self, trainer, inputs, outputs, loss):
                return loss + 0.1 * outputs.logits.pow(2).mean()

    Class attributes (an instance or a property may set them too):
        order: where the trick runs among the others (built-ins are spaced 100 apart: see docs/tricks.md; default
            :data:`DEFAULT_ORDER`).
        name: the name its state is saved under (default: the class name); two tricks with state and one name are
            refused.
        changes_loss: whether it changes the training loss (a ``compute_loss_func`` or a model's own loss would
            silently skip it, so those are refused / warned about).
        in_evaluation: whether its loss hooks run in evaluation forwards too.
        extra_backwards: whether it runs more than one backward per optimizer step (refused with optimizers that
            update the weights inside backward: ``lomo``, ``adalomo``).
        deepspeed, zero3, fsdp: whether it works under DeepSpeed, under DeepSpeed ZeRO stage 3 (whose sharded
            parameters no process holds whole) and under FSDP: refused when the trainer is built otherwise, with
            ``unsupported_reason`` in the message (:func:`capability_problem`, the one place such refusals are made).
        outputs_needed: what to capture in training forwards for the loss hooks (keys of :data:`OUTPUT_REQUESTS`).
        logged_state: keys of :meth:`state_dict` logged as they are in every training log (counters).
        needs_logits: whether it reads a causal LM's full logits (``outputs.logits``, ``loss_context.logits``, the
            ``logits`` its hooks get). While no trick of a run does, a causal LM computes its own loss (every loss
            trick off) or the configured loss is taken in chunks from the last hidden state, without the full
            logits (docs/decoder_only.md). Default: it implements a hook that gets the logits or the outputs
            (:data:`LOGITS_HOOKS`); set ``needs_logits = True`` for a trick that reads them elsewhere (an event, a
            ``training_step``), ``False`` for one whose hooks never read them.
    """

    order: int = DEFAULT_ORDER
    name: str | None = None
    changes_loss: bool = False
    in_evaluation: bool = True
    extra_backwards: bool = False
    deepspeed: bool = True
    zero3: bool = True
    fsdp: bool = True
    unsupported_reason: str = ""
    outputs_needed: frozenset[str] = frozenset()
    logged_state: tuple[str, ...] = ()

    @property
    def needs_logits(self) -> bool:
        return any(self.overrides(hook) for hook in LOGITS_HOOKS)

    # ---- Building (TricksTrainer.__init__) --------------------------------------------------------------------------

    def prepare_model(self, trainer: TricksTrainer, model: nn.Module) -> None:
        """Change the model before the Trainer wraps it (heads, hooks); again for each ``model_init`` model."""

    def setup(self, trainer: TricksTrainer) -> None:
        """Once the Trainer is built: check what the trick needs (raise ``ValueError`` naming the settings), build
        what depends on the dataset or the distributed setup."""

    # ---- The loss of a forward pass (TricksTrainer.compute_loss; batches with one label column) ------------------

    def prepare_loss_batch(self, trainer: TricksTrainer, batch: LossBatch) -> LossBatch:
        """The batch before the forward (R-Drop doubles it)."""
        return batch

    def forward_context(self, trainer: TricksTrainer, batch: LossBatch) -> contextlib.AbstractContextManager | None:
        """A context around the loss's forward pass (``None``: none). A context that computes the loss inside the
        forward (a CRF, so that DDP / FSDP see its parameters used) puts it in ``outputs.loss`` and sets
        ``batch.loss_in_outputs = True``: :class:`LossInForward` does both."""
        return None

    def forward(self, trainer: TricksTrainer, model: nn.Module, inputs: dict, labels: torch.Tensor):
        """The forward pass the loss is taken on, replacing ``model(**inputs)`` (``inputs`` without labels,
        ``labels`` unshifted), or ``None`` for the plain one (scheduled sampling's two passes)."""
        return None

    def head_samples(self, trainer: TricksTrainer, logits: torch.Tensor) -> list[torch.Tensor] | None:
        """Several logits to average the loss over (multi-sample dropout), or ``None``."""
        return None

    def compute_loss(
        self, trainer: TricksTrainer, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None
    ) -> torch.Tensor | None:
        """The loss on ``logits`` against ``labels`` (shifted for a causal LM): a mean, or ``sum /
        num_items_in_batch``; ``None`` to leave it to the next trick."""
        return None

    def adjust_logits_loss(
        self, trainer: TricksTrainer, logits: torch.Tensor, batch: LossBatch, loss: torch.Tensor
    ) -> torch.Tensor:
        """One head's loss with this trick's terms on its ``logits``, in the loss's own units (R-Drop's KL)."""
        return loss

    def adjust_loss(self, trainer: TricksTrainer, inputs: dict, outputs, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss per item with this trick's terms added.

        Called once per training forward whose loss is backpropagated (an attack's and SAM's extra passes too:
        ``trainer.loss_context.pass_kind`` tells them apart). ``inputs`` and ``outputs`` have the same rows (R-Drop:
        the doubled batch, labels included). What the trick adds is weighed by the micro-batch's share of the step's
        items (``trainer.loss_context.share``), so a per-item term stays exact under gradient accumulation and DDP, a
        constant added on the clean pass of every micro-batch counts once per step, and a trick that returns ``loss``
        unchanged leaves it bitwise unchanged. The training logs show ``loss_raw``, the loss before these terms,
        beside ``loss``.
        """
        return loss

    def count_items(self, trainer: TricksTrainer, labels: torch.Tensor) -> torch.Tensor | None:
        """This trick's item count of ``labels`` (shifted for a causal LM): what its loss divides by, e.g. sentences
        for a CRF; ``None`` to leave it to the next trick (default: the labelled positions)."""
        return None

    # ---- The training step (TricksTrainer.training_step) ----------------------------------------------------------

    def training_step(
        self, trainer: TricksTrainer, model: nn.Module, inputs: dict, num_items_in_batch=None
    ) -> torch.Tensor | None:
        """Run the micro-batch's forwards and backwards and return the loss to log (``None``: upstream's step).
        Build it on ``trainer.multi_pass(model, inputs, num_items_in_batch)``, which carries upstream's step
        preamble, the micro-batch boundary (``no_sync``) and the draws the passes share."""
        return None

    # ---- The optimizer (TricksTrainer.build_optimizer_groups) ------------------------------------------------------

    def param_group_options(self, trainer: TricksTrainer, model: nn.Module) -> dict:
        """Group rules for :func:`~nlp_tricks.build_param_groups`: ``no_decay`` (regexes on parameter names, added to
        the defaults) and ``lr_scales`` (regex on parameter names -> a learning-rate factor that multiplies with
        ``layer_decay`` and ``head_lr_scale``; a parameter matching several gets their product)."""
        return {}

    # ---- Evaluation, prediction, the final model ----------------------------------------------------------------

    def adjust_predictions(self, trainer: TricksTrainer, inputs: dict, logits: torch.Tensor) -> torch.Tensor:
        """The evaluation logits the metrics see (a CRF returns its Viterbi paths as one-hot scores)."""
        return logits

    def eval_weights(self, trainer: TricksTrainer) -> contextlib.AbstractContextManager | None:
        """A context in which the model holds the weights to evaluate, predict and save as the final model (EMA)."""
        return None

    def saved_weights_info(self, trainer: TricksTrainer) -> dict | None:
        """What the final saved weights are, when this trick chose them (written as ``averaging.json``)."""
        return None

    def train_end(self, trainer: TricksTrainer) -> None:
        """After upstream's training loop, before ``train()`` returns (SWA loads its average here); not called when
        training was stopped early (SIGTERM, ``--max_time``)."""

    # ---- State carried by checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This trick's state (tensors, numbers, strings, None, lists and dicts of them), saved in every
        ``checkpoint-N`` (``tricks_state.safetensors``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s value when training resumes from a checkpoint: after every trick's
        ``on_train_begin``, so what holds the state (built there) is there to take it."""

    # ---- Helpers ----------------------------------------------------------------------------------------------------

    def summary(self) -> list[str]:
        """The settings of this trick as ``field=value`` (for messages and the model card)."""
        return [type(self).__name__]

    @property
    def state_name(self) -> str:
        return self.name or type(self).__name__

    def has_state(self) -> bool:
        """Whether this trick keeps checkpointed state (it implements :meth:`state_dict`)."""
        return self.overrides("state_dict")

    def overrides(self, hook: str) -> bool:
        """Whether this trick implements ``hook`` (the trainer calls only the tricks that do)."""
        return getattr(type(self), hook) is not getattr(Trick, hook)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


#: The hooks and their signatures, in the order of :data:`HOOK_RULES` (what docs/tricks.md's table lists).
HOOKS = {name: getattr(Trick, name) for name in HOOK_RULES}


@contextlib.contextmanager
def nested(contexts) -> Iterator[None]:
    """Enter each context that is not ``None``, in order (exited in reverse)."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            if context is not None:
                stack.enter_context(context)
        yield


def merge_options(answers: list[tuple[Trick, dict]]) -> dict:
    """The answers of several tricks to a ``merge`` hook, combined by the rule (:data:`RULES`)."""
    merged: dict = {}
    owners: dict[tuple[str, object], Trick] = {}
    for trick, options in answers:
        for key, value in (options or {}).items():
            if isinstance(value, Mapping):
                target = merged.setdefault(key, {})
                for name, item in value.items():
                    if name in target and target[name] != item:
                        raise ValueError(
                            f"{owners[(key, name)]!r} and {trick!r} both set {key}[{name!r}] ({target[name]} and "
                            f"{item}); only one trick may"
                        )
                    target[name] = item
                    owners[(key, name)] = trick
            elif isinstance(value, (list, tuple)):
                merged[key] = tuple(merged.get(key, ())) + tuple(value)
            else:
                if key in merged and merged[key] != value:
                    raise ValueError(
                        f"{owners[(key, None)]!r} and {trick!r} both set {key} ({merged[key]} and {value}); only one "
                        "trick may"
                    )
                merged[key] = value
                owners[(key, None)] = trick
    return merged


#: The optimizers that update the weights inside backward: a trick with ``extra_backwards`` cannot run with them.
STEPS_INSIDE_BACKWARD = ("lomo", "adalomo")


def capability_problem(
    trick: Trick,
    *,
    optim: str | None = None,
    deepspeed: bool = False,
    zero_stage: int | None = None,
    fsdp: bool = False,
) -> str | None:
    """Why ``trick``'s capability flags exclude a run with this optimizer and engine, in one line naming the
    settings, or ``None``: the one check behind every such refusal (the trainer's when it is built, the arguments'
    when only the optimizer is known)."""
    settings = trick.summary() or [repr(trick)]
    if trick.extra_backwards and optim in STEPS_INSIDE_BACKWARD:
        return (
            f"{settings[0]} runs several backward passes per step, but optim={optim!r} updates the weights inside "
            "backward; choose another optimizer"
        )
    engine = None
    if fsdp and not trick.fsdp:
        engine = "FSDP"
    elif deepspeed and not trick.deepspeed:
        engine = "DeepSpeed"
    elif deepspeed and zero_stage == 3 and not trick.zero3:
        engine = "DeepSpeed ZeRO stage 3"
    if engine is None:
        return None
    why = f": {trick.unsupported_reason}" if trick.unsupported_reason else ""
    return f"{', '.join(settings)} is not supported with {engine}{why}"


class LossInForward:
    """A loss computed inside the model's forward, as a built-in head computes its own, so that DDP / FSDP see the
    parameters it uses (a CRF's scores, a span head): a forward hook on the model that puts ``loss(trainer, module,
    outputs, labels, num_items)`` into ``outputs.loss`` while :meth:`computing` is open.

    A trick attaches one in ``prepare_model`` (:meth:`attach`) and returns :meth:`computing` from
    ``forward_context``; the trainer then takes ``outputs.loss`` (``batch.loss_in_outputs``). The hook holds the
    trainer weakly, so ``copy.deepcopy(model)`` copies the hook, not the trainer.
    """

    def __init__(self, trainer: TricksTrainer, model: nn.Module, loss: Callable[..., torch.Tensor]):
        self._trainer = weakref.ref(trainer)
        self._loss = loss
        self._pending: tuple | None = None
        self._handle = model.register_forward_hook(self)

    @classmethod
    def attach(cls, previous: LossInForward | None, trainer: TricksTrainer, model: nn.Module, loss) -> LossInForward:
        """A hook on ``model`` in place of ``previous`` (each ``model_init`` model gets its own)."""
        if previous is not None:
            previous.remove()
        return cls(trainer, model, loss)

    @contextlib.contextmanager
    def computing(self, batch: LossBatch) -> Iterator[None]:
        """While open, the model's next forward returns the loss of ``batch`` (then ``batch.loss_in_outputs``)."""
        self._pending = (batch.loss_labels, batch.num_items)
        try:
            yield
            batch.loss_in_outputs = self._pending is None
        finally:
            self._pending = None

    def __call__(self, module: nn.Module, args: tuple, outputs):
        trainer = self._trainer()
        if self._pending is None or trainer is None:
            return None
        labels, num_items = self._pending
        self._pending = None  # one forward per request (a nested call of the same model stays plain)
        return trainer.outputs_with_loss(outputs, self._loss(trainer, module, outputs, labels, num_items))

    def remove(self) -> None:
        self._handle.remove()
