"""A linear-chain conditional random field (CRF) for token classification, and its attachment to transformers models.

Lafferty et al. 2001, https://repository.upenn.edu/cis_papers/159/; as a head over a neural encoder: Lample et al.
2016, https://arxiv.org/abs/1603.01360.

A tag sequence ``y`` of length ``n`` over emissions ``e`` (the model's logits) scores
``start[y_0] + sum_t e[t, y_t] + sum_{t>0} transitions[y_{t-1}, y_t] + end[y_{n-1}]``; its log-likelihood is that
score minus the log-sum-exp over every tag sequence of length ``n`` (the forward algorithm). Decoding is Viterbi.
Both run over the batch at once, one step per position, in float32 whatever the emissions' dtype; the partition
function has a hand-written forward-backward gradient (see benchmarks/crf.py).

A mask marks the positions that count, in order: a prefix of each sequence or with gaps, such as ``labels != -100``
over sub-tokens (only a word's first sub-token labelled). Gaps are closed by :func:`compact`, which moves each
sequence's counted positions to the front; :func:`expand` puts per-position results back.

Constraints (optional) forbid some starts, transitions and ends with a fixed score of -10,000 (``FORBIDDEN``), in
training and decoding alike: :func:`bio_constraints` builds the BIO (IOB2) ones from label names (``I-X`` only after
``B-X`` or ``I-X``, never first).

Saving and loading: :func:`add_crf` attaches a CRF to a ``*ForTokenClassification`` model as ``model.crf``, so
``save_pretrained`` writes its scores (``crf.*``) beside the model's weights, and :func:`load_crf_model` loads such a
folder (or Hub id) back in one call, model and CRF together, strictly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from .models import model_class_with

__all__ = [
    "CRF",
    "FORBIDDEN",
    "bio_constraints",
    "bio_violation",
    "compact",
    "expand",
    "add_crf",
    "load_crf_model",
    "crf_model_class",
]

# The score of a forbidden start / transition / end: exp(-1e4) is 0 in float32, and unlike -inf it keeps a gold path
# that breaks a constraint finite (a large loss rather than inf / NaN).
FORBIDDEN = -1e4


class CRF(nn.Module):
    """Linear-chain CRF over ``num_tags`` tags with learned start, end and transition scores.

    Args:
        num_tags (`int`): number of tags C (the model's ``num_labels``).

    Parameters ``start_transitions`` (C,), ``end_transitions`` (C,) and ``transitions`` (C, C) (``[i, j]``: from tag
    ``i`` to tag ``j``) start at zero. The boolean buffers ``allowed_start``, ``allowed_transitions`` and
    ``allowed_end`` hold the constraints (all True: none); they are saved with the weights.

    Example::

        crf = CRF(5)
        nll = -crf.log_likelihood(emissions, tags, mask).mean()   # emissions (B, L, 5), tags / mask (B, L)
        paths = crf.decode(emissions, mask)                       # one list of tag ids per sequence
    """

    def __init__(self, num_tags: int):
        super().__init__()
        if int(num_tags) != num_tags or num_tags < 1:
            raise ValueError(f"num_tags={num_tags!r} is not allowed; it must be an integer >= 1")
        self.num_tags = int(num_tags)
        self.start_transitions = nn.Parameter(torch.zeros(num_tags))
        self.end_transitions = nn.Parameter(torch.zeros(num_tags))
        self.transitions = nn.Parameter(torch.zeros(num_tags, num_tags))
        self.register_buffer("allowed_start", torch.ones(num_tags, dtype=torch.bool))
        self.register_buffer("allowed_transitions", torch.ones(num_tags, num_tags, dtype=torch.bool))
        self.register_buffer("allowed_end", torch.ones(num_tags, dtype=torch.bool))

    def extra_repr(self) -> str:
        constrained = not (self.allowed_start.all() and self.allowed_transitions.all() and self.allowed_end.all())
        return f"num_tags={self.num_tags}" + (", constrained" if constrained else "")

    def reset_parameters(self) -> None:
        """Zero scores (no RNG drawn, so attaching a CRF leaves a seeded run's random stream as it was)."""
        with torch.no_grad():
            for param in (self.start_transitions, self.end_transitions, self.transitions):
                param.zero_()

    def set_constraints(
        self,
        allowed_start: torch.Tensor | None = None,
        allowed_transitions: torch.Tensor | None = None,
        allowed_end: torch.Tensor | None = None,
    ) -> CRF:
        """Forbid the starts / transitions / ends that are False (``None``: all allowed). Returns ``self``."""
        c = self.num_tags
        for name, value, shape in (
            ("allowed_start", allowed_start, (c,)),
            ("allowed_transitions", allowed_transitions, (c, c)),
            ("allowed_end", allowed_end, (c,)),
        ):
            value = torch.ones(shape, dtype=torch.bool) if value is None else torch.as_tensor(value, dtype=torch.bool)
            if tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
            getattr(self, name).copy_(value)
        if not self.allowed_start.any() or not self.allowed_end.any():
            raise ValueError("the constraints forbid every start or every end tag: no sequence could be scored")
        return self

    def potentials(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The start (C,), transition (C, C) and end (C,) scores in float32, ``FORBIDDEN`` where constrained."""
        return tuple(
            torch.where(allowed, param.float(), FORBIDDEN)
            for param, allowed in (
                (self.start_transitions, self.allowed_start),
                (self.transitions, self.allowed_transitions),
                (self.end_transitions, self.allowed_end),
            )
        )

    # ---- Public API --------------------------------------------------------------------------------------------

    def log_likelihood(
        self, emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Log-likelihood of each sequence's tags, shape ``(B,)`` (0 for a sequence with no position).

        Args:
            emissions (`torch.Tensor`): ``(B, L, C)`` scores (the model's logits), any float dtype.
            tags (`torch.Tensor`): ``(B, L)`` tag ids; values where ``mask`` is False are ignored (-100 is fine).
            mask (`torch.Tensor`, *optional*): ``(B, L)``, True on the positions that count: a prefix of each
                sequence, or with gaps (e.g. ``labels != -100``), in which case the counted positions, in order, are
                the sequence. Default: every position.
        """
        self._check(emissions, mask)
        if tags.shape != emissions.shape[:2]:
            raise ValueError(f"tags of shape {tuple(tags.shape)} do not match emissions {tuple(emissions.shape)}")
        if mask is None:
            lengths = torch.full(tags.shape[:1], tags.shape[1], dtype=torch.long, device=tags.device)
        else:
            emissions, tags, lengths, _ = compact(emissions, torch.where(mask.bool(), tags, -1), ignore_index=-1)
        return self.log_likelihood_lengths(emissions, tags, lengths)

    forward = log_likelihood

    def decode(self, emissions: torch.Tensor, mask: torch.Tensor | None = None) -> list[list[int]]:
        """The Viterbi (highest-scoring) tag sequence of each sequence: a list of tag ids per sequence, one per
        counted position of ``mask`` (see :meth:`log_likelihood`)."""
        self._check(emissions, mask)
        if mask is None:
            lengths = torch.full(emissions.shape[:1], emissions.shape[1], dtype=torch.long)
        else:
            mask = mask.bool()
            emissions, _, lengths, _ = compact(emissions, mask.long(), ignore_index=0)
        paths = self.viterbi_lengths(emissions, lengths)
        return [row[:n] for row, n in zip(paths.tolist(), lengths.tolist())]

    def _check(self, emissions: torch.Tensor, mask: torch.Tensor | None) -> None:
        if emissions.dim() != 3 or emissions.shape[-1] != self.num_tags:
            raise ValueError(
                f"emissions must be (batch, length, num_tags={self.num_tags}), got {tuple(emissions.shape)}"
            )
        if mask is not None and mask.shape != emissions.shape[:2]:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not match emissions {tuple(emissions.shape)}")

    # ---- Sequences given by their lengths (prefixes) -----------------------------------------------------------

    def log_likelihood_lengths(
        self, emissions: torch.Tensor, tags: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`log_likelihood` of prefix sequences given by their lengths ``(B,)``: position ``t`` of sequence
        ``b`` counts iff ``t < lengths[b]``."""
        emissions = emissions.float()
        batch, length, _ = emissions.shape
        if length == 0:
            return emissions.new_zeros(batch)
        start, trans, end = self.potentials()
        log_z = _LogPartition.apply(emissions, lengths, start, trans, end)
        return _gold_score(emissions, tags, lengths, start, trans, end) - log_z

    @torch.no_grad()
    def viterbi_lengths(self, emissions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Viterbi paths of prefix sequences given by their lengths, as a ``(B, L)`` int64 CPU tensor (positions
        past a sequence's end repeat its last tag)."""
        batch, length, num_tags = emissions.shape
        if length == 0:
            return torch.zeros(batch, 0, dtype=torch.long)
        start, trans, end = self.potentials()
        em = emissions.detach().float().transpose(0, 1)  # (L, B, C): one contiguous row per step
        active = (torch.arange(length, device=em.device)[:, None] < lengths.to(em.device)[None, :]).unsqueeze(-1)
        keep = torch.arange(num_tags, device=em.device).expand(batch, num_tags)
        history = torch.empty(length, batch, num_tags, dtype=torch.long, device=em.device)
        score = start + em[0]
        for t in range(1, length):
            best, index = (score.unsqueeze(2) + trans).max(dim=1)
            # Past a sequence's end its score stays and its back-pointers point to the same tag.
            score = torch.where(active[t], best + em[t], score)
            torch.where(active[t], index, keep, out=history[t])
        last = (score + end).argmax(dim=1).cpu().numpy()
        history = history.cpu().numpy()
        rows = np.arange(batch)
        paths = np.empty((batch, length), dtype=np.int64)
        paths[:, length - 1] = last
        for t in range(length - 1, 0, -1):
            last = history[t, rows, last]
            paths[:, t - 1] = last
        return torch.from_numpy(paths)


def _gold_score(emissions, tags, lengths, start, trans, end) -> torch.Tensor:
    """Score of the given tag sequences (autograd flows to emissions and the potentials)."""
    batch, length, _ = emissions.shape
    valid = torch.arange(length, device=emissions.device) < lengths[:, None]
    tags = torch.where(valid, tags, 0)
    score = torch.where(valid, emissions.gather(2, tags.unsqueeze(2)).squeeze(2), 0.0).sum(dim=1)
    score = score + torch.where(valid[:, 1:], trans[tags[:, :-1], tags[:, 1:]], 0.0).sum(dim=1)
    last = tags.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(lengths > 0, score + start[tags[:, 0]] + end[last], 0.0)


class _LogPartition(torch.autograd.Function):
    """``log Z`` per sequence by the forward algorithm, with the forward-backward algorithm as its gradient.

    A step is a (B, C) x (C, C) product in exp space, ``alpha_t = log(exp(alpha_{t-1} - m) @ exp(T - T_max)) + m +
    T_max + e_t`` (``m`` the row maximum): one matrix product instead of a (B, C, C) log-sum-exp. It is exact in
    float32 while every product it sums is a normal float, i.e. while the scores of a step lie within
    ``_EXP_SPACE_GAP`` nats of their row's best (with the transitions' spread); otherwise (huge logits) the
    recursion is redone with log-sum-exp steps. The gradient is the marginals: ``P(y_t = j)`` for the emissions,
    the pair marginals for the transitions, from the alphas and the betas of the backward recursion.
    """

    @staticmethod
    def forward(ctx, emissions, lengths, start, trans, end):
        em = emissions.transpose(0, 1).contiguous()  # (L, B, C)
        length, batch, num_tags = em.shape
        lengths = lengths.to(em.device)
        valid = (torch.arange(length, device=em.device)[:, None] < lengths[None, :]).unsqueeze(-1)  # (L, B, 1)
        alphas = _alphas(em, start, trans, exact=False)
        if _needs_log_space(alphas, valid, trans):
            alphas = _alphas(em, start, trans, exact=True)
        last = (lengths - 1).clamp(min=0)
        final = alphas.gather(0, last.view(1, batch, 1).expand(1, batch, num_tags)).squeeze(0) + end
        log_z = torch.where(lengths > 0, torch.logsumexp(final, dim=1), 0.0)
        ctx.save_for_backward(em, lengths, valid, trans, end, alphas, log_z)
        return log_z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_z):
        em, lengths, valid, trans, end, alphas, log_z = ctx.saved_tensors
        length, batch, num_tags = em.shape
        is_last = (torch.arange(length, device=em.device)[:, None] == (lengths - 1)[None, :]).unsqueeze(-1)
        betas = _betas(em, end, trans, is_last, exact=False)
        if _needs_log_space(betas, valid, trans):
            betas = _betas(em, end, trans, is_last, exact=True)
        grad = grad_log_z.view(1, batch, 1)
        # Node marginals P(y_t = j), zero past each sequence's end (where alphas and betas hold leftovers that
        # may overflow, so they are masked before exp).
        marginals = (alphas + betas - log_z.view(1, batch, 1)).masked_fill_(~valid, -torch.inf).exp_().mul_(grad)
        grad_emissions = marginals.transpose(0, 1)
        grad_start = marginals[0].sum(dim=0)
        grad_end = (marginals * is_last).sum(dim=(0, 1))
        grad_trans = _pair_marginal_sum(alphas[:-1], em[1:] + betas[1:], trans, log_z, valid[1:] * grad)
        return grad_emissions, None, grad_start, grad_trans, grad_end


# An exp-space step is exact while the scores it exponentiates lie within this many nats of their row's best (plus
# the spread of the transitions): every product it sums is then a normal float32 (exp(-87) is the smallest).
_EXP_SPACE_GAP = 80.0
# Gaps this large only come from forbidden scores (FORBIDDEN = -1e4): 0 in either space.
_FAR = -FORBIDDEN / 2


def _alphas(em: torch.Tensor, start: torch.Tensor, trans: torch.Tensor, exact: bool) -> torch.Tensor:
    """Forward recursion over (L, B, C) emissions: ``alphas[t, b, j]`` = log-sum of the scores of every prefix
    ending in tag j at t."""
    alphas = torch.empty_like(em)
    torch.add(em[0], start, out=alphas[0])
    if exact:
        trans_to_from = trans.t()
        for t in range(1, em.shape[0]):
            torch.add(torch.logsumexp(alphas[t - 1].unsqueeze(1) + trans_to_from, dim=2), em[t], out=alphas[t])
        return alphas
    t_max = trans.max()
    exp_trans = (trans - t_max).exp()
    em_shifted = em + t_max
    for t in range(1, em.shape[0]):
        alpha = alphas[t - 1]
        m = alpha.amax(dim=1, keepdim=True)
        s = torch.mm((alpha - m).exp_(), exp_trans).log_().add_(m)
        torch.add(s, em_shifted[t], out=alphas[t])
    return alphas


def _betas(em: torch.Tensor, end: torch.Tensor, trans: torch.Tensor, is_last: torch.Tensor, exact: bool):
    """Backward recursion: ``betas[t, b, i]`` = log-sum of the scores of every continuation after tag i at t, to
    the end of sequence b (restarting from ``end`` at each sequence's last position)."""
    length = em.shape[0]
    betas = torch.empty_like(em)
    betas[length - 1] = end
    if not exact:
        t_max = trans.max()
        exp_trans_t = (trans - t_max).exp_().t().contiguous()
    for t in range(length - 2, -1, -1):
        w = em[t + 1] + betas[t + 1]
        if exact:
            s = torch.logsumexp(w.unsqueeze(1) + trans, dim=2)
        else:
            m = w.amax(dim=1, keepdim=True)
            s = torch.mm(w.sub_(m).exp_(), exp_trans_t).log_().add_(m + t_max)
        torch.where(is_last[t], end, s, out=betas[t])
    return betas


def _needs_log_space(values: torch.Tensor, valid: torch.Tensor, trans: torch.Tensor) -> bool:
    """Whether an exp-space recursion that produced ``values`` (L, B, C) may have lost precision."""
    gap = values.amax(dim=2, keepdim=True) - values
    gap = torch.where(valid & (gap < _FAR), gap, 0.0)
    allowed = trans[trans > FORBIDDEN / 2]
    spread = allowed.max() - allowed.min() if allowed.numel() else 0.0
    return bool(gap.amax() + spread > _EXP_SPACE_GAP)


def _pair_marginal_sum(alphas, right, trans, log_z, weight) -> torch.Tensor:
    """``sum_{t,b} weight[t,b] * P(y_{t-1} = i, y_t = j)`` for ``alphas`` = alpha_{t-1} and ``right`` = e_t + beta_t,
    both ``(T, B, C)``.

    The pair marginal ``exp(alpha_i + trans_ij + right_j - log Z)`` factors into ``u_i * exp(trans_ij - T_max) * v_j
    * F`` with ``u = exp(alpha - max alpha)``, ``v = exp(right - max right)`` and a per-step factor ``F``, so the sum
    is one (C, T*B) x (T*B, C) product instead of a (T, B, C, C) tensor. Where ``log F > 60`` (a pair that matters
    would be a product below float32's range) those steps are summed exactly in log space instead.
    """
    a = alphas.amax(dim=2, keepdim=True)
    c = right.amax(dim=2, keepdim=True)
    t_max = trans.max()
    log_f = (a + c + t_max - log_z.view(1, -1, 1)).masked_fill_(weight == 0, 0.0)
    exact = log_f > 60.0
    u = (alphas - a).exp_()
    v = (right - c).exp_().mul_(torch.where(exact, 0.0, log_f.exp() * weight))
    num_tags = trans.shape[0]
    total = torch.mm(u.reshape(-1, num_tags).t(), v.reshape(-1, num_tags)).mul_((trans - t_max).exp_())
    if exact.any():
        rows = exact.view(-1).nonzero().squeeze(1)
        pair = (
            alphas.reshape(-1, num_tags)[rows].unsqueeze(2)
            + (
                right.reshape(-1, num_tags)[rows] - log_z.view(1, -1).expand(alphas.shape[:2]).reshape(-1)[rows, None]
            ).unsqueeze(1)
            + trans
        )
        total += (pair.exp_() * weight.reshape(-1)[rows, None, None]).sum(dim=0)
    return total


# ---- Constraints ---------------------------------------------------------------------------------------------------


def bio_constraints(labels: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allowed starts (C,), transitions (C, C) and ends (C,) of the BIO (IOB2) scheme for these label names.

    ``I-X`` may only follow ``B-X`` or ``I-X`` and never starts a sequence; everything else is allowed. Labels are
    ``O``, ``B-<type>`` or ``I-<type>``; any other name raises ``ValueError`` naming it.
    """
    labels = list(labels)
    kinds = []
    for label in labels:
        if label == "O":
            kinds.append(("O", None))
        elif isinstance(label, str) and label[:2] in ("B-", "I-") and len(label) > 2:
            kinds.append((label[0], label[2:]))
        else:
            raise ValueError(
                f"crf_bio_constraints needs BIO tags ('O', 'B-<type>', 'I-<type>'), but the labels include {label!r}"
            )
    c = len(labels)
    allowed_start = torch.tensor([kind != "I" for kind, _ in kinds])
    allowed = torch.ones(c, c, dtype=torch.bool)
    for j, (kind, entity) in enumerate(kinds):
        if kind == "I":
            for i, (prev_kind, prev_entity) in enumerate(kinds):
                allowed[i, j] = prev_kind in ("B", "I") and prev_entity == entity
    return allowed_start, allowed, torch.ones(c, dtype=torch.bool)


# ---- Labelled positions with gaps <-> prefixes ---------------------------------------------------------------------


def compact(
    emissions: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, *, trim: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move each sequence's labelled positions (``labels != ignore_index``) to the front, in order.

    Returns ``(emissions, tags, lengths, order)``: the compacted ``(B, L', C)`` emissions and ``(B, L')`` tags (0 past
    each sequence's end), the ``(B,)`` label counts, and the ``(B, L)`` permutation used (for :func:`expand`). With
    ``trim`` the length ``L'`` is the longest count (one device sync), else ``L``.
    """
    keep = labels != ignore_index
    lengths = keep.sum(dim=1)
    # A stable sort of "not kept" puts the kept positions first without reordering them.
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    if trim:
        order = order[:, : int(lengths.max()) if lengths.numel() else 0]
    tags = labels.gather(1, order)
    tags = torch.where(torch.arange(order.shape[1], device=tags.device) < lengths[:, None], tags, 0)
    emissions = emissions.gather(1, order.unsqueeze(-1).expand(-1, -1, emissions.shape[-1]))
    return emissions, tags, lengths, order


def expand(values: torch.Tensor, order: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write compacted per-position ``values`` ``(B, L')`` back to their original positions in ``out`` ``(B, L)``
    (positions past each sequence's length are left alone). Returns ``out``."""
    valid = torch.arange(order.shape[1], device=order.device) < lengths[:, None]
    rows = torch.arange(order.shape[0], device=order.device)[:, None].expand_as(order)
    out[rows[valid], order[valid]] = values.to(out.device)[valid]
    return out


# ---- transformers models -------------------------------------------------------------------------------------------


def add_crf(model: nn.Module, *, bio_constraints: bool = False) -> CRF:
    """Attach a :class:`CRF` over ``model.config.num_labels`` tags as ``model.crf`` (kept if there is one already).

    The model's forward is unchanged (its logits are the emissions); ``TricksTrainer(crf=True)`` trains and decodes
    with ``model.crf``. ``save_pretrained`` then writes the CRF's scores and constraints as ``crf.*`` beside the
    weights and ``config.crf = True``; :func:`load_crf_model` loads them back. With ``bio_constraints`` the BIO
    constraints are built from ``model.config.id2label``.
    """
    config = getattr(model, "config", None)
    num_labels = getattr(config, "num_labels", None)
    if num_labels is None:
        raise ValueError(
            f"crf needs a token classification model with config.num_labels; {type(model).__name__} has none"
        )
    crf = getattr(model, "crf", None)
    # A CRF that trains beside a PEFT adapter sits in PEFT's modules_to_save wrapper, which forwards to its copy.
    found = getattr(crf, "original_module", crf)
    if crf is None:
        param = next(model.parameters(), None)
        crf = CRF(num_labels).to(param.device if param is not None else "cpu")
        model.add_module("crf", crf)
    elif not isinstance(found, CRF) or found.num_tags != num_labels:
        raise ValueError(
            f"{type(model).__name__}.crf is {crf!r}, not a CRF over config.num_labels={num_labels} tags; remove it or "
            "rename the attribute"
        )
    if bio_constraints:
        id2label = getattr(config, "id2label", {})
        names = [id2label.get(i, id2label.get(str(i))) for i in range(num_labels)]
        crf.set_constraints(*_bio_constraint_masks(names))
    config.crf = True
    return crf


def bio_violation(tags: Sequence[str]) -> tuple[int, str] | None:
    """The first position of a tag sequence that the BIO (IOB2) constraints forbid, with why; ``None`` if it is
    valid. IOB1 data (an entity opened by ``I-``) breaks them: convert it to IOB2 or leave the constraints off."""
    prev = None
    for i, tag in enumerate(tags):
        if tag.startswith("I-") and (prev is None or prev[2:] != tag[2:] or prev[:2] not in ("B-", "I-")):
            where = "first" if prev is None else f"after {prev!r}"
            return i, f"{tag!r} {where}: BIO allows I-X only after B-X or I-X"
        prev = tag
    return None


_bio_constraint_masks = bio_constraints  # add_crf's keyword `bio_constraints` hides the function inside it

_CRF_CLASSES: dict[type, type] = {}


def crf_model_class(model_class: type) -> type:
    """A subclass of ``model_class`` (a ``PreTrainedModel``) whose models carry a CRF (``.crf``) from construction, so
    its ``from_pretrained`` loads the ``crf.*`` weights with the rest. Built once per class."""

    def attach(model, config):
        model.add_module("crf", CRF(config.num_labels))

    return model_class_with(model_class, "CRF", attach, _CRF_CLASSES, __name__, resets=CRF)


def load_crf_model(pretrained_model_name_or_path, **kwargs) -> nn.Module:
    """Load a token classification model saved with its CRF (``save_pretrained`` after :func:`add_crf`, a
    TricksTrainer ``crf=True`` output or checkpoint) in one call: weights, CRF scores and constraints, strictly.

    ``kwargs`` go to ``from_pretrained`` (``dtype``, ``revision``, ``config``, ...). The CRF's scores load in the
    weights' dtype; it computes in float32 either way. Raises ``ValueError`` if the checkpoint has no CRF.

    Example::

        from nlp_tricks import load_crf_model
        model = load_crf_model("outputs/ner")
        logits = model(input_ids=..., attention_mask=...).logits
        tags = model.crf.decode(logits, word_mask)  # word_mask: True on each word's first sub-token
    """
    from transformers import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, AutoConfig

    from .versions import CRF_LOADING_SINCE, require_transformers

    require_transformers(CRF_LOADING_SINCE, "load_crf_model")
    config_kwargs = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token", "cache_dir") if k in kwargs}
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(pretrained_model_name_or_path, **config_kwargs)
    if type(config) not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING:
        raise ValueError(
            f"{pretrained_model_name_or_path}: {type(config).__name__} has no token classification model in "
            "transformers; build it yourself, call add_crf(model) and load_state_dict_portable(model, folder)"
        )
    model_class = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[type(config)]
    model, info = crf_model_class(model_class).from_pretrained(
        pretrained_model_name_or_path, config=config, output_loading_info=True, **kwargs
    )
    missing = sorted(k for k in info.get("missing_keys", ()) if k.startswith("crf."))
    if missing:
        raise ValueError(
            f"{pretrained_model_name_or_path} holds no CRF weights (missing {', '.join(missing)}); it was not saved "
            "with a CRF: load it with AutoModelForTokenClassification.from_pretrained, or train it with crf=True"
        )
    return model
