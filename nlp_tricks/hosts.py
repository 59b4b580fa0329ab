"""Tricks on the trainers users already have: ``with_tricks(SFTTrainer)``, ``with_tricks(DPOTrainer)``, ...

``with_tricks(Host)`` is a subclass of ``Host`` (any ``transformers.Trainer`` subclass) that keeps the host's
constructor, arguments class, defaults, loss and metrics, and runs TricksTrainer's tricks around them::

    from trl import SFTConfig, SFTTrainer
    from nlp_tricks import TricksConfig, with_tricks

    trainer = with_tricks(SFTTrainer)(
        model=model, args=SFTConfig(...), train_dataset=data, tricks_config=TricksConfig(adversarial="fgm")
    )

What runs: the tricks that act on the step, the weights or the optimizer (the attacks, SAM, EMA / SWA, freezing,
re-initialised layers, layer-wise decay and the head's lr on the host's own parameter groups, your tricks'
``adjust_loss`` terms, state, order, callbacks). The host computes its loss: tricks that need its logits and labels
(focal loss, label smoothing, a CRF, R-Drop, ...) are refused when the trainer is built, naming the host and the
trick. The host's metrics (trl's ``_metrics``, its token count) are recorded for the clean pass only, not for an
attack's or SAM's extra passes. A trick that takes the step runs inside the host's own ``training_step`` (trl's
GRPO and RLOO count their micro-batches there). After ``train()`` with an EMA, ``trainer.model`` holds the raw
weights while ``save_model`` writes the average: ``trainer.averaged_model()`` is a copy with the averaged weights.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Mapping

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from .config import TricksConfig
from .runtime import upstream as _upstream
from .runtime.param_groups import build_param_groups
from .trainer import TricksTrainer
from .trick import LOGITS_HOOKS, LossContext
from .tricks import Distillation, LossFunction, validate_arguments

__all__ = ["with_tricks", "HostedTricks"]

logger = logging.getLogger(__name__)

# The loss-pipeline hooks a host trainer never calls (its own compute_loss takes the loss): a trick implementing one
# cannot apply there. They are the hooks around the logits but ``adjust_loss`` (which a host's loss still goes
# through), and ``adjust_predictions``.
_PIPELINE_HOOKS = tuple(hook for hook in LOGITS_HOOKS if hook != "adjust_loss") + ("adjust_predictions",)
# Host state that records what a forward pass saw (trl's metrics and token count): kept for the clean pass only.
_HOST_METRIC_ATTRIBUTES = ("_metrics", "_total_train_tokens", "accum_loss_components")
# The attacks that perturb the embedding output from a forward hook, which skips forwards run without gradients.
_EMBEDDING_ATTACKS = ("fgm", "pgd", "freelb")


@functools.cache
def with_tricks(host: type) -> type:
    """A subclass of the trainer class ``host`` that takes ``tricks=[...]`` (:class:`~nlp_tricks.Trick` objects) and
    ``tricks_config=TricksConfig(...)`` (the trick fields) beside the host's own arguments, which pass through
    untouched. ``with_tricks(TricksTrainer)`` is TricksTrainer itself."""
    if not (isinstance(host, type) and issubclass(host, Trainer)):
        name = getattr(host, "__name__", type(host).__name__)
        module = getattr(host, "__module__", "") or ""
        hint = (
            "; SetFit's trainer runs a sentence-transformers body: train that body with "
            "with_tricks(SentenceTransformerTrainer) (setfit's own loop keeps no Trainer callbacks)"
            if module.startswith("setfit")
            else ""
        )
        raise TypeError(f"with_tricks takes a transformers.Trainer subclass, got {module}.{name}{hint}")
    if issubclass(host, TricksTrainer):
        return host
    namespace = {
        "__module__": __name__,
        "__qualname__": f"{host.__name__}WithTricks",
        "__doc__": f"``{host.__module__}.{host.__name__}`` with nlp_tricks' tricks (:func:`nlp_tricks.with_tricks`).",
    }
    # _TricksStep sits below the host: a trick that takes the step runs inside the host's own training_step. Trainer
    # itself wraps nothing around upstream's step (and _TricksStep, a Trainer, cannot sit below it): TricksTrainer's
    # training_step runs the trick there.
    below = () if host is Trainer else (_TricksStep,)
    return type(f"{host.__name__}WithTricks", (HostedTricks, TricksTrainer, host, *below), namespace)


class _HostedArguments:
    """The arguments the tricks read: the trick fields of ``tricks_config``, then the host's ``TrainingArguments``
    (``seed``, ``optim``, ``save_strategy``, ...). Writes go to ``tricks_config``."""

    def __init__(self, config: TricksConfig, trainer, given=None):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_given", given)

    def __getattr__(self, name):
        config = object.__getattribute__(self, "_config")
        if hasattr(config, name):
            return getattr(config, name)
        # The host's arguments once its constructor has built them; before, the ones passed to it, else
        # TrainingArguments' defaults (seed 42) for the tricks that prepare the model first.
        training = getattr(object.__getattribute__(self, "_trainer"), "args", None)
        training = training if training is not None else object.__getattribute__(self, "_given")
        if training is not None:
            return getattr(training, name)
        default = TrainingArguments.__dataclass_fields__[name].default
        if default is dataclasses.MISSING:
            raise AttributeError(name)
        return default

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_config"), name, value)

    def revalidate(self) -> None:
        object.__getattribute__(self, "_config").revalidate()


class HostedTricks:
    """The part of :func:`with_tricks`' class that sits before TricksTrainer: the host's constructor, loss, item
    count, predictions and optimizer groups instead of TricksTrainer's own."""

    def __init__(self, *args, tricks=(), tricks_config: TricksConfig | None = None, **kwargs):
        config = TricksConfig() if tricks_config is None else tricks_config
        if not isinstance(config, TricksConfig):
            raise TypeError(
                f"tricks_config takes nlp_tricks.TricksConfig (the trick fields), got {type(config).__name__}"
            )
        host = self._host()
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        hosted = _HostedArguments(config, self, given if isinstance(given, TrainingArguments) else None)
        self._take_tricks(hosted, tricks)
        self._refuse_pipeline_tricks(host)
        model = kwargs.get("model", args[0] if args else None)
        prepared = isinstance(model, nn.Module)
        if prepared:  # before the host wraps it (PEFT, ...), as TricksTrainer does
            self.call_tricks("prepare_model", model)
        # The host's own constructor, with its own arguments untouched (TricksTrainer's is skipped).
        super(TricksTrainer, self).__init__(*args, **kwargs)
        validate_arguments(hosted)  # again, with the host's TrainingArguments fields (optim, save_strategy, ...)
        self._refuse_embedding_attacks_on_cached_losses(host)
        self.loss_shifts_labels = False  # the host's loss decides its own shift
        if not prepared and self.model is not None:  # the host built the model from a name
            self.call_tricks("prepare_model", self.model)
        self._start_tricks()

    @classmethod
    def _host(cls) -> type:
        return next(base for base in cls.__mro__ if issubclass(base, Trainer) and not issubclass(base, TricksTrainer))

    def _refuse_pipeline_tricks(self, host: type) -> None:
        """The tricks that need the host's logits and labels, which its own loss does not hand out, refused in one
        line; the configured loss and distillation at their defaults are simply left out."""
        kept = []
        for trick in self.tricks:
            if isinstance(trick, Distillation):
                continue
            if isinstance(trick, LossFunction) and not trick.summary():
                if getattr(self.tricks_config, "chunked_lm_loss", False):
                    raise ValueError(
                        f"chunked_lm_loss=True cannot apply to {host.__name__}: the host computes its own loss, and "
                        "the chunked loss is TricksTrainer's; use it with TricksTrainer or leave it out"
                    )
                continue
            hooks = [hook for hook in _PIPELINE_HOOKS if trick.overrides(hook)]
            if hooks or "hidden_states" in trick.outputs_needed:
                settings = ", ".join(trick.summary()) or repr(trick)
                why = f"it implements {hooks[0]}" if hooks else "it asks for hidden_states"
                raise ValueError(
                    f"{settings} cannot apply to {host.__name__}: the host computes its own loss, without the logits "
                    f"and labels this trick needs ({why}); use it with TricksTrainer or leave it out"
                )
            kept.append(trick)
        self._use_tricks(kept)

    def _refuse_embedding_attacks_on_cached_losses(self, host: type) -> None:
        """sentence-transformers' ``Cached*`` losses (GradCache) take the loss from embeddings computed without
        gradients and run the forward again inside ``backward``: an attack on the embedding output (FGM, PGD,
        FreeLB) perturbs only that second forward, so its loss is the clean one and its gradient the clean loss's
        through perturbed activations. Refused in one line; AWP and SAM perturb the weights, which both forwards
        see, and train as with the loss uncached."""
        attack = getattr(self.tricks_config, "adversarial", "none")
        if attack not in _EMBEDDING_ATTACKS:
            return
        losses = getattr(self, "loss", None)
        for loss in losses.values() if isinstance(losses, Mapping) else [losses]:
            if _caches_gradients(loss):
                raise ValueError(
                    f"adversarial={attack!r} cannot apply to {type(loss).__name__} on {host.__name__}: the loss "
                    "caches gradients (GradCache), computing itself from embeddings taken without gradients, which "
                    "the attack cannot perturb; use adversarial='awp' or sam_rho (they perturb the weights), or the "
                    "loss without caching"
                )

    # ---- The step: the host's, with the trick that takes it inside ------------------------------------------------

    def call_tricks(self, hook: str, *args, **kwargs):
        """TricksTrainer's dispatch, but for ``training_step``: the trick that takes the step runs below the host's
        own ``training_step`` (:class:`_TricksStep`), so what the host does around the step still happens."""
        if hook == "training_step" and isinstance(self, _TricksStep):  # with_tricks(Trainer): upstream's own place
            return None
        return super().call_tricks(hook, *args, **kwargs)

    # ---- The loss: the host's, with the tricks' terms -------------------------------------------------------------

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """The host's ``compute_loss``; in training the tricks' ``adjust_loss`` terms added (``outputs`` is ``None``
        unless the host returned them), and its metrics kept for the clean pass only."""
        host_loss = super(TricksTrainer, self).compute_loss
        training = model.training and torch.is_grad_enabled()
        outer = self._context
        if outer is None or not model.training:
            self._context = LossContext(phase="train" if model.training else "eval")
        context = self._context
        context.forget_pass()
        try:
            extra_pass = training and context.pass_kind != "clean"
            saved = self._host_metrics() if extra_pass else None
            try:
                with self._capturing(model, None):
                    result = host_loss(
                        model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                    )
            finally:
                if saved is not None:
                    self._restore_host_metrics(saved)
            loss, outputs = result if return_outputs else (result, None)
            if training and self._implementers["adjust_loss"]:
                loss = self._hosted_adjust_loss(inputs, outputs, loss, num_items_in_batch)
        finally:
            if outer is None or not model.training:
                self._context = outer
        return (loss, outputs) if return_outputs else loss

    def _hosted_adjust_loss(self, inputs, outputs, loss, num_items_in_batch):
        """The tricks' terms on the host's loss: the host's loss is this micro-batch's share of the step's when it
        is scaled for accumulation (normalised by ``num_items_in_batch``), so a term is weighed by 1 / the
        micro-batches; otherwise upstream divides the whole loss by them after ``compute_loss``."""
        context = self._context
        steps = context.num_micro_batches if _upstream.loss_is_scaled_for_ga(self, num_items_in_batch) else 1
        weight = 1.0 / steps
        context.share = torch.as_tensor(weight) if steps > 1 else None
        mean = loss / weight
        adjusted = self.call_tricks("adjust_loss", inputs, outputs, value=mean)
        return loss + (adjusted - mean) * weight

    def _host_metrics(self) -> dict:
        return {name: copy.deepcopy(getattr(self, name)) for name in _HOST_METRIC_ATTRIBUTES if hasattr(self, name)}

    def _restore_host_metrics(self, saved: dict) -> None:
        for name, value in saved.items():
            current = getattr(self, name)
            if isinstance(current, dict) and isinstance(value, Mapping):
                current.clear()  # the same object: the host may hold references to it
                current.update(value)
            else:
                setattr(self, name, value)

    # ---- What stays the host's -----------------------------------------------------------------------------------

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        return super(TricksTrainer, self)._get_num_items_in_batch(batch_samples, device)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return super(TricksTrainer, self).prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _set_signature_columns_if_needed(self):
        return super(TricksTrainer, self)._set_signature_columns_if_needed()

    def _hp_search_setup(self, trial) -> None:
        super()._hp_search_setup(trial)
        if self.hp_search_backend is not None and trial is not None:
            self._refuse_pipeline_tricks(self._host())
            self._refuse_embedding_attacks_on_cached_losses(self._host())

    # ---- The optimizer: the host's groups, with the group rules' learning rates -----------------------------------

    def create_optimizer(self, model=None):
        """The host's optimizer; with a group rule on (``layer_decay``, ``head_lr_scale``, a trick's ``lr_scales``),
        each of the host's groups is split by the rules' learning-rate factor of its parameters (the host's own lr
        and weight decay per group kept, times the factor)."""
        if self.optimizer is not None:
            return self.optimizer
        optimizer = super(TricksTrainer, self).create_optimizer(model)
        opt_model = self.model if model is None else model
        options = self._group_rules(opt_model)
        if options is not None:
            scales = {
                id(p): (group["label"], group["lr_scale"])
                for group in build_param_groups(
                    opt_model,
                    learning_rate=1.0,
                    weight_decay=0.0,
                    head_lr_scale=options.get("head_lr_scale", 1.0),
                    layer_decay=options.get("layer_decay", 1.0),
                    module_lr_scales=options.get("module_lr_scales") or None,
                    lr_scales=options.get("lr_scales") or None,
                )
                for p in group["params"]
            }
            groups = []
            for group in optimizer.param_groups:
                by_scale: dict[tuple[str, float], list] = {}
                for p in group["params"]:
                    by_scale.setdefault(scales.get(id(p), ("body", 1.0)), []).append(p)
                for (label, scale), params in by_scale.items():
                    settings = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
                    groups.append(
                        {**settings, "params": params, "lr": group["lr"] * scale, "lr_scale": scale, "label": label}
                    )
            optimizer.param_groups = []  # regrouped before any step: there is no optimizer state yet
            for group in groups:
                optimizer.add_param_group(group)
        self._optimizer_groups = self._group_signature(self.optimizer.param_groups)
        return self.optimizer


class _TricksStep(Trainer):
    """Below the host in :func:`with_tricks`' class: when the host's ``training_step`` calls upstream's, the trick that
    takes the step (an attack's or SAM's passes) runs instead, inside what the host does around it (trl's GRPO and
    RLOO count their micro-batches there to pick the generation batch; SFT and DPO enter their activation-offload
    context)."""

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        loss = TricksTrainer.call_tricks(self, "training_step", model, inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch) if loss is None else loss


def _caches_gradients(loss) -> bool:
    """Whether a sentence-transformers loss (or a loss it wraps, as ``MatryoshkaLoss`` does) uses GradCache: it
    says so with ``uses_gradient_cache``; the ``Cached*`` class name is read too, for losses that do not say."""
    seen = set()
    while loss is not None and id(loss) not in seen:
        seen.add(id(loss))
        if getattr(loss, "uses_gradient_cache", False) is True or type(loss).__name__.startswith("Cached"):
            return True
        loss = getattr(loss, "loss", None)
    return False
