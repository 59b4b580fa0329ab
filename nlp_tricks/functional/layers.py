"""Whole layers of a transformers model: re-initialise the top ones, freeze the bottom ones.

Layers are found as :mod:`nlp_tricks.param_groups` finds them for layer-wise decay: numbered blocks of a stack
(BERT ``encoder.layer.N``, Llama ``model.layers.N``, GPT-2 ``transformer.h.N``, ...) and the embeddings below them.
Encoder-decoder models are refused (which layers are "top" or "bottom" across two stacks is a choice to make
explicitly); PEFT models are read through the transformers model they wrap.

- :func:`reinit_top_layers`: Zhang et al., ICLR 2021, "Revisiting Few-sample BERT Fine-tuning"
  (https://arxiv.org/abs/2006.05987): the top K layers (and the pooler) start again from the model's own
  initialisation, ``model._init_weights`` applied to each of their submodules; every other weight is untouched.
- :func:`freeze_bottom_layers`: the embeddings and the bottom N layers stop training (``requires_grad=False``);
  it returns the parameters it froze, for :func:`unfreeze` to give back, and only ever touches parameters that were
  trainable (a PEFT model's frozen base stays frozen).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from .models import unwrap_model

__all__ = ["model_layers", "reinit_top_layers", "freeze_bottom_layers", "unfreeze", "seeded"]


# A numbered block inside a stack: "encoder.layer.3.", "decoder.layers.0.", "encoder.block.1.", "transformer.h.2.".
_LAYER_RE = re.compile(r"^(?P<stack>(?:.*?\.)?(?:layer|layers|block|blocks|h))\.(?P<index>\d+)(?:\.|$)")
# Embedding parameters sit below layer 0: word / position / token-type embeddings, BART's layernorm_embedding, T5's
# `shared`, ELECTRA's embeddings_project.
_EMBEDDING_RE = re.compile(r"(?:^|\.)(?:[a-z_]*embed[a-z_]*|shared|wte|wpe)(?:\.|$)")


def layer_ids(base_model: nn.Module) -> tuple[dict[str, int], int]:
    """Map each parameter name of ``base_model`` to its layer id, and return the number of layers ``L``.

    Id 0 is the embeddings, ``1 + i`` the i-th layer counted across stacks (encoder stacks first, then decoder
    stacks), ``L + 1`` everything else. Returns ``L = 0`` when no layer stack is found.
    """
    names = [n for n, _ in base_model.named_parameters()]
    stacks: dict[str, int] = {}
    for name in names:
        match = _LAYER_RE.match(name)
        if match:
            stack = match.group("stack")
            stacks[stack] = max(stacks.get(stack, 0), int(match.group("index")) + 1)
    # Encoder stacks before decoder stacks, otherwise in order of appearance.
    ordered = sorted(stacks, key=lambda s: ("decoder" in s.split("."), list(stacks).index(s)))
    offsets, total = {}, 0
    for stack in ordered:
        offsets[stack] = total
        total += stacks[stack]
    ids = {}
    for name in names:
        match = _LAYER_RE.match(name)
        if match:
            ids[name] = 1 + offsets[match.group("stack")] + int(match.group("index"))
        elif _EMBEDDING_RE.search(name):
            ids[name] = 0
        else:
            ids[name] = total + 1
    return ids, total


def _body(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformers model inside ``model`` (PEFT unwrapped) and its base model."""
    inner = unwrap_model(model, peft=True)
    config = getattr(inner, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(inner).__name__} is an encoder-decoder model: its top and bottom layers are ambiguous across the "
            "two stacks; re-initialise or freeze its modules yourself"
        )
    return inner, getattr(inner, "base_model", inner)


def model_layers(model: nn.Module) -> tuple[dict[str, int], list[nn.Module], nn.Module]:
    """``(ids, layers, base)``: each parameter name of the base model mapped to its layer id (0 the embeddings,
    ``1 + i`` layer i, ``L + 1`` the rest, as :func:`~nlp_tricks.param_groups.layer_ids`), the layer modules from
    bottom to top, and the base model."""
    _, base = _body(model)
    ids, num_layers = layer_ids(base)
    layers: list[nn.Module | None] = [None] * num_layers
    for name, layer in ids.items():
        if 1 <= layer <= num_layers and layers[layer - 1] is None:
            match = _LAYER_RE.match(name)
            layers[layer - 1] = base.get_submodule(f"{match.group('stack')}.{match.group('index')}")
    return ids, layers, base


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """The global RNG seeded with ``seed`` inside, and restored as it was afterwards (so drawing here does not move a
    seeded run's random stream)."""
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def reinit_top_layers(model: nn.Module, k: int, *, pooler: bool = True) -> list[str]:
    """Re-initialise the top ``k`` layers of ``model`` (and, with ``pooler``, the base model's pooler) with the
    model's own ``_init_weights``, drawing from the global RNG (wrap the call in :func:`seeded` to reproduce it).

    transformers marks loaded weights as initialised (``_is_hf_initialized``) and its init functions skip such
    tensors; the marks are lifted for these modules only. Returns the re-initialised modules' names.

    Raises ``ValueError`` when ``k`` is not in ``[1, L]`` or the model has no ``_init_weights`` / layer stack.
    """
    inner, _ = _body(model)
    ids, layers, base = model_layers(model)
    if not layers:
        raise ValueError(f"reinit_layers needs numbered layer stacks, but none were found in {type(inner).__name__}")
    if not 1 <= k <= len(layers):
        raise ValueError(f"reinit_layers={k} is not allowed for {type(inner).__name__}: it has {len(layers)} layers")
    init_weights = getattr(inner, "_init_weights", None)
    if not callable(init_weights):
        raise ValueError(f"reinit_layers needs a transformers model with _init_weights; got {type(inner).__name__}")
    targets = list(layers[len(layers) - k :])
    if pooler and isinstance(getattr(base, "pooler", None), nn.Module):
        targets.append(base.pooler)
    names = {id(m): n for n, m in inner.named_modules()}
    with torch.no_grad():
        for target in targets:
            for module in target.modules():
                marked = [
                    obj
                    for obj in (*module.parameters(recurse=False), *module.buffers(recurse=False), module)
                    if getattr(obj, "_is_hf_initialized", False)
                ]
                for obj in marked:
                    obj._is_hf_initialized = False
                try:
                    init_weights(module)
                finally:
                    for obj in marked:
                        obj._is_hf_initialized = True
    return [names[id(target)] for target in targets]


def freeze_bottom_layers(model: nn.Module, n: int, *, embeddings: bool = True) -> list[nn.Parameter]:
    """Set ``requires_grad=False`` on the embeddings (with ``embeddings``) and the bottom ``n`` layers' parameters
    that train now; return them (each tensor once) for :func:`unfreeze`.

    A tied output projection is the embedding matrix itself, so it freezes with the embeddings. Raises
    ``ValueError`` when ``n`` is larger than the model's layer count (``freeze_layers`` names it).
    """
    inner, _ = _body(model)
    ids, layers, base = model_layers(model)
    if not 0 <= n <= len(layers):
        raise ValueError(f"freeze_layers={n} is not allowed for {type(inner).__name__}: it has {len(layers)} layers")
    if embeddings and not any(layer == 0 for layer in ids.values()):
        raise ValueError(f"freezing the embeddings: none were found in {type(inner).__name__}")
    lowest = 0 if embeddings else 1
    frozen, seen = [], set()
    for name, param in base.named_parameters():
        if lowest <= ids[name] <= n and param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            param.requires_grad_(False)
            frozen.append(param)
    return frozen


def unfreeze(params) -> None:
    """Make ``params`` trainable again."""
    for param in params:
        param.requires_grad_(True)
