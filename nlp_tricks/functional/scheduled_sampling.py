"""Scheduled sampling: the teacher-forcing schedule, the two-pass input mixing, and its decoder-only (causal LM) form.

Bengio et al. 2015 (https://arxiv.org/abs/1506.03099) feed the model its own predictions instead of the gold previous
token with a probability that grows during training. Transformers predict all positions in parallel, so Mihaylova &
Martins 2019 (https://arxiv.org/abs/1906.07651) take the predictions from a first, teacher-forced pass and train on a
second pass over the mixed input. This module holds what encoder-decoder and decoder-only models share (the schedule,
one draw of replacements, mixing it into ids or embeddings) and the causal-LM passes; the encoder-decoder passes
(encoder once, two decoder passes) are in :mod:`nlp_tricks.seq2seq.scheduled_sampling`.

Plain functions and small classes: usable in any training loop; ``TricksTrainer`` / ``Seq2SeqTricksTrainer`` only
wire them.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .models import unwrap_model
from .outputs import output_logits

__all__ = [
    "SCHEDULES",
    "MODES",
    "validate_schedule",
    "validate_mixing",
    "ScheduledSampler",
    "ScheduledSamplingDraw",
    "draw_predictions",
    "apply_draw",
    "mix_inputs",
    "causal_replacement_mask",
    "causal_scheduled_sampling_forward",
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


# ---- One draw and the mixing --------------------------------------------------------------------------------------


@dataclass
class ScheduledSamplingDraw:
    """One batch's scheduled-sampling draw: where the model's prediction replaces the gold token, and which one.

    Kept apart from the mixing so that several forwards over one micro-batch (the clean and the adversarial passes of
    FGM / PGD) train on the same input: the draw is made once, :func:`apply_draw` is called per forward.

    Attributes:
        mask (`torch.BoolTensor` of shape `(B, L)`): where the input takes the prediction (position 0 never does).
        mode (`str`): ``"argmax"``, ``"sample"`` or ``"soft"``.
        predictions (`torch.Tensor`): one entry per replaced position, in row-major order (``mask[:, 1:]``): the
            token ids fed there (``"argmax"`` / ``"sample"``, shape ``(n,)``) or the float32 probabilities whose
            expected embedding is fed (``"soft"``, shape ``(n, V)``).
    """

    mask: torch.Tensor
    mode: str
    predictions: torch.Tensor


def _embedding_matrix(embedding: nn.Module, vocab_size: int, device) -> torch.Tensor:
    """The ``(V, d)`` matrix whose row ``i`` is what ``embedding`` returns for token ``i`` (any scaling included)."""
    if type(embedding) is nn.Embedding:
        return embedding.weight
    # Scaled embeddings (BART, mBART, M2M100 with scale_embedding) multiply inside forward: ask the module itself.
    return embedding(torch.arange(vocab_size, device=device))


def draw_predictions(
    logits: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "argmax",
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> ScheduledSamplingDraw:
    """The predictions a first, teacher-forced pass makes for the positions ``mask`` replaces.

    The prediction fed at position ``t`` is the one made at position ``t - 1`` (``logits[:, t - 1]``): the model's
    guess for the token at ``t``, i.e. for the gold token it replaces.

    Args:
        logits (`torch.Tensor`): pass-1 logits (detached here), of shape `(B, L, V)`; or `(n, V)`: only the rows
            ``logits[:, t - 1]`` of the ``n`` replaced positions ``t``, in row-major order (what a model returns for
            ``logits_to_keep=`` those positions).
        mask (`torch.BoolTensor` of shape `(B, L)`): where to replace.
        mode (`str`, defaults to ``"argmax"``): ``"argmax"`` (greedy prediction), ``"sample"`` (a sample from
            ``softmax(logits / temperature)``) or ``"soft"`` (the probabilities ``softmax(logits / temperature)``,
            mixed in as the expected embedding).
        temperature (`float`, defaults to 1.0): softmax temperature of ``"sample"`` and ``"soft"``.
        generator (`torch.Generator`, *optional*): random source of ``"sample"``.
    """
    validate_mixing(mode, temperature)
    replace = mask[:, 1:]
    if logits.dim() == 2:
        if logits.shape[0] != int(replace.sum()):
            raise ValueError(
                f"logits {tuple(logits.shape)} hold one row per replaced position, but mask replaces "
                f"{int(replace.sum())}"
            )
        rows = logits.detach()
    elif logits.shape[:2] != mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and mask {tuple(mask.shape)} must agree on (batch, length)")
    elif mode == "argmax":
        # One read of the logits; gathering the replaced rows first would copy them.
        return ScheduledSamplingDraw(mask, mode, logits[:, :-1].detach().argmax(dim=-1)[replace])
    else:
        # The prediction fed at t is made at t - 1: positions 0..L-2, and only where the mask replaces.
        rows = logits[:, :-1].detach()[replace]
    if mode == "argmax":
        return ScheduledSamplingDraw(mask, mode, rows.argmax(dim=-1))
    # Softmax (and sampling) over the replaced rows only: at ratio r, a fraction 1 - r of the labelled positions.
    probs = torch.softmax(rows.float() / temperature, dim=-1)
    if mode == "soft":
        return ScheduledSamplingDraw(mask, mode, probs)
    return ScheduledSamplingDraw(mask, mode, _sample(probs, generator))


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` ``(n, V)``, by inverting the cumulative distribution.

    The same distribution as ``torch.multinomial(probs, 1)``, which on CPU takes ~8x longer at a 32k vocabulary.
    """
    cdf = probs.cumsum(dim=-1)
    device = probs.device if generator is None else generator.device
    u = torch.rand(probs.shape[0], 1, generator=generator, device=device).to(probs.device) * cdf[:, -1:]
    # The first index whose cumulative mass exceeds u: token i with probability cdf[i] - cdf[i - 1] = probs[i].
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).reshape(-1)


def apply_draw(
    ids: torch.Tensor, draw: ScheduledSamplingDraw, embedding: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The pass-2 input: gold ``ids`` where ``draw.mask`` is False, the drawn prediction elsewhere.

    Returns ``{"input_ids": ...}`` for ``"argmax"`` / ``"sample"``, ``{"inputs_embeds": ...}`` for ``"soft"``
    (``embedding(ids)`` at the gold positions, ``probs @ E`` at the replaced ones; ``embedding`` is the module that
    turns these ids into the embeddings the model would compute, any scaling included).
    """
    if draw.mask.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and the draw's mask {tuple(draw.mask.shape)} must have one shape")
    if draw.mode == "soft":
        if embedding is None:
            raise ValueError("mode='soft' needs the model's input embedding module (embedding=...)")
        gold = embedding(ids)
        replace = draw.mask[:, 1:]
        matrix = _embedding_matrix(embedding, draw.predictions.shape[-1], ids.device)
        soft = (draw.predictions.to(matrix.dtype) @ matrix).to(gold.dtype)
        tail = gold[:, 1:].masked_scatter(replace.unsqueeze(-1), soft)
        return {"inputs_embeds": torch.cat([gold[:, :1], tail], dim=1)}
    tail = ids[:, 1:].masked_scatter(draw.mask[:, 1:], draw.predictions.to(ids.dtype))
    return {"input_ids": torch.cat([ids[:, :1], tail], dim=1)}


def mix_inputs(
    ids: torch.Tensor,
    logits: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "argmax",
    temperature: float = 1.0,
    embedding: nn.Module | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`draw_predictions` then :func:`apply_draw`: ``{"input_ids"}`` (``{"inputs_embeds"}`` for ``"soft"``)."""
    if mode == "soft" and embedding is None:
        raise ValueError("mode='soft' needs the model's input embedding module (embedding=...)")
    if logits.shape[:2] != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and logits {tuple(logits.shape)} must agree on (batch, length)")
    draw = draw_predictions(logits, mask, mode=mode, temperature=temperature, generator=generator)
    return apply_draw(ids, draw, embedding=embedding)


# ---- Decoder-only (causal) models ---------------------------------------------------------------------------------


def draw_replacements(allowed: torch.Tensor, ratio: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Each ``allowed`` position, independently, with probability ``1 - ratio`` (none at ratio 1, all at ratio 0)."""
    if ratio == 1.0:
        return torch.zeros_like(allowed)
    if ratio == 0.0:
        return allowed
    draw = torch.rand(
        allowed.shape, generator=generator, device=allowed.device if generator is None else generator.device
    )
    return allowed & draw.to(allowed.device).ge(ratio)


def causal_replacement_mask(
    labels: torch.Tensor,
    ratio: float,
    generator: torch.Generator | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Where a causal LM's input takes the model's prediction instead of the gold token: a ``(B, L)`` bool mask.

    A causal LM's ``labels`` line up with its ``input_ids`` (the loss shifts them): position ``t`` is a completion
    token when ``labels[:, t]`` is not ``ignore_index``, and the model's prediction for it is made at ``t - 1``. Each
    completion token at ``t >= 1`` is replaced with probability ``1 - ratio``, independently; prompt tokens and
    padding (labelled ``ignore_index``) never are. With ``shift_labels`` (``labels[:, 1:]`` as padding-free collators
    give them) position ``t`` is a completion token when ``shift_labels[:, t - 1]`` is labelled.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio={ratio} is not allowed; it must be in [0, 1]")
    allowed = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    if shift_labels is not None:
        allowed[:, 1:] = shift_labels[:, : labels.shape[1] - 1].ne(ignore_index)
    else:
        allowed[:, 1:] = labels[:, 1:].ne(ignore_index)
    return draw_replacements(allowed, ratio, generator)


@dataclass(frozen=True)
class TwoPassModel:
    """How one kind of model runs scheduled sampling's two passes (a part of :func:`two_pass_forward`)."""

    ids: str  # the key of the input ids pass 2 mixes ("input_ids", "decoder_input_ids")
    why_same_shape: str  # why those ids and the labels have one shape (said when they do not)
    pass2_inputs: Callable  # (model, inputs) -> the keyword arguments of pass 2, the gold ids included
    draw: Callable  # (model, pass-1 kwargs, labels, ratio, mode, temperature, generator) -> ScheduledSamplingDraw
    mixed: Callable  # (model, gold ids, draw or None) -> pass 2's ids (or embeddings) as keyword arguments


def two_pass_forward(kind: TwoPassModel, module: str, name: str, doc: str) -> Callable:
    """The public two-pass forward of one kind of model, named ``module.name``: the decoder-only and the
    encoder-decoder forwards are this one function (the same arguments, the same reuse of a draw, pass 1 skipped at
    ratio 1) around the passes of their kind."""
    embeds = kind.ids.replace("input_ids", "inputs_embeds")

    def two_pass(
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        labels: torch.Tensor,
        ratio: float,
        mode: str = "argmax",
        temperature: float = 1.0,
        forward: Callable | None = None,
        generator: torch.Generator | None = None,
        draw: ScheduledSamplingDraw | None = None,
        return_draw: bool = False,
    ):
        forward = model if forward is None else forward
        pass2 = kind.pass2_inputs(model, inputs)
        if kind.ids not in pass2:
            if embeds in pass2:
                outputs = forward(**pass2)
                return (outputs, None) if return_draw else outputs
            raise ValueError(f"scheduled sampling needs {kind.ids} (or {embeds}) in the inputs")
        ids = pass2.pop(kind.ids)
        if ids.shape != labels.shape:
            raise ValueError(
                f"{kind.ids} {tuple(ids.shape)} and labels {tuple(labels.shape)} must have the same shape "
                f"({kind.why_same_shape})"
            )
        if draw is None and ratio < 1.0:
            draw = kind.draw(model, {**pass2, kind.ids: ids}, labels, ratio, mode, temperature, generator)
        outputs = forward(**pass2, **kind.mixed(model, ids, draw))
        return (outputs, draw) if return_draw else outputs

    two_pass.__module__, two_pass.__name__, two_pass.__qualname__, two_pass.__doc__ = module, name, name, doc
    return two_pass


def _causal_draw(model, inputs, labels, ratio, mode, temperature, generator) -> ScheduledSamplingDraw:
    """Which completion tokens pass 2 replaces, and by what: pass 1 teacher-forced under ``no_grad``, then the draw."""
    mask = causal_replacement_mask(labels, ratio, generator=generator, shift_labels=inputs.get("shift_labels"))
    with torch.no_grad():
        logits = _pass1_logits(model, inputs, mask)
        return draw_predictions(logits, mask, mode=mode, temperature=temperature, generator=generator)


def _pass1_logits(model: nn.Module, inputs: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Pass 1's logits: ``(n, V)`` at the positions whose prediction is fed (``t - 1`` of each replaced ``t``) when
    the model computes them alone (``logits_to_keep`` with a boolean mask), else all ``(B, L, V)``.

    The vocabulary projection is then paid for the replaced positions only: not for the prompt, nor for the
    completion tokens the draw keeps gold. No key/value cache: pass 1 is read once.
    """
    kwargs = {"use_cache": False, **inputs}
    if _takes_boolean_logits_to_keep(model):
        keep = torch.zeros_like(mask)
        keep[:, :-1] = mask[:, 1:]
        logits = output_logits(model(**{**kwargs, "logits_to_keep": keep}))
        if logits.dim() == 2 and logits.shape[0] == int(keep.sum()):
            return logits
        _FULL_LOGITS.add(type(model))  # not what slice_logits_to_keep gives: never again
    return output_logits(model(**kwargs))


# Causal-LM classes whose forward turned out not to return the boolean logits_to_keep rows.
_FULL_LOGITS: set[type] = set()


def _takes_boolean_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model``'s forward slices its hidden states with transformers' ``slice_logits_to_keep`` (which takes a
    boolean ``(B, L)`` mask and returns the kept rows flattened)."""
    from transformers import modeling_utils

    base = unwrap_model(model, peft=True)
    helper = getattr(modeling_utils, "slice_logits_to_keep", None)
    forward = type(base).forward
    if helper is None or type(model) in _FULL_LOGITS:
        return False
    if "logits_to_keep" not in inspect.signature(forward).parameters:
        return False
    return getattr(sys.modules.get(forward.__module__), "slice_logits_to_keep", None) is helper


def _causal_mixed(model: nn.Module, input_ids: torch.Tensor, draw: ScheduledSamplingDraw | None) -> dict:
    """Pass 2's input: the gold ids when nothing is replaced, else the draw applied (ids, or embeddings for
    ``"soft"``)."""
    if draw is None:
        return {"input_ids": input_ids}
    embedding = model.get_input_embeddings() if draw.mode == "soft" else None
    return apply_draw(input_ids, draw, embedding=embedding)


_CAUSAL_DOC = """\
One scheduled-sampling forward of a decoder-only LM: pass 1 teacher-forced under ``no_grad``, mix, pass 2.

Mihaylova & Martins 2019, https://arxiv.org/abs/1906.07651, on a causal LM: each completion token (label not
-100) of ``input_ids`` is replaced, with probability ``1 - ratio``, by the model's pass-1 prediction for it (made
one position earlier); prompt tokens stay gold. The loss on the pass-2 logits is the usual causal-LM loss
(``logits[:, :-1]`` against ``labels[:, 1:]``). With ``ratio=1`` pass 1 is skipped and the outputs are those of a
plain forward on ``inputs``.

Args:
    model (`PreTrainedModel`): a causal LM (PEFT-wrapped or not), unwrapped from DDP; runs pass 1.
    inputs (`dict`): the batch without ``labels``; must hold ``input_ids`` unless it holds ``inputs_embeds``,
        which are passed through unmixed. ``shift_labels``, if present, decides the completion tokens.
    labels (`torch.LongTensor` of shape `(B, L)`): aligned with ``input_ids``; -100 marks prompt and padding.
    ratio (`float`): the teacher-forcing probability, e.g. ``ScheduledSampler.ratio(step)``.
    mode, temperature: see :func:`draw_predictions`.
    forward (`Callable`, *optional*): what runs pass 2 (default ``model``); a DDP / accelerate wrapper of
        ``model`` goes here so that gradient synchronisation sees the forward.
    generator (`torch.Generator`, *optional*): random source of the replacement draws and of ``"sample"``.
    draw (`ScheduledSamplingDraw`, *optional*): reuse this draw (from an earlier call on the same batch with
        ``return_draw=True``) instead of running pass 1 and drawing again.
    return_draw (`bool`, defaults to False): also return the draw used (``None`` when nothing was mixed).

Returns:
    The pass-2 model outputs, or ``(outputs, draw)`` with ``return_draw``.
"""

causal_scheduled_sampling_forward = two_pass_forward(
    TwoPassModel(
        ids="input_ids",
        why_same_shape="a causal LM's labels line up with its inputs; the loss shifts them",
        pass2_inputs=lambda model, inputs: dict(inputs),
        draw=_causal_draw,
        mixed=_causal_mixed,
    ),
    __name__,
    "causal_scheduled_sampling_forward",
    _CAUSAL_DOC,
)
