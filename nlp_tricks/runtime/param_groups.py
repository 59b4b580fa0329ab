"""BERT-style optimizer parameter groups: no decay on bias / norm weights, a head learning rate, layer-wise lr decay.

Layer-wise learning-rate decay: Howard & Ruder 2018 (https://arxiv.org/abs/1801.06146), Clark et al. 2020
(ELECTRA, https://arxiv.org/abs/2003.10555). Encoder layer ``i`` (0-based) of ``L`` trains at
``learning_rate * layer_decay ** (L - i)``, the embeddings at ``layer_decay ** (L + 1)``, everything in the base model
above the last layer (pooler, final norm) at ``learning_rate``, and the task head (parameters outside
``model.base_model``; for a model that is its own base model, such as T5ForConditionalGeneration, its output projection
when untied) at ``learning_rate * head_lr_scale``. Encoder-decoder models count decoder layers after encoder layers,
so ``L`` is their sum.

Decoder-only layouts are read the same way: Llama / Mistral / Qwen2 (``model.layers.N``, ``model.embed_tokens``),
GPT-2 (``transformer.h.N``, ``transformer.wte`` / ``wpe``), GPT-NeoX (``gpt_neox.layers.N``, ``gpt_neox.embed_in``).
An untied ``lm_head`` is the head; one tied to the input embeddings is a single parameter, in the embeddings' group.

PEFT models (``peft.PeftModel``) are read through the transformers model they wrap: only trainable parameters
(adapters, ``modules_to_save``) are grouped, a LoRA matrix of layer i gets layer i's rate, and the ``modules_to_save``
copy of the head gets ``head_lr_scale``. Parameters PEFT adds outside the wrapped model (prompt encoders) train at
``learning_rate``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

from torch import nn
from transformers.trainer_pt_utils import get_parameter_names

from ..functional.layers import layer_ids
from ..functional.models import unwrap_model

__all__ = [
    "build_param_groups",
    "upstream_param_groups",
    "decay_parameter_names",
    "head_parameter_ids",
    "layer_ids",
]

logger = logging.getLogger(__name__)

# The name patterns transformers' Trainer.get_decay_parameter_names uses (with nn.LayerNorm modules).
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def decay_parameter_names(model: nn.Module, no_decay: Iterable[str] = NO_DECAY_PATTERNS) -> set[str]:
    """Names of the parameters that get weight decay: all but those of ``nn.LayerNorm`` modules and those whose
    lower-cased name matches a ``no_decay`` regex (biases, norms). The same rule as
    ``transformers.Trainer.get_decay_parameter_names``, whose helper it uses.
    """
    return set(get_parameter_names(model, [nn.LayerNorm], list(no_decay)))


def head_parameter_ids(model: nn.Module) -> set[int]:
    """The ``id()`` of each task-head parameter: those outside ``model.base_model``.

    A model that is its own ``base_model`` (T5ForConditionalGeneration) has as head its output projection
    (``get_output_embeddings()``) when that is not tied to the input embeddings; tied, it has none.
    """
    base = getattr(model, "base_model", model)
    if base is not model:
        base_ids = {id(p) for p in base.parameters()}
        return {id(p) for p in model.parameters() if id(p) not in base_ids}
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if output is None:
        return set()
    get_input = getattr(model, "get_input_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    tied = {id(p) for p in embedding.parameters()} if isinstance(embedding, nn.Module) else set()
    return {id(p) for p in output.parameters()} - tied


def build_param_groups(
    model: nn.Module,
    *,
    learning_rate: float,
    weight_decay: float,
    head_lr_scale: float = 1.0,
    layer_decay: float = 1.0,
    no_decay: Iterable[str] = NO_DECAY_PATTERNS,
    module_lr_scales: Mapping[str, float] | None = None,
    lr_scales: Mapping[str, float] | None = None,
    param_optimizers: Mapping[str, str] | None = None,
) -> list[dict]:
    """Optimizer parameter groups, each with an absolute ``lr`` and ``weight_decay``.

    Args:
        model (`nn.Module`): a transformers model (its ``base_model`` separates body from head), a PEFT model
            wrapping one, or any module.
        learning_rate (`float`): base learning rate.
        weight_decay (`float`): decay for parameters that get it; biases and norm weights get 0.
        head_lr_scale (`float`, defaults to 1.0): multiplier for the head (see :func:`head_parameter_ids`; with PEFT,
            the ``modules_to_save`` head); a model without head parameters (its output projection tied to the input
            embeddings) logs a warning.
        layer_decay (`float`, defaults to 1.0): layer-wise decay factor in (0, 1]; 1 disables it.
        no_decay (iterable of `str`): regex name patterns that get no weight decay (Trainer's by default).
        module_lr_scales (`Mapping[str, float]`, *optional*): submodule name -> lr multiplier; that submodule's
            parameters (e.g. ``{"crf": 100.0}`` for ``model.crf``) form their own groups, labelled with the name, at
            ``learning_rate * scale`` (neither ``head_lr_scale`` nor ``layer_decay`` applies to them).
        lr_scales (`Mapping[str, float]`, *optional*): regex (``re.search`` on the parameter name) -> lr factor that
            multiplies with the head scale and layer decay (a parameter matching several patterns gets their
            product); e.g. ``{r"lora_B": 16.0}`` for LoRA+. The groups are split by the resulting rate, labelled
            ``<label>*<pattern>``.
        param_optimizers (`Mapping[str, str]`, *optional*): parameter name -> the optimizer that updates it (the
            ``muon`` trick's matrices: ``"muon"``); those parameters form their own groups (the same lr and weight
            decay), labelled ``<label>:<optimizer>`` and carrying ``"optimizer": <optimizer>``.

    Returns:
        `list[dict]`: groups with keys ``params``, ``lr``, ``weight_decay``, ``lr_scale`` (lr / learning_rate),
        ``label`` ("head", "embeddings", "layer_<i>", "top", "body", "peft" or a ``module_lr_scales`` name) and
        ``names``. Every trainable parameter is in exactly one group; frozen ones are in none.

    Raises:
        ValueError: ``layer_decay != 1`` on a model whose layer stacks cannot be found (names the model class).
    """
    if not 0.0 < layer_decay <= 1.0:
        raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
    if head_lr_scale <= 0:
        raise ValueError(f"head_lr_scale must be > 0, got {head_lr_scale}")
    decay_names = decay_parameter_names(model, no_decay)
    rates = _GroupRates(model, head_lr_scale, layer_decay, module_lr_scales, lr_scales, param_optimizers)
    groups: dict[tuple[str, float], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        wd = weight_decay if name in decay_names else 0.0
        settings = rates.settings(name, param, learning_rate, wd)
        group = groups.setdefault((settings["label"], wd), {"params": [], "names": [], **settings})
        group["params"].append(param)
        group["names"].append(name)
    return list(groups.values())


class _GroupRates:
    """The group label and learning-rate factor of each parameter of one model under :func:`build_param_groups`'
    rules (its arguments of the same names)."""

    def __init__(self, model: nn.Module, head_lr_scale, layer_decay, module_lr_scales, lr_scales, param_optimizers):
        # PEFT: the transformers model inside, whose base_model separates the head.
        inner = unwrap_model(model, peft=True)
        self.inner_ids = {id(p) for p in inner.parameters()}
        base = getattr(inner, "base_model", inner)
        self.head_ids = head_parameter_ids(inner)
        self.head_lr_scale, self.layer_decay = head_lr_scale, layer_decay
        if head_lr_scale != 1.0 and not self.head_ids:
            logger.warning(
                f"head_lr_scale={head_lr_scale} cannot apply to {type(inner).__name__}: it has no head parameters "
                "apart from its body (no parameter outside model.base_model, and no output projection untied from "
                "the input embeddings); every parameter trains at the body's learning rate"
            )
        self.base_names = {id(p): n for n, p in base.named_parameters()}
        self.layers, self.num_layers = layer_ids(base) if layer_decay != 1.0 else ({}, 0)
        if layer_decay != 1.0 and self.num_layers == 0:
            raise ValueError(
                f"layer_decay={layer_decay} needs numbered layer stacks (encoder.layer.N, layers.N, block.N, ...), "
                f"but none were found in {type(model).__name__}; use layer_decay=1.0 for this model"
            )
        self.own_scale = {}
        for module_name, scale in (module_lr_scales or {}).items():
            if scale <= 0:
                raise ValueError(f"module_lr_scales[{module_name!r}] must be > 0, got {scale}")
            self.own_scale.update({id(p): (module_name, scale) for p in model.get_submodule(module_name).parameters()})
        self.patterns = []
        for pattern, factor in (lr_scales or {}).items():
            if not factor > 0:
                raise ValueError(f"lr_scales[{pattern!r}] must be > 0, got {factor}")
            self.patterns.append((re.compile(pattern), pattern, float(factor)))
        self.optimizers = dict(param_optimizers or {})

    def settings(self, name: str, param: nn.Parameter, learning_rate: float, weight_decay: float) -> dict:
        """The settings of ``param``'s group: ``lr``, ``weight_decay``, ``lr_scale``, ``label`` and, for a parameter
        another optimizer updates (``param_optimizers``), ``optimizer`` (its own groups, labelled
        ``<label>:<optimizer>``)."""
        label, scale = self.of(name, param)
        settings = {"lr": learning_rate * scale, "weight_decay": weight_decay, "lr_scale": scale, "label": label}
        optimizer = self.optimizers.get(name)
        if optimizer:
            settings.update(label=f"{label}:{optimizer}", optimizer=optimizer)
        return settings

    def of(self, name: str, param: nn.Parameter) -> tuple[str, float]:
        """The label of ``param``'s group and its learning-rate factor."""
        if id(param) in self.own_scale:
            return self.own_scale[id(param)]
        if id(param) not in self.inner_ids:  # added by PEFT around the model (prompt encoders)
            label, scale = "peft", 1.0
        elif id(param) in self.head_ids:
            label, scale = "head", self.head_lr_scale
        elif self.layer_decay != 1.0:
            layer, top = self.layers[self.base_names[id(param)]], self.num_layers + 1
            label = "embeddings" if layer == 0 else "top" if layer == top else f"layer_{layer - 1}"
            scale = self.layer_decay ** (top - layer)
        else:
            label, scale = "body", 1.0
        for regex, pattern, factor in self.patterns:
            if regex.search(name):
                label, scale = f"{label}*{pattern}", scale * factor
        return label, scale


def upstream_param_groups(trainer, model: nn.Module) -> list[dict]:
    """The two groups ``transformers.Trainer.create_optimizer`` builds (the parameters that get weight decay, then
    those that do not; frozen ones in neither, empty groups kept), so that an optimizer state moves between
    ``Trainer`` and ``TricksTrainer`` both ways."""
    decay = set(trainer.get_decay_parameter_names(model))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in params if n in decay], "weight_decay": trainer.args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]


def group_learning_rates(groups: list[dict], learning_rate: float) -> dict[str, float]:
    """The logged learning rates of an optimizer's ``groups``, from upstream's ``learning_rate`` (group 0's lr).

    ``learning_rate`` becomes the body's (``args.learning_rate`` times the schedule) whichever group comes first:
    upstream logs group 0's lr, which is the head's on models that register their head first (XLM-R) and the
    embeddings' with layer-wise decay. With groups that carry ``lr_scale`` (:func:`build_param_groups`) it is the
    body's on every model, and ``lr/<label>`` gives each group's when they differ.
    """
    initial = [g.get("initial_lr", g["lr"]) for g in groups]
    if not initial or initial[0] <= 0:
        return {}
    logs = {"learning_rate": learning_rate}
    if groups[0].get("lr_scale", 0) > 0:
        logs["learning_rate"] = learning_rate / groups[0]["lr_scale"]
        reference = initial[0] / groups[0]["lr_scale"]
    else:  # groups built elsewhere: relative to group 0, as upstream's `learning_rate`
        reference = initial[0]
    if len(set(initial)) > 1:
        for i, group in enumerate(groups):
            logs[f"lr/{group.get('label', i)}"] = logs["learning_rate"] * initial[i] / reference
    return logs


def group_signature(groups: list[dict], settings: dict) -> dict:
    """What a checkpoint records of the optimizer's groups (label, lr scale, weight decay, parameter count) and of
    the ``settings`` that built them, to tell a resume with other settings apart."""
    rows = [
        [g.get("label", str(i)), round(float(g.get("lr_scale", 1.0)), 10), g.get("weight_decay"), len(g["params"])]
        for i, g in enumerate(groups)
    ]
    return {"groups": rows, "settings": settings}
