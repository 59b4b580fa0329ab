"""Pooling of an encoder's token states into one vector for sequence classification, in place of the CLS pooler.

Each mode reads only the positions the attention mask keeps (padding never counts):

- ``cls``: the first position's last hidden state (BERT: without its pooler's dense + tanh).
- ``mean``: the masked mean of the last hidden states.
- ``max``: the masked maximum of the last hidden states, per feature.
- ``mean_max``: ``[mean, max]`` concatenated (twice the hidden size; the first linear layer of the head is
  replaced by one of the right size).
- ``weighted_layers``: ``sum_l softmax(w)_l * mean_l`` over every hidden state the model returns (the embedding
  output and each layer's), ``w`` learned from zero (a uniform average at the start). The Kaggle QUEST winners'
  weighted layer average, over masked means.
- ``attention``: ``sum_t a_t h_t`` with ``a = softmax_t(v . tanh(W h_t + b))`` over the kept positions, ``W, b, v``
  learned (the CommonLit Readability winners' attention head).

:func:`add_pooling` attaches a mode to a ``*ForSequenceClassification`` model: the pooled vector replaces what the
model's own head reads (BERT / ALBERT: the pooler output, which then feeds dropout and the classifier, the pooler
itself removed; RoBERTa / XLM-R / ELECTRA / DeBERTa / DistilBERT: the position-0 state their head takes), so the
rest of the head is the model's. ``save_pretrained`` then writes the pooling's weights (``pooling.*``) and
``config.pooling``; :func:`load_pooled_model` loads such a folder back, no ``trust_remote_code`` needed.

The functions (:func:`masked_mean`, :func:`masked_max`, :func:`weighted_layer_mean`, :func:`attention_pool`) and
:class:`Pooling` work on plain tensors, with or without a transformers model.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from .models import model_class_with

__all__ = [
    "POOLING_MODES",
    "Pooling",
    "masked_mean",
    "masked_max",
    "weighted_layer_mean",
    "attention_pool",
    "add_pooling",
    "pooled_model_class",
    "load_pooled_model",
]

POOLING_MODES = ("cls", "mean", "max", "mean_max", "weighted_layers", "attention")

# Sequence classification heads that read the position-0 state of the base model's output (no pooler in the base).
_FIRST_TOKEN_HEADS = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "deberta", "deberta-v2", "distilbert"}
)


def _keep(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The mask as (B, L, 1) booleans (every position when ``attention_mask`` is None)."""
    if attention_mask is None:
        return torch.ones(hidden.shape[:2] + (1,), dtype=torch.bool, device=hidden.device)
    return attention_mask.to(hidden.device).bool().unsqueeze(-1)


def masked_mean(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of ``hidden`` (B, L, H) over the positions ``attention_mask`` (B, L) keeps, (B, H); accumulated in
    float32 and returned in ``hidden``'s dtype. A row with no kept position gives zeros."""
    keep = _keep(hidden, attention_mask)
    total = hidden.float().masked_fill(~keep, 0.0).sum(dim=1)
    count = keep.sum(dim=1).clamp(min=1)
    return (total / count).to(hidden.dtype)


def masked_max(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The per-feature maximum of ``hidden`` (B, L, H) over the kept positions, (B, H). A row with no kept position
    gives zeros."""
    keep = _keep(hidden, attention_mask)
    pooled = hidden.masked_fill(~keep, torch.finfo(hidden.dtype).min).amax(dim=1)
    return torch.where(keep.any(dim=1), pooled, torch.zeros_like(pooled))


def weighted_layer_mean(
    hidden_states, layer_weights: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``sum_l softmax(layer_weights)_l * masked_mean(hidden_states[l])`` over a sequence of (B, L, H) states."""
    if len(hidden_states) != layer_weights.numel():
        raise ValueError(
            f"weighted_layers pooling has {layer_weights.numel()} layer weights but the model returned "
            f"{len(hidden_states)} hidden states"
        )
    means = torch.stack([masked_mean(h, attention_mask).float() for h in hidden_states])  # (N, B, H)
    weights = torch.softmax(layer_weights.float(), dim=0)
    return torch.einsum("n,nbh->bh", weights, means).to(hidden_states[-1].dtype)


def attention_pool(hidden: torch.Tensor, scores: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """``sum_t softmax(scores)_t * hidden_t`` over the kept positions: ``hidden`` (B, L, H), ``scores`` (B, L)."""
    keep = _keep(hidden, attention_mask).squeeze(-1)
    scores = scores.float().masked_fill(~keep, -torch.inf)
    weights = torch.softmax(scores, dim=1).nan_to_num(0.0)  # a row with nothing kept: zeros, not NaN
    return torch.einsum("bl,blh->bh", weights, hidden.float()).to(hidden.dtype)


class Pooling(nn.Module):
    """One vector per sequence from a model's hidden states, for one of :data:`POOLING_MODES`.

    Args:
        mode (`str`): one of :data:`POOLING_MODES`.
        hidden_size (`int`): H, the size of each hidden state.
        num_hidden_states (`int`, *optional*): for ``weighted_layers``, how many hidden states the model returns
            (its layers + 1 for the embedding output).

    ``forward(last_hidden_state, attention_mask=None, hidden_states=None)`` returns (B, H), or (B, 2H) for
    ``mean_max``; ``hidden_states`` (all layers) is needed by ``weighted_layers`` only.
    """

    def __init__(self, mode: str, hidden_size: int, num_hidden_states: int | None = None):
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"pooling={mode!r} is not allowed; choose one of {', '.join(POOLING_MODES)}")
        self.mode = mode
        self.hidden_size = int(hidden_size)
        if mode == "weighted_layers":
            if not num_hidden_states:
                raise ValueError("weighted_layers pooling needs num_hidden_states (the model's layers + 1)")
            self.layer_weights = nn.Parameter(torch.zeros(int(num_hidden_states)))
        elif mode == "attention":
            self.attention = nn.Sequential(
                nn.Linear(hidden_size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1, bias=False)
            )

    @property
    def output_size(self) -> int:
        return 2 * self.hidden_size if self.mode == "mean_max" else self.hidden_size

    @property
    def needs_all_hidden_states(self) -> bool:
        return self.mode == "weighted_layers"

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, hidden_size={self.hidden_size}"

    def reset_parameters(self) -> None:
        """Layer weights at zero (a uniform average); the attention's linear layers are left to the model's init."""
        if self.mode == "weighted_layers":
            from transformers import initialization as init

            init.zeros_(self.layer_weights)

    def forward(self, last_hidden_state: torch.Tensor, attention_mask=None, hidden_states=None) -> torch.Tensor:
        h = last_hidden_state
        if self.mode == "cls":
            return h[:, 0]
        if self.mode == "mean":
            return masked_mean(h, attention_mask)
        if self.mode == "max":
            return masked_max(h, attention_mask)
        if self.mode == "mean_max":
            return torch.cat([masked_mean(h, attention_mask), masked_max(h, attention_mask)], dim=-1)
        if self.mode == "weighted_layers":
            if hidden_states is None:
                raise ValueError("weighted_layers pooling needs every layer's hidden states")
            return weighted_layer_mean(hidden_states, self.layer_weights, attention_mask)
        return attention_pool(h, self.attention(h).squeeze(-1), attention_mask)


# ---- transformers models --------------------------------------------------------------------------------------------


class _PoolingHooks:
    """The hooks on a model's base model that replace what its head reads by the pooled vector.

    A pre-hook asks for every hidden state when the mode needs them (and remembers whether the caller did); the
    forward hook pools and returns the base model's output with the pooled vector as its ``pooler_output``
    (``target="pooler"``) or as a length-1 ``last_hidden_state`` (``target="first_token"``). They hold only the
    ``pooling`` submodule and parameter names, so ``copy.deepcopy`` of the model copies them with it.
    """

    def __init__(self, base: nn.Module, pooling: Pooling, target: str):
        self.pooling = pooling
        self.target = target
        self._parameters = list(inspect.signature(base.forward).parameters)
        self._caller_wants_hidden_states = False
        self._handles = [
            base.register_forward_pre_hook(self._before, with_kwargs=True),
            base.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _argument(self, args: tuple, kwargs: dict, name: str):
        if name in kwargs:
            return kwargs[name]
        if name in self._parameters and self._parameters.index(name) < len(args):
            return args[self._parameters.index(name)]
        return None

    def _before(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self.pooling.needs_all_hidden_states:
            return None
        asked = self._argument(args, kwargs, "output_hidden_states")
        if asked is None:
            asked = getattr(getattr(module, "config", None), "output_hidden_states", False)
        self._caller_wants_hidden_states = bool(asked)
        return args, {**kwargs, "output_hidden_states": True}

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, outputs):
        mask = self._argument(args, kwargs, "attention_mask")
        is_tuple = isinstance(outputs, tuple)
        last = outputs[0] if is_tuple else outputs.last_hidden_state
        hidden_states = None
        if self.pooling.needs_all_hidden_states:
            if is_tuple:
                raise ValueError("weighted_layers pooling needs the base model to return a ModelOutput")
            hidden_states = outputs.hidden_states
        if mask is not None and mask.dim() != 2:
            raise ValueError(
                f"pooling needs a (batch, length) attention mask of 0 / 1 per position, got shape {tuple(mask.shape)}"
            )
        pooled = self.pooling(last, mask, hidden_states)
        if is_tuple:
            if self.target == "pooler":
                return (outputs[0], pooled, *outputs[2:])
            return (pooled.unsqueeze(1), *outputs[1:])
        changes = {"pooler_output": pooled} if self.target == "pooler" else {"last_hidden_state": pooled.unsqueeze(1)}
        if self.pooling.needs_all_hidden_states and not self._caller_wants_hidden_states:
            changes["hidden_states"] = None
        fields = {f.name: getattr(outputs, f.name) for f in dataclasses.fields(outputs)}
        return type(outputs)(**{**fields, **changes})

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _first_head_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The first ``nn.Linear`` of the head (outside the base model, in registration order): the layer that reads the
    pooled vector (BERT: ``classifier``; RoBERTa / ELECTRA: ``classifier.dense``; DeBERTa: ``pooler.dense``;
    DistilBERT: ``pre_classifier``)."""
    body = {id(m) for m in model.base_model.modules()}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in body:
            return name, module
    raise ValueError(f"{type(model).__name__} has no linear layer in its head for pooling to feed")


def _hidden_size(config) -> int:
    for name in ("hidden_size", "dim", "d_model"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ValueError(f"pooling: cannot read the hidden size of {type(config).__name__}")


def _num_hidden_states(config) -> int:
    for name in ("num_hidden_layers", "n_layers", "num_layers"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name) + 1
    raise ValueError(f"weighted_layers pooling: cannot read the number of layers of {type(config).__name__}")


def _pooling_target(model: nn.Module) -> str:
    """Where the pooled vector goes in ``model``: ``"pooler"`` or ``"first_token"``; raises if neither fits."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    is_seq_cls = any(cls.__name__.endswith("ForSequenceClassification") for cls in type(model).__mro__)
    if not is_seq_cls or getattr(model, "base_model", model) is model:
        raise ValueError(
            f"pooling applies to a *ForSequenceClassification encoder (its head reads one vector); got {name}"
        )
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False):
        raise ValueError(f"pooling applies to encoders; {name} is a decoder (its head reads the last token)")
    if isinstance(getattr(model.base_model, "pooler", None), nn.Module):
        return "pooler"
    if getattr(config, "model_type", None) in _FIRST_TOKEN_HEADS:
        return "first_token"
    raise ValueError(
        f"pooling does not know how {name} (model_type {getattr(config, 'model_type', None)!r}) reads its pooled "
        f"vector: supported are models whose base model has a pooler (BERT, ALBERT, ...) and the heads of "
        f"{', '.join(sorted(_FIRST_TOKEN_HEADS))}"
    )


def _attach(model: nn.Module, mode: str, init: bool) -> Pooling:
    """Build ``model.pooling`` and its hooks (shared by :func:`add_pooling` and :func:`pooled_model_class`)."""
    target = _pooling_target(model)
    config = model.config
    hidden = _hidden_size(config)
    pooling = Pooling(mode, hidden, _num_hidden_states(config) if mode == "weighted_layers" else None)
    param = next(model.parameters(), None)
    if param is not None:
        pooling.to(device=param.device, dtype=param.dtype)
    new_modules = [pooling, *pooling.modules()]
    if mode == "mean_max":
        name, linear = _first_head_linear(model)
        if linear.in_features != hidden:
            raise ValueError(
                f"pooling='mean_max' doubles the input of {type(model).__name__}.{name}, which reads "
                f"{linear.in_features} features, not the hidden size {hidden}"
            )
        wider = nn.Linear(2 * hidden, linear.out_features, bias=linear.bias is not None)
        wider.to(device=linear.weight.device, dtype=linear.weight.dtype)
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).add_module(child, wider)
        new_modules.append(wider)
    if target == "pooler":
        base = model.base_model
        base.pooler = None  # its output is replaced: unused weights would get no gradient (and stall DDP)
        if hasattr(base, "pooler_activation"):
            base.pooler_activation = None
    model.add_module("pooling", pooling)
    pooling._hooks = _PoolingHooks(model.base_model, pooling, target)
    if init:
        with torch.no_grad():
            for module in new_modules:
                model._init_weights(module)
            pooling.reset_parameters()
    config.pooling = mode
    return pooling


def add_pooling(model: nn.Module, mode: str) -> Pooling:
    """Make ``model`` (a ``*ForSequenceClassification`` encoder) classify from ``mode``'s pooled vector.

    The new weights (attention scorer, layer weights, the wider first head layer of ``mean_max``) are initialised
    with the model's own ``_init_weights`` from the global RNG; the layer weights start at zero. Sets
    ``config.pooling``, so :func:`load_pooled_model` loads a saved model back. A model that already has this mode
    is left as it is; another mode raises ``ValueError``.
    """
    existing = getattr(model, "pooling", None)
    if isinstance(existing, Pooling):
        if existing.mode != mode:
            raise ValueError(f"{type(model).__name__} already pools with {existing.mode!r}, not {mode!r}")
        return existing
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling={mode!r} is not allowed; choose one of {', '.join(POOLING_MODES)}")
    return _attach(model, mode, init=True)


_POOLED_CLASSES: dict[type, type] = {}


def pooled_model_class(model_class: type) -> type:
    """A subclass of ``model_class`` (a ``*ForSequenceClassification`` ``PreTrainedModel``) whose models pool with
    ``config.pooling`` from construction, so its ``from_pretrained`` loads the ``pooling.*`` weights (and the wider
    head of ``mean_max``) with the rest. Built once per class."""

    def attach(model, config):
        mode = getattr(config, "pooling", None)
        if mode not in POOLING_MODES:
            raise ValueError(
                f"config.pooling={mode!r}: a pooled model needs one of {', '.join(POOLING_MODES)} in its config"
            )
        _attach(model, mode, init=False)

    return model_class_with(model_class, "Pooling", attach, _POOLED_CLASSES, __name__, resets=Pooling)


def load_pooled_model(pretrained_model_name_or_path, **kwargs) -> nn.Module:
    """Load a sequence classification model saved with its pooling (``save_pretrained`` after :func:`add_pooling`,
    a TricksTrainer ``pooling=...`` output or checkpoint) in one call, strictly: a missing weight raises.

    ``kwargs`` go to ``from_pretrained`` (``dtype``, ``revision``, ``config``, ...). Raises ``ValueError`` if the
    folder's config has no ``pooling``.

    Example::

        from nlp_tricks import load_pooled_model
        model = load_pooled_model("outputs/classification")
        logits = model(input_ids=..., attention_mask=...).logits
    """
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, AutoConfig

    config_kwargs = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token", "cache_dir") if k in kwargs}
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(pretrained_model_name_or_path, **config_kwargs)
    if getattr(config, "pooling", None) is None:
        raise ValueError(
            f"{pretrained_model_name_or_path} was not saved with pooling (its config has no `pooling`); load it "
            "with AutoModelForSequenceClassification.from_pretrained"
        )
    if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        raise ValueError(
            f"{pretrained_model_name_or_path}: {type(config).__name__} has no sequence classification model in "
            "transformers"
        )
    model_class = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]
    model, info = pooled_model_class(model_class).from_pretrained(
        pretrained_model_name_or_path, config=config, output_loading_info=True, **kwargs
    )
    missing = sorted(info.get("missing_keys", ()))
    mismatched = info.get("mismatched_keys", ())
    if missing or mismatched:
        what = ", ".join(missing) or ", ".join(str(m[0] if isinstance(m, tuple) else m) for m in mismatched)
        raise ValueError(
            f"{pretrained_model_name_or_path}: weights of the pooled model are missing or mismatched: {what}"
        )
    return model
