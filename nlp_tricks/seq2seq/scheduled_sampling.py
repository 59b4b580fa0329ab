"""Scheduled sampling for transformer decoders: the teacher-forcing schedule and the two-pass decoder input mixing.

Bengio et al. 2015 (https://arxiv.org/abs/1506.03099) feed the model its own predictions instead of the gold previous
token with a probability that grows during training. Transformers decode all positions in parallel, so Mihaylova &
Martins 2019 (https://arxiv.org/abs/1906.07651) take the predictions from a first, teacher-forced decoder pass and
train on a second pass over the mixed input. Here the encoder runs once and both decoder passes reuse its output.

Plain functions and a small class: usable in any training loop; ``Seq2SeqTricksTrainer`` only wires them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from ..outputs import output_logits

__all__ = [
    "SCHEDULES",
    "MODES",
    "ScheduledSampler",
    "replacement_mask",
    "mix_decoder_inputs",
    "split_encoder_inputs",
    "scheduled_sampling_forward",
]

SCHEDULES = ("constant", "linear", "exponential", "inverse_sigmoid")
MODES = ("argmax", "sample", "soft")


def validate_schedule(schedule: str, k: float | None, min_ratio: float, names=("schedule", "k", "min_ratio")) -> None:
    """Raise ``ValueError`` naming the argument (``names`` lets a config report its own field names)."""
    s_name, k_name, min_name = names
    if schedule not in SCHEDULES:
        raise ValueError(f"{s_name}={schedule!r} is not allowed; choose one of {', '.join(map(repr, SCHEDULES))}")
    if k is None:
        raise ValueError(f"{k_name} is required for {s_name}={schedule!r}")
    allowed = {
        "constant": (0.0 <= k <= 1.0, "in [0, 1] (the teacher-forcing ratio itself)"),
        "linear": (k > 0, "> 0 (the number of steps to reach ratio 0)"),
        "exponential": (0.0 < k < 1.0, "in (0, 1) (ratio = k ** step)"),
        "inverse_sigmoid": (k >= 1.0, ">= 1 (ratio = k / (k + exp(step / k)))"),
    }
    ok, what = allowed[schedule]
    if not ok or not math.isfinite(k):
        raise ValueError(f"{k_name}={k} is not allowed for {s_name}={schedule!r}; it must be {what}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"{min_name}={min_ratio} is not allowed; it must be in [0, 1]")


def validate_mixing(mode: str, temperature: float, names=("mode", "temperature")) -> None:
    """Raise ``ValueError`` naming the argument for an invalid replacement mode or temperature."""
    mode_name, temperature_name = names
    if mode not in MODES:
        raise ValueError(f"{mode_name}={mode!r} is not allowed; choose one of {', '.join(map(repr, MODES))}")
    if temperature <= 0:
        raise ValueError(f"{temperature_name}={temperature} is not allowed; it must be > 0")


class ScheduledSampler:
    """The teacher-forcing ratio of scheduled sampling as a function of the optimizer step.

    Bengio et al. 2015, https://arxiv.org/abs/1506.03099 (Section 2.4). ``ratio(step)`` is the probability of feeding
    the gold previous token, floored at ``min_ratio``:

    - ``constant``: ``k`` (in [0, 1])
    - ``linear``: ``1 - step / k`` (``k > 0`` steps until it reaches 0)
    - ``exponential``: ``k ** step`` (``0 < k < 1``)
    - ``inverse_sigmoid``: ``k / (k + exp(step / k))`` (``k >= 1``)

    Args:
        schedule (`str`): one of ``"constant"``, ``"linear"``, ``"exponential"``, ``"inverse_sigmoid"``.
        k (`float`): the schedule's parameter, see above.
        min_ratio (`float`, defaults to 0.0): the floor of the ratio, in [0, 1].
    """

    def __init__(self, schedule: str, k: float, min_ratio: float = 0.0):
        validate_schedule(schedule, k, min_ratio)
        self.schedule = schedule
        self.k = float(k)
        self.min_ratio = float(min_ratio)

    def ratio(self, step: int) -> float:
        """The teacher-forcing probability at optimizer step ``step`` (0 for the first step)."""
        if step < 0:
            raise ValueError(f"step={step} is not allowed; it must be >= 0")
        k = self.k
        if self.schedule == "constant":
            value = k
        elif self.schedule == "linear":
            value = 1.0 - step / k
        elif self.schedule == "exponential":
            value = k**step
        else:
            # exp overflows past ~709; the ratio is 0 there anyway.
            value = k / (k + math.exp(step / k)) if step / k < 700 else 0.0
        return min(1.0, max(self.min_ratio, value))

    def __repr__(self) -> str:
        return f"ScheduledSampler(schedule={self.schedule!r}, k={self.k}, min_ratio={self.min_ratio})"


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
    if ratio == 1.0:
        return torch.zeros_like(allowed)
    if ratio == 0.0:
        return allowed
    draw = torch.rand(
        labels.shape, generator=generator, device=labels.device if generator is None else generator.device
    )
    return allowed & draw.to(labels.device).ge(ratio)


def _embedding_matrix(embedding: nn.Module, vocab_size: int, device) -> torch.Tensor:
    """The ``(V, d)`` matrix whose row ``i`` is what ``embedding`` returns for token ``i`` (any scaling included)."""
    if type(embedding) is nn.Embedding:
        return embedding.weight
    # Scaled embeddings (BART, mBART, M2M100 with scale_embedding) multiply inside forward: ask the module itself.
    return embedding(torch.arange(vocab_size, device=device))


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
    # Only the predictions for positions 0..L-2 are ever fed back.
    previous = logits[:, :-1].detach()
    if mode == "soft":
        if embedding is None:
            raise ValueError("mode='soft' needs the decoder's input embedding module (embedding=...)")
        gold = embedding(decoder_input_ids)
        # Only the replaced positions (never position 0) need the (positions x vocab) @ (vocab x d) product.
        replace = mask[:, 1:]
        probs = torch.softmax(previous[replace].float() / temperature, dim=-1)
        matrix = _embedding_matrix(embedding, logits.shape[-1], logits.device)
        soft = (probs.to(matrix.dtype) @ matrix).to(gold.dtype)
        tail = gold[:, 1:].masked_scatter(replace.unsqueeze(-1), soft)
        return {"decoder_inputs_embeds": torch.cat([gold[:, :1], tail], dim=1)}
    if mode == "argmax":
        predicted = previous.argmax(dim=-1)
    else:
        probs = torch.softmax(previous.float() / temperature, dim=-1)
        predicted = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
        predicted = predicted.reshape(previous.shape[:2])
    shifted = torch.cat([decoder_input_ids[:, :1], predicted.to(decoder_input_ids.dtype)], dim=1)
    return {"decoder_input_ids": torch.where(mask, shifted, decoder_input_ids)}


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


def scheduled_sampling_forward(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    ratio: float,
    mode: str = "argmax",
    temperature: float = 1.0,
    forward: Callable | None = None,
    generator: torch.Generator | None = None,
):
    """One scheduled-sampling forward: encoder once, decoder pass 1 teacher-forced under ``no_grad``, mix, pass 2.

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

    Returns:
        The pass-2 model outputs (``logits`` for the loss on ``labels``).
    """
    forward = model if forward is None else forward
    encoder_kwargs, decoder_kwargs = split_encoder_inputs(inputs)
    if "encoder_outputs" in inputs:
        encoder_outputs = inputs["encoder_outputs"]
    else:
        encoder_outputs = model.get_encoder()(**encoder_kwargs, return_dict=True)
    if isinstance(encoder_outputs, tuple):
        encoder_outputs = BaseModelOutput(*encoder_outputs)
    if "decoder_input_ids" not in decoder_kwargs:
        if "decoder_inputs_embeds" in decoder_kwargs:
            return forward(encoder_outputs=encoder_outputs, **decoder_kwargs)
        raise ValueError("scheduled sampling needs decoder_input_ids (or decoder_inputs_embeds) in the inputs")
    decoder_input_ids = decoder_kwargs.pop("decoder_input_ids")
    if decoder_input_ids.shape != labels.shape:
        raise ValueError(
            f"decoder_input_ids {tuple(decoder_input_ids.shape)} and labels {tuple(labels.shape)} must have the "
            "same shape (position t's input is the token before label t)"
        )

    mask = replacement_mask(labels, ratio, generator=generator)
    if ratio < 1.0:
        with torch.no_grad():
            # Detached view: pass 1 must not keep activations, and BaseModelOutput fields are read by position.
            detached = BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state.detach())
            logits = output_logits(
                model(encoder_outputs=detached, decoder_input_ids=decoder_input_ids, **decoder_kwargs)
            )
    else:
        # Nothing will be replaced: skip pass 1 and feed the gold input as it is.
        logits = None
    if logits is None:
        mixed = {"decoder_input_ids": decoder_input_ids}
    else:
        embedding = _decoder_input_embeddings(model) if mode == "soft" else None
        mixed = mix_decoder_inputs(
            decoder_input_ids, logits, mask, mode=mode, temperature=temperature, embedding=embedding,
            generator=generator,
        )  # fmt: skip
    return forward(encoder_outputs=encoder_outputs, **mixed, **decoder_kwargs)


def _decoder_input_embeddings(model: nn.Module) -> nn.Module:
    """The module that turns decoder input ids into the embeddings ``decoder_inputs_embeds`` stands in for."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        decoder = None
    embedding = decoder.get_input_embeddings() if decoder is not None else None
    return embedding if embedding is not None else model.get_input_embeddings()
