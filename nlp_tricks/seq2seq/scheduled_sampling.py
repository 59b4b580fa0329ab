"""Scheduled sampling for encoder-decoder models: the decoder input mixing and the two-pass decoder forward.

Bengio et al. 2015 (https://arxiv.org/abs/1506.03099) feed the model its own predictions instead of the gold previous
token with a probability that grows during training. Transformers decode all positions in parallel, so Mihaylova &
Martins 2019 (https://arxiv.org/abs/1906.07651) take the predictions from a first, teacher-forced decoder pass and
train on a second pass over the mixed input. Here the encoder runs once and both decoder passes reuse its output.

The schedule (:class:`ScheduledSampler`), the draw and the mixing shared with decoder-only models live in
:mod:`nlp_tricks.scheduled_sampling` and are importable from here too. Plain functions: usable in any training loop;
``Seq2SeqTricksTrainer`` only wires them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from ..functional.outputs import output_logits
from ..functional.scheduled_sampling import (
    MODES,
    SCHEDULES,
    ScheduledSampler,
    ScheduledSamplingDraw,
    TwoPassModel,
    apply_draw,
    draw_predictions,
    draw_replacements,
    mix_inputs,
    two_pass_forward,
    validate_mixing,
    validate_schedule,
)

__all__ = [
    "SCHEDULES",
    "MODES",
    "ScheduledSampler",
    "ScheduledSamplingDraw",
    "validate_schedule",
    "validate_mixing",
    "replacement_mask",
    "mix_decoder_inputs",
    "split_encoder_inputs",
    "scheduled_sampling_forward",
]


def replacement_mask(
    labels: torch.Tensor, ratio: float, generator: torch.Generator | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Where the decoder input takes the model's prediction instead of the gold token: a ``(B, L)`` bool mask.

    Position ``t`` is replaced with probability ``1 - ratio``, independently per token. Never replaced: position 0
    (the decoder start token) and positions whose label, or whose previous position's label, is ``ignore_index``
    (padding, or a prompt the loss skips: the model's prediction there is not trained, so it is not fed back).
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio={ratio} is not allowed; it must be in [0, 1]")
    labelled = labels.ne(ignore_index)
    allowed = torch.zeros_like(labelled)
    allowed[:, 1:] = labelled[:, 1:] & labelled[:, :-1]
    return draw_replacements(allowed, ratio, generator)


def mix_decoder_inputs(
    decoder_input_ids: torch.Tensor,
    logits: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "argmax",
    temperature: float = 1.0,
    embedding: nn.Module | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """The pass-2 decoder input: gold ``decoder_input_ids`` where ``mask`` is False, the pass-1 prediction elsewhere.

    Mihaylova & Martins 2019, https://arxiv.org/abs/1906.07651. The prediction fed at position ``t`` is the one made at
    position ``t - 1`` (``logits[:, t - 1]``), i.e. the model's guess for the gold token it replaces.

    Args:
        decoder_input_ids (`torch.LongTensor` of shape `(B, L)`): the teacher-forced decoder input.
        logits (`torch.Tensor` of shape `(B, L, V)`): pass-1 logits (no gradient is taken through them).
        mask (`torch.BoolTensor` of shape `(B, L)`): where to replace, see :func:`replacement_mask`.
        mode (`str`, defaults to ``"argmax"``): ``"argmax"`` (greedy prediction), ``"sample"`` (a sample from
            ``softmax(logits / temperature)``) or ``"soft"`` (the expected embedding
            ``softmax(logits / temperature) @ E``, fed as ``decoder_inputs_embeds``).
        temperature (`float`, defaults to 1.0): softmax temperature of ``"sample"`` and ``"soft"``.
        embedding (`nn.Module`, *optional*): the decoder's input embedding module; required for ``"soft"``.
        generator (`torch.Generator`, *optional*): random source of ``"sample"``.

    Returns:
        ``{"decoder_input_ids": ...}`` for ``"argmax"`` / ``"sample"``, ``{"decoder_inputs_embeds": ...}`` for
        ``"soft"``.
    """
    validate_mixing(mode, temperature)
    if logits.shape[:2] != decoder_input_ids.shape or mask.shape != decoder_input_ids.shape:
        raise ValueError(
            f"decoder_input_ids {tuple(decoder_input_ids.shape)}, logits {tuple(logits.shape)} and mask "
            f"{tuple(mask.shape)} must agree on (batch, length)"
        )
    if mode == "soft" and embedding is None:
        raise ValueError("mode='soft' needs the decoder's input embedding module (embedding=...)")
    mixed = mix_inputs(
        decoder_input_ids, logits, mask, mode=mode, temperature=temperature, embedding=embedding, generator=generator
    )
    return {f"decoder_{key}": value for key, value in mixed.items()}


# Keys of a seq2seq batch that belong to the decoder call (everything else feeds only the encoder).
_DECODER_ONLY = ("past_key_values", "use_cache", "cache", "cache_position")


def split_encoder_inputs(inputs: dict) -> tuple[dict, dict]:
    """Split a batch (without labels) into the encoder's keyword arguments and those the decoder passes also need.

    The encoder gets every key not starting with ``decoder_``; the decoder passes get the ``decoder_*`` keys and the
    source ``attention_mask`` (for cross-attention).
    """
    encoder_kwargs, decoder_kwargs = {}, {}
    for key, value in inputs.items():
        if key.startswith("decoder_") or key in _DECODER_ONLY:
            decoder_kwargs[key] = value
        elif key != "encoder_outputs":
            encoder_kwargs[key] = value
    if "attention_mask" in inputs:
        decoder_kwargs["attention_mask"] = inputs["attention_mask"]
    return encoder_kwargs, decoder_kwargs


def _pass2_inputs(model: nn.Module, inputs: dict) -> dict:
    """Pass 2's keyword arguments: the encoder's outputs (run here once, unless the batch brings them) and the
    decoder's inputs."""
    encoder_kwargs, decoder_kwargs = split_encoder_inputs(inputs)
    if "encoder_outputs" in inputs:
        encoder_outputs = inputs["encoder_outputs"]
    else:
        encoder_outputs = model.get_encoder()(**encoder_kwargs, return_dict=True)
    if isinstance(encoder_outputs, tuple):
        encoder_outputs = BaseModelOutput(*encoder_outputs)
    return {"encoder_outputs": encoder_outputs, **decoder_kwargs}


def _decoder_draw(model, pass1: dict, labels, ratio, mode, temperature, generator) -> ScheduledSamplingDraw:
    """Which decoder inputs pass 2 replaces, and by what: decoder pass 1 teacher-forced under ``no_grad`` on the
    encoder outputs (detached: pass 1 keeps no activations), then the draw."""
    mask = replacement_mask(labels, ratio, generator=generator)
    # A new BaseModelOutput: its fields are read by position.
    detached = BaseModelOutput(last_hidden_state=pass1["encoder_outputs"].last_hidden_state.detach())
    with torch.no_grad():
        logits = output_logits(model(**{**pass1, "encoder_outputs": detached}))
        return draw_predictions(logits, mask, mode=mode, temperature=temperature, generator=generator)


def _mixed(model: nn.Module, decoder_input_ids: torch.Tensor, draw: ScheduledSamplingDraw | None) -> dict:
    """Pass 2's decoder input: the gold one when nothing is replaced (ratio 1: pass 1 was skipped), else the draw
    applied (ids, or embeddings for ``"soft"``)."""
    if draw is None:
        return {"decoder_input_ids": decoder_input_ids}
    embedding = _decoder_input_embeddings(model) if draw.mode == "soft" else None
    return {f"decoder_{k}": v for k, v in apply_draw(decoder_input_ids, draw, embedding=embedding).items()}


def _decoder_input_embeddings(model: nn.Module) -> nn.Module:
    """The module that turns decoder input ids into the embeddings ``decoder_inputs_embeds`` stands in for."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        decoder = None
    embedding = decoder.get_input_embeddings() if decoder is not None else None
    return embedding if embedding is not None else model.get_input_embeddings()


_DOC = """\
One scheduled-sampling forward: encoder once, decoder pass 1 teacher-forced under ``no_grad``, mix, pass 2.

Mihaylova & Martins 2019, https://arxiv.org/abs/1906.07651. Pass 2 reuses the encoder outputs with their graph, so
a backward on its logits trains the encoder as in plain training. With ``ratio=1`` the pass-2 input is the gold
input and the outputs equal a plain teacher-forced forward.

Args:
    model (`PreTrainedModel`): an encoder-decoder model (``get_encoder()``, ``encoder_outputs=``), unwrapped.
    inputs (`dict`): the batch without ``labels``; must hold ``decoder_input_ids`` (build them with
        ``model.prepare_decoder_input_ids_from_labels``) unless it holds ``decoder_inputs_embeds``, which are
        passed through unmixed.
    labels (`torch.LongTensor` of shape `(B, L)`): positions labelled -100 are never replaced.
    ratio (`float`): the teacher-forcing probability, e.g. ``ScheduledSampler.ratio(step)``.
    mode, temperature: see :func:`mix_decoder_inputs`.
    forward (`Callable`, *optional*): what runs pass 2 (default ``model``); a DDP / accelerate wrapper of
        ``model`` goes here so that gradient synchronisation sees the forward.
    generator (`torch.Generator`, *optional*): random source of the replacement draws and of ``"sample"``.
    draw (`ScheduledSamplingDraw`, *optional*): reuse this draw (from an earlier call on the same batch with
        ``return_draw=True``) instead of running decoder pass 1 and drawing again; the encoder still runs.
    return_draw (`bool`, defaults to False): also return the draw used (``None`` when nothing was mixed).

Returns:
    The pass-2 model outputs (``logits`` for the loss on ``labels``), or ``(outputs, draw)`` with ``return_draw``.
"""

scheduled_sampling_forward = two_pass_forward(
    TwoPassModel(
        ids="decoder_input_ids",
        why_same_shape="position t's input is the token before label t",
        pass2_inputs=_pass2_inputs,
        draw=_decoder_draw,
        mixed=_mixed,
    ),
    __name__,
    "scheduled_sampling_forward",
    _DOC,
)
