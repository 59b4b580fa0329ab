"""``Trick``: the small protocol through which TricksTrainer runs every trick, built-in or a user's."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import TrainerCallback

from ..runtime import upstream as _upstream

if TYPE_CHECKING:
    from ..trainer import TricksTrainer

__all__ = ["Trick", "LossBatch", "TRICKS_STATE_NAME", "save_trick_states", "load_trick_states"]

# The file in a ``checkpoint-N`` folder that holds the ``state_dict()`` of every trick that has one.
TRICKS_STATE_NAME = "tricks_state.safetensors"


@dataclass
class LossBatch:
    """One training (or evaluation) batch on its way through :meth:`TricksTrainer.compute_loss`.

    Attributes:
        inputs: what the model's forward gets (``labels`` removed).
        labels: the batch's labels as given (unshifted).
        loss_labels: the label each logit position is scored against (shifted for a causal LM).
        teacher_logits: a distillation batch's teacher scores, else ``None``.
        num_items: the loss's divisor: the item count of the whole accumulated, all-process batch (``None``: the
            loss is a mean over this batch).
    """

    inputs: dict[str, Any]
    labels: torch.Tensor
    loss_labels: torch.Tensor
    teacher_logits: torch.Tensor | None
    num_items: torch.Tensor | int | None

    def replace(self, **changes) -> LossBatch:
        return replace(self, **changes)


class Trick(TrainerCallback):
    """One trick, wired into :class:`~nlp_tricks.TricksTrainer`: pass it as ``TricksTrainer(..., tricks=[...])``.

    A trick is a :class:`~transformers.TrainerCallback` (the trainer adds it as one, so every callback event, such as
    ``on_optimizer_step`` or ``on_step_end``, is available) that may also do what callbacks cannot: change the loss,
    replace the training step, add optimizer-group rules, change predictions, swap the weights used for evaluation
    and saving, and keep state that checkpoints carry. Every hook is optional; the default leaves things as they are.
    Hooks are named after the ``Trainer`` methods they extend. The order in which the trainer runs them is written
    once, in :class:`~nlp_tricks.TricksTrainer` (see docs/tricks.md, "Writing your own trick").

    The hook most tricks need::

        class LogitPenalty(Trick):
            def adjust_loss(self, trainer, inputs, outputs, loss):
                return loss + 0.1 * outputs.logits.pow(2).mean()

    ``adjust_loss`` is called once per training forward whose loss is backpropagated (once per plain step; an
    attack's extra passes call it too). ``loss`` is this micro-batch's mean loss per item; the trainer weighs the
    returned value by the micro-batch's share of the step's items, so a term added here stays exact under gradient
    accumulation and DDP (with one micro-batch and one process it is the loss as returned).
    """

    #: The name the trick's state is saved under (default: the class name).
    name: str | None = None
    #: Whether the trick changes the training loss (a ``compute_loss_func`` or a model's own loss would skip it).
    changes_loss: bool = False

    # ---- Building (TricksTrainer.__init__) --------------------------------------------------------------------------

    def prepare_model(self, trainer: TricksTrainer, model: nn.Module) -> None:
        """Change the model before the Trainer wraps it (heads, hooks); again for each ``model_init`` model."""

    def setup(self, trainer: TricksTrainer) -> None:
        """Once the Trainer is built: check what the trick needs (raise ``ValueError`` naming the settings), build
        what depends on the dataset or the distributed setup."""

    # ---- Loss (TricksTrainer.compute_loss; batches with one label column) -------------------------------------------

    def prepare_loss_batch(self, trainer: TricksTrainer, batch: LossBatch) -> LossBatch:
        """The batch before the forward (e.g. R-Drop doubles it)."""
        return batch

    def loss_in_forward(self, trainer: TricksTrainer, batch: LossBatch) -> contextlib.AbstractContextManager | None:
        """A context around the forward inside which the model's outputs come back with this trick's loss (a CRF
        computes it inside the forward, so DDP sees its parameters used). ``None``: the loss is taken on the logits."""
        return None

    def forward(self, trainer: TricksTrainer, model: nn.Module, inputs: dict, labels: torch.Tensor):
        """The forward pass whose logits the loss is taken on (``inputs`` without labels, ``labels`` unshifted), or
        ``None`` for the plain ``model(**inputs)``."""
        return None

    def head_samples(self, trainer: TricksTrainer, logits: torch.Tensor) -> list[torch.Tensor] | None:
        """Several logits to average the loss over (multi-sample dropout), or ``None``."""
        return None

    def compute_loss(
        self, trainer: TricksTrainer, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None
    ) -> torch.Tensor | None:
        """The loss on ``logits`` (a mean, or ``sum / num_items_in_batch``), or ``None`` to leave it to the next
        trick; the first trick that returns one is used."""
        return None

    def adjust_logits_loss(
        self, trainer: TricksTrainer, logits: torch.Tensor, batch: LossBatch, loss: torch.Tensor
    ) -> torch.Tensor:
        """The loss of one head's ``logits`` with this trick's terms, in the loss's own units (R-Drop's KL)."""
        return loss

    def adjust_loss(self, trainer: TricksTrainer, inputs: dict, outputs, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss with this trick's terms added (see the class docstring)."""
        return loss

    def count_items(self, trainer: TricksTrainer, labels: torch.Tensor) -> torch.Tensor | None:
        """This trick's item count of ``labels`` (already shifted for a causal LM): what its loss divides by, e.g.
        sentences for a CRF; ``None`` to leave it to the next trick (the default counts labelled positions)."""
        return None

    # ---- Training step (TricksTrainer.training_step) -------------------------------------------------------------

    def training_step(
        self, trainer: TricksTrainer, model: nn.Module, inputs: dict, num_items_in_batch=None
    ) -> torch.Tensor | None:
        """Run the whole training step (forwards and backwards) and return the loss to log, or ``None`` for
        upstream's step. At most one trick of a run may take the step."""
        return None

    def micro_batch(self, trainer: TricksTrainer) -> contextlib.AbstractContextManager | None:
        """A context around every pass of one micro-batch in a trick's training step: passes inside it reuse what
        this trick draws in the first (scheduled sampling's mixing)."""
        return None

    # ---- Optimizer (TricksTrainer.build_optimizer_groups) --------------------------------------------------------

    def param_group_options(self, trainer: TricksTrainer, model: nn.Module) -> dict:
        """Extra keyword arguments of :func:`~nlp_tricks.build_param_groups`: ``no_decay`` patterns (added to the
        defaults) and ``module_lr_scales`` (merged)."""
        return {}

    # ---- Evaluation, prediction, saving -------------------------------------------------------------------------

    def prediction_step(self, trainer: TricksTrainer, logits: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The evaluation logits the metrics see (a CRF returns its Viterbi paths as one-hot scores)."""
        return logits

    def eval_weights(self, trainer: TricksTrainer) -> contextlib.AbstractContextManager | None:
        """A context in which the model holds the weights to evaluate, predict and save as the final model (EMA)."""
        return None

    def saved_weights_info(self, trainer: TricksTrainer) -> dict | None:
        """What the final saved weights are, when this trick chose them (written as ``averaging.json``)."""
        return None

    def save_checkpoint(self, trainer: TricksTrainer, folder: str) -> None:
        """Write this trick's files into ``checkpoint-N`` (before ``trainer_state.json``, so complete checkpoints
        hold them). Called on the process that saves."""

    def checkpoint_files(self, trainer: TricksTrainer) -> tuple[str, ...]:
        """Files this trick needs in a checkpoint to resume from it."""
        return ()

    def resume(self, trainer: TricksTrainer, checkpoint: str | None) -> None:
        """Before training starts: ``checkpoint`` is the folder it resumes from (``None`` for a fresh run)."""

    def train_end(self, trainer: TricksTrainer) -> None:
        """After upstream's training loop, before ``train()`` returns (SWA loads its average here); not called
        when training was stopped early (SIGTERM, ``--max_time``)."""

    # ---- State carried by checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This trick's state (tensors, numbers, strings, lists and dicts of them), saved with every checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s value when training resumes from a checkpoint."""

    # ---- Helpers ----------------------------------------------------------------------------------------------------

    def summary(self) -> list[str]:
        """The settings of this trick as ``field=value`` (for messages and the model card)."""
        return [type(self).__name__]

    @property
    def state_name(self) -> str:
        return self.name or type(self).__name__

    def has_state(self) -> bool:
        """Whether this trick keeps checkpointed state (it overrides :meth:`state_dict`)."""
        return type(self).state_dict is not Trick.state_dict

    def overrides(self, hook: str) -> bool:
        """Whether this trick implements ``hook`` (the trainer skips the hooks nobody implements)."""
        return getattr(type(self), hook) is not getattr(Trick, hook)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def record_loss_term(trainer: TricksTrainer, name: str, term: torch.Tensor, num_items_in_batch) -> None:
    """Log a loss term beside the logged ``loss``, on its scale. With ``num_items_in_batch`` the term is this
    micro-batch's share of the step's per-item mean (over micro-batches and processes): scaled back up by both
    counts."""
    if num_items_in_batch is not None:
        try:
            micro_batches = _upstream.accumulation_steps(trainer)
        except AttributeError:  # called outside the training loop
            micro_batches = 1
        term = term * micro_batches * trainer.loss_scale_for_devices()
    trainer.record_metric(name, term)


# ---- The tricks' state in a checkpoint ---------------------------------------------------------------------------


def save_trick_states(path: str, states: dict[str, dict]) -> None:
    """Write ``{trick name: state_dict}`` as one safetensors file: tensors as tensors, the rest as JSON metadata."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(value, key: str):
        if torch.is_tensor(value):
            tensors[key] = value.detach().cpu().contiguous()
            return {"__tensor__": key}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"trick state {key!r}: dict keys must be strings")
            return {k: encode(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(v, f"{key}.{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(
            f"trick state {key!r} holds a {type(value).__name__}; a state_dict may hold tensors, numbers, strings, "
            "None, and lists and dicts of them"
        )

    structure = {name: encode(state, name) for name, state in states.items()}
    save_file(tensors, path, metadata={"structure": json.dumps(structure)})


def load_trick_states(path: str) -> dict[str, dict]:
    """Read :func:`save_trick_states`' file back (tensors on the CPU)."""
    with safe_open(path, framework="pt") as f:
        structure = json.loads(f.metadata()["structure"])
        tensors = {key: f.get_tensor(key) for key in f.keys()}

    def decode(value):
        if isinstance(value, dict):
            if set(value) == {"__tensor__"}:
                return tensors[value["__tensor__"]]
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return {name: decode(state) for name, state in structure.items()}


def checkpoint_trick_states(folder: str) -> dict[str, dict] | None:
    path = os.path.join(folder, TRICKS_STATE_NAME)
    return load_trick_states(path) if os.path.isfile(path) else None


@contextlib.contextmanager
def nested(contexts) -> Iterator[None]:
    """Enter each context that is not ``None``, in order."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            if context is not None:
                stack.enter_context(context)
        yield


def tricks_section(tricks, saved_weights: dict | None) -> str:
    """The model card's section on a run's tricks and, when a trick chose them, the saved weights."""
    lines = ["", "## Tricks (nlp_tricks)", "", "Trained with `nlp_tricks.TricksTrainer` and these tricks:", ""]
    lines += [f"- `{setting}`" for trick in tricks for setting in trick.summary()]
    if saved_weights is not None:
        what = {"ema": "the exponential moving average of the weights", "swa": "the average of checkpoints"}
        details = ", ".join(f"{k}: {v}" for k, v in saved_weights.items() if k != "weights")
        kind = saved_weights["weights"]
        lines += ["", f"The saved weights are {what.get(kind, kind)} ({details})."]
    return "\n".join(lines) + "\n"
