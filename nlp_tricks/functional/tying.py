"""Weight tying between the encoder and the decoder of an encoder-decoder model.

transformers 5 dropped ``EncoderDecoderConfig.tie_encoder_decoder``; :func:`tie_encoder_decoder` brings it back for
any encoder-decoder (BART, T5, Marian, ``EncoderDecoderModel``), declares the ties so ``save_pretrained`` accepts the
shared tensors, and records the scope in ``model.config`` so a reloaded model can be tied again with one call.
"""

from __future__ import annotations

from collections import Counter

from torch import nn
from transformers import PreTrainedModel

__all__ = ["TIE_SCOPES", "TIE_SCOPE_CONFIG_KEY", "tie_encoder_decoder", "count_unique_parameters"]

TIE_SCOPES = ("none", "embeddings", "all")
# Saved with the config, so `tie_encoder_decoder(model)` knows what to re-tie after `from_pretrained`.
TIE_SCOPE_CONFIG_KEY = "nlp_tricks_tie_scope"


def count_unique_parameters(model: nn.Module) -> int:
    """The number of trainable numbers in ``model``, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def _stacks(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The encoder and the decoder stack of ``model`` (for BERT2BERT: the BertModel inside the BertLMHeadModel)."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError(f"tie_encoder_decoder needs an encoder-decoder model, got {type(model).__name__}")
    get_encoder = getattr(model, "get_encoder", None)
    get_decoder = getattr(model, "get_decoder", None)
    encoder = get_encoder() if get_encoder is not None else None
    decoder = get_decoder() if get_decoder is not None else None
    if encoder is None or decoder is None or encoder is model or decoder is model or encoder is decoder:
        raise ValueError(
            f"tie_encoder_decoder needs an encoder-decoder model (get_encoder() and get_decoder()), got "
            f"{type(model).__name__}"
        )

    def base(module):
        return module.base_model if isinstance(module, PreTrainedModel) else module

    return base(encoder), base(decoder)


def _parameter_slots(root: nn.Module, prefix: str = "", out: dict | None = None) -> dict[str, tuple[nn.Module, str]]:
    """``{canonical name: (owner module, attribute)}`` for every parameter under ``root``.

    Canonical names are the usual dotted names except inside module lists that mix layer types (T5's
    ``block.i.layer``: [self-attention, feed-forward] in the encoder, [self-attention, cross-attention, feed-forward]
    in the decoder): there a child is named by its type and rank (``T5LayerFF#0``), so the encoder's feed-forward
    lines up with the decoder's instead of with its cross-attention.
    """
    out = {} if out is None else out
    for name, param in root._parameters.items():
        if param is not None:
            out[prefix + name] = (root, name)
    children = [(name, child) for name, child in root._modules.items() if child is not None]
    if isinstance(root, (nn.ModuleList, nn.Sequential)) and len({type(child) for _, child in children}) > 1:
        seen = Counter()
        keys = []
        for _, child in children:
            keys.append(f"{type(child).__name__}#{seen[type(child)]}")
            seen[type(child)] += 1
    else:
        keys = [name for name, _ in children]
    for key, (_, child) in zip(keys, children):
        _parameter_slots(child, f"{prefix}{key}.", out)
    return out


def tie_encoder_decoder(model: PreTrainedModel, scope: str | None = None) -> dict[str, str]:
    """Share weights between the encoder and the decoder of ``model``, in place.

    Press & Wolf 2017, https://arxiv.org/abs/1608.05859 (one embedding matrix for input and output); Rothe et al.
    2020, https://arxiv.org/abs/1907.12461 (BERT2BERT with encoder and decoder sharing all their weights).

    - ``"embeddings"``: one matrix (the encoder's input embedding) for the encoder input embeddings, the decoder input
      embeddings and the output projection (``get_output_embeddings()``).
    - ``"all"``: the embeddings as above, and every decoder parameter whose name and shape match an encoder parameter
      becomes that parameter (self-attention, feed-forward, norms, position embeddings; T5's feed-forward sublayer is
      matched by type, see below). Parameters only the decoder has (cross-attention) stay its own.
    - ``"none"``: nothing.

    The tied parameters are one ``nn.Parameter`` object, so optimizers, ``model.to()``, DDP and accelerate keep them
    shared. The ties are declared in ``model._tied_weights_keys`` (``save_pretrained`` then saves each shared tensor
    once, under the encoder's name) and the scope is recorded as ``model.config.nlp_tricks_tie_scope``. After
    ``from_pretrained`` the decoder's copies are missing from the checkpoint (transformers reports them as missing
    keys): call ``tie_encoder_decoder(model)`` to tie them again to the loaded encoder weights.

    Args:
        model (`PreTrainedModel`): an encoder-decoder model (``get_encoder()`` / ``get_decoder()``).
        scope (`str`, *optional*): ``"none"``, ``"embeddings"`` or ``"all"``. ``None`` re-applies the scope recorded
            in ``model.config``.

    Returns:
        `dict[str, str]`: ``{decoder parameter name: encoder parameter name}`` of every tie now in place (names as in
        ``model.named_parameters()``).
    """
    scope = _scope(model, scope)
    if scope == "none":
        return {}
    encoder, decoder = _stacks(model)
    ties = _Ties(model)
    # The model's own input embedding (BART's and T5's `shared`) is the tensor transformers keeps when it saves tied
    # embeddings, so it is the source: after `from_pretrained` it holds the trained values.
    model_input = model.get_input_embeddings()
    encoder_input = encoder.get_input_embeddings()
    source_module = model_input if model_input is not None else encoder_input
    for module in (encoder_input, decoder.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None and module is not source_module:
            ties.tie(module, "weight", source_module.weight)
    if scope == "all":
        encoder_slots = _parameter_slots(encoder)
        for key, (module, attr) in _parameter_slots(decoder).items():
            if key not in encoder_slots:
                continue
            enc_param = getattr(*encoder_slots[key])
            if getattr(module, attr).shape == enc_param.shape:
                ties.tie(module, attr, enc_param)
    # transformers 5 saves a shared tensor only if its aliases are declared (`remove_tied_weights_from_state_dict`);
    # the instance attribute extends the class's declaration for this model only.
    model._tied_weights_keys = {**dict(getattr(model, "_tied_weights_keys", None) or {}), **ties.made}
    if isinstance(getattr(model, "all_tied_weights_keys", None), dict):
        model.all_tied_weights_keys.update(ties.made)
    setattr(model.config, TIE_SCOPE_CONFIG_KEY, scope)
    return ties.made


def _scope(model: PreTrainedModel, scope: str | None) -> str:
    """``scope``, or the one recorded in ``model.config`` for ``None``; an unknown one is refused."""
    if scope is None:
        scope = getattr(model.config, TIE_SCOPE_CONFIG_KEY, None)
        if scope is None:
            raise ValueError(
                f"scope=None re-applies the scope recorded in model.config.{TIE_SCOPE_CONFIG_KEY}, but this "
                f"{type(model).__name__} has none; pass scope='embeddings' or scope='all'"
            )
    if scope not in TIE_SCOPES:
        raise ValueError(f"scope={scope!r} is not allowed; choose one of {', '.join(map(repr, TIE_SCOPES))}")
    return scope


class _Ties:
    """The ties made in one model, ``{decoder parameter name: encoder parameter name}`` (names as the model had them
    before any tie)."""

    def __init__(self, model: nn.Module):
        self.module_names = {id(module): name for name, module in model.named_modules()}
        self.param_names = {id(param): name for name, param in model.named_parameters()}
        self.made: dict[str, str] = {}

    def tie(self, module: nn.Module, attr: str, source: nn.Parameter) -> None:
        """Make ``module.<attr>`` the parameter ``source``."""
        prefix = self.module_names[id(module)]
        name = f"{prefix}.{attr}" if prefix else attr
        target = getattr(module, attr)
        if target.shape != source.shape:
            raise ValueError(
                f"cannot tie {name} {tuple(target.shape)} to {self.param_names[id(source)]} "
                f"{tuple(source.shape)}: shapes differ (e.g. encoder and decoder vocabularies differ)"
            )
        setattr(module, attr, source)
        self.made[name] = self.param_names[id(source)]
