"""Ensembling rules for fold models (or any models over the same label list), as plain numpy / torch functions.

Each rule takes what every member predicted and returns the ensemble's prediction; none needs a Trainer or a model:

- Classification: :func:`mean_probabilities`, the mean of the members' class probabilities (the prediction is its
  argmax).
- NER, by word: a word's prediction is its first sub-token's, so members with different tokenizers still predict
  the same words. :func:`word_rows` picks those rows from a sentence's token rows (NaN for a word a member could not
  see: cut by truncation, or without a sub-token). :func:`mean_word_probabilities` averages the softmax of each
  word's logits over the members that saw it.
- NER with a CRF: :func:`mean_crf` averages the word emissions (over the members that saw each word) and the
  start / transition / end scores, and :func:`viterbi` decodes the mean once (DeepNER's ``EnsembleCRFModel``);
  :func:`crf_marginals` gives each word's tag distribution under that CRF (forward-backward), the soft target a
  student distils.
- NER by entity vote: :func:`vote_entities` keeps an entity (type, first word, last word) when at least a share
  ``threshold`` of the members predict it, the alternative to averaging.
- NER with a span head (GlobalPointer): :func:`mean_span_scores` averages the members' word-level span scores
  ``(T, W, W)`` (raw scores, not sigmoid probabilities: see its docstring), decoded once by
  :func:`nlp_tricks.functional.spans.decode_spans` as the members were trained (every span above 0, or the best flat
  set); :func:`vote_spans` is the vote over their spans, nested or flat.

Entities are read and written by :mod:`nlp_tricks.data.schemes` (seqeval's default mode, conlleval): see
:func:`entity_spans`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .data import schemes
from .data.schemes import split_tag, tags_to_spans

__all__ = [
    "softmax",
    "mean_probabilities",
    "word_rows",
    "mean_word_probabilities",
    "mean_crf",
    "crf_with_scores",
    "viterbi",
    "crf_marginals",
    "entity_spans",
    "spans_to_tags",
    "tag_scheme",
    "vote_entities",
    "mean_span_scores",
    "vote_spans",
]


def softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    """The softmax of ``logits`` along ``axis`` in float64 (shifted by the maximum, so large logits are safe)."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = np.exp(logits - logits.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


def mean_probabilities(member_probabilities: Sequence[np.ndarray]) -> np.ndarray:
    """The ensemble's class probabilities: the mean over members of their ``(N, C)`` probabilities, in float64.

    Every member must give the same shape (the same examples in the same order, the same label columns).
    """
    arrays = [np.asarray(p, dtype=np.float64) for p in member_probabilities]
    if not arrays:
        raise ValueError("mean_probabilities needs at least one member")
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"the members' probabilities differ in shape: {sorted(shapes)}")
    return np.mean(arrays, axis=0)


def word_rows(token_rows: np.ndarray, word_ids: Sequence[int | None], num_words: int) -> np.ndarray:
    """``(num_words, C)``: each word's row from its first sub-token's row of ``token_rows`` ``(L, C)``; NaN for a word
    without a token (truncated away, or tokenized to nothing).

    ``word_ids`` gives the word of each of the ``L`` tokens (``None``: a special token), as
    ``BatchEncoding.word_ids(i)`` does.
    """
    token_rows = np.asarray(token_rows)
    if len(word_ids) != len(token_rows):
        raise ValueError(f"{len(word_ids)} word ids for {len(token_rows)} token rows")
    out = np.full((num_words, token_rows.shape[-1]), np.nan, dtype=np.float32)
    seen = set()
    for position, word in enumerate(word_ids):
        if word is not None and word not in seen and word < num_words:
            seen.add(word)
            out[word] = token_rows[position]
    return out


def _seen(rows: np.ndarray) -> np.ndarray:
    return ~np.isnan(rows).any(axis=-1)


def _check_words(member_rows: Sequence[np.ndarray]) -> list[np.ndarray]:
    arrays = [np.asarray(r, dtype=np.float64) for r in member_rows]
    if not arrays:
        raise ValueError("the ensemble needs at least one member")
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"the members' word rows differ in shape: {sorted(shapes)} (one row per word of a sentence)")
    return arrays


def _mean_over_seen(arrays: list[np.ndarray]) -> np.ndarray:
    """Per word, the mean of the rows of the members that saw it (NaN where none did)."""
    stacked = np.stack(arrays)  # (M, W, C)
    seen = _seen(stacked)  # (M, W)
    count = seen.sum(axis=0)
    total = np.where(seen[..., None], stacked, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count[:, None]
    mean[count == 0] = np.nan
    return mean


def mean_word_probabilities(member_word_logits: Sequence[np.ndarray]) -> np.ndarray:
    """``(W, C)``: per word of one sentence, the mean over the members that saw it of the softmax of their logits.

    ``member_word_logits``: one ``(W, C)`` array per member (:func:`word_rows`; a NaN row: that member did not see
    the word). A word no member saw stays a NaN row.
    """
    arrays = _check_words(member_word_logits)
    return _mean_over_seen([np.where(_seen(a)[:, None], softmax(np.nan_to_num(a)), np.nan) for a in arrays])


def mean_crf(
    member_emissions: Sequence[np.ndarray], member_potentials: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(emissions, start, transitions, end)`` of the members' mean CRF for one sentence.

    ``member_emissions``: one ``(W, C)`` array of word emissions (the logits of each word's first sub-token; NaN
    rows: words the member did not see) per member; the mean emission of a word is over the members that saw it
    (NaN where none did). ``member_potentials``: per member its CRF's ``(start (C,), transitions (C, C), end (C,))``
    scores (``CRF.potentials()``: constrained ones at ``FORBIDDEN``), averaged over all members.
    """
    emissions = _mean_over_seen(_check_words(member_emissions))
    if len(member_potentials) != len(member_emissions):
        raise ValueError(f"{len(member_potentials)} CRFs for {len(member_emissions)} members' emissions")
    start, transitions, end = (
        np.mean([np.asarray(p[i], dtype=np.float64) for p in member_potentials], axis=0) for i in range(3)
    )
    return emissions, start, transitions, end


def _seen_sequence(emissions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The words with an emission (their indices) and their rows: the sequence a CRF decodes."""
    emissions = np.asarray(emissions, dtype=np.float64)
    words = np.flatnonzero(_seen(emissions))
    return words, emissions[words]


def crf_with_scores(start: np.ndarray, transitions: np.ndarray, end: np.ndarray):
    """A :class:`nlp_tricks.crf.CRF` whose start, transition and end scores are these (no constraints beyond what
    the scores say: a ``FORBIDDEN`` score stays one)."""
    from .crf import CRF

    crf = CRF(len(start))
    with torch.no_grad():
        crf.start_transitions.copy_(torch.as_tensor(np.asarray(start), dtype=torch.float32))
        crf.transitions.copy_(torch.as_tensor(np.asarray(transitions), dtype=torch.float32))
        crf.end_transitions.copy_(torch.as_tensor(np.asarray(end), dtype=torch.float32))
    return crf


def viterbi(emissions: np.ndarray, start: np.ndarray, transitions: np.ndarray, end: np.ndarray) -> list[int | None]:
    """The highest-scoring tag sequence of one sentence under a linear-chain CRF: a tag id per word.

    The score of tags ``y`` over the words with an emission (NaN rows are skipped, as the recipe's CRF skips words
    it cannot see, and get ``None``) is ``start[y_0] + sum_t emissions[t, y_t] + sum_{t>0} transitions[y_{t-1}, y_t]
    + end[y_last]``. Decoded by :class:`nlp_tricks.crf.CRF`'s Viterbi (the one the recipes predict with, in float32),
    so an ensemble of one model predicts exactly what that model does.
    """
    words, rows = _seen_sequence(emissions)
    out: list[int | None] = [None] * len(emissions)
    if not len(words):
        return out
    crf = crf_with_scores(start, transitions, end)
    path = crf.viterbi_lengths(torch.as_tensor(rows, dtype=torch.float32)[None], torch.tensor([len(words)]))[0]
    for word, tag in zip(words.tolist(), path.tolist()):
        out[word] = int(tag)
    return out


def _logsumexp(values: np.ndarray, axis: int) -> np.ndarray:
    peak = values.max(axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    return (np.log(np.exp(values - peak).sum(axis=axis, keepdims=True)) + peak).squeeze(axis)


def crf_marginals(emissions: np.ndarray, start: np.ndarray, transitions: np.ndarray, end: np.ndarray) -> np.ndarray:
    """``(W, C)``: ``P(y_t = j)`` of each word under the CRF (the forward-backward algorithm, in float64 log space);
    NaN rows where the emissions are NaN (words the CRF does not see, skipped as :func:`viterbi` skips them)."""
    words, rows = _seen_sequence(emissions)
    out = np.full(np.shape(emissions), np.nan)
    if not len(words):
        return out
    start, transitions, end = (np.asarray(x, dtype=np.float64) for x in (start, transitions, end))
    n = len(rows)
    alpha = np.empty_like(rows)
    beta = np.empty_like(rows)
    alpha[0] = start + rows[0]
    for t in range(1, n):
        alpha[t] = _logsumexp(alpha[t - 1][:, None] + transitions, axis=0) + rows[t]
    beta[n - 1] = end
    for t in range(n - 2, -1, -1):
        beta[t] = _logsumexp(transitions + (rows[t + 1] + beta[t + 1])[None, :], axis=1)
    log_z = _logsumexp(alpha[n - 1] + end, axis=0)
    out[words] = np.exp(alpha + beta - log_z)
    return out


# ---- Entities and votes ---------------------------------------------------------------------------------------------


# The schemes spans_to_tags writes (vote_entities' ``scheme``), by their nlp_tricks.data.schemes names.
_SCHEMES = {"BIO": "iob2", "BIOES": "bioes", "BILOU": "bilou", "BMES": "bmes"}


def _prefixed(tag: str) -> str:
    """``tag`` as :mod:`nlp_tricks.data.schemes` reads it: a tag without a prefix (``PER``, a model's own label) is
    inside an entity of its own type, an empty one is ``O``."""
    try:
        split_tag(tag)
    except ValueError:
        return f"I-{tag}" if tag else "O"
    return tag


def entity_spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """The entities of a tag sequence as ``(type, first word, last word)``, in seqeval's default mode (conlleval):
    :func:`nlp_tricks.data.schemes.tags_to_spans`, the one rule of every scheme (IOB1, IOB2, BIOES, BMES, BILOU).

    An entity ends before an ``O``, a ``B-`` / ``S-`` (``U-``), a change of type, and after an ``E-`` / ``S-``
    (``L-`` / ``U-``); an ``I-`` / ``E-`` that follows ``O`` or another type opens one.
    """
    return [(kind, start, end - 1) for kind, start, end in tags_to_spans([_prefixed(tag) for tag in tags])]


def tag_scheme(labels: Sequence[str]) -> str:
    """``"BIOES"`` when the labels hold ``E-`` or ``S-`` tags (``"BILOU"`` for ``L-`` / ``U-``, ``"BMES"`` for
    ``M-``), else ``"BIO"``: the scheme :func:`spans_to_tags` writes entities in."""
    prefixes = {split_tag(_prefixed(label))[0] for label in labels}
    if "M" in prefixes:
        return "BMES"
    if prefixes & {"E", "S"}:
        return "BIOES"
    if prefixes & {"L", "U"}:
        return "BILOU"
    return "BIO"


def spans_to_tags(spans: Sequence[tuple[str, int, int]], length: int, scheme: str = "BIO") -> list[str]:
    """The tags of ``length`` words holding the given non-overlapping entities ``(type, first word, last word)``, in
    ``scheme`` (BIO / IOB2, BIOES, BILOU or BMES); every other word is ``O``
    (:func:`nlp_tricks.data.schemes.spans_to_tags`)."""
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not allowed; choose 'BIO', 'BIOES', 'BILOU' or 'BMES'")
    return schemes.spans_to_tags([(kind, first, last + 1) for kind, first, last in spans], length, _SCHEMES[scheme])


def vote_entities(member_tags: Sequence[Sequence[str]], threshold: float, scheme: str = "BIO") -> list[str]:
    """The tags of one sentence by entity vote: an entity (type and both boundaries, :func:`entity_spans`) is kept
    when at least a share ``threshold`` of the members predict it (``count / members >= threshold``).

    Kept entities that overlap are resolved greedily: the one more members predict wins; on a tie the earlier, then
    the longer, then the type that sorts first (:func:`vote_spans` with ``flat=True``). The result is written in
    ``scheme`` (:func:`spans_to_tags`).
    """
    if not member_tags:
        raise ValueError("vote_entities needs at least one member")
    lengths = {len(tags) for tags in member_tags}
    if len(lengths) != 1:
        raise ValueError(f"the members' tag sequences differ in length: {sorted(lengths)}")
    members = [[(kind, first, last + 1) for kind, first, last in entity_spans(tags)] for tags in member_tags]
    chosen = vote_spans(members, threshold, flat=True)
    return spans_to_tags([(kind, start, end - 1) for kind, start, end in chosen], lengths.pop(), scheme)


def vote_spans(
    member_spans: Sequence[Sequence[tuple[str, int, int]]], threshold: float, flat: bool = False
) -> list[tuple[str, int, int]]:
    """The entities of one sentence by vote: a span ``(type, start, end exclusive)`` is kept when at least a share
    ``threshold`` of the members predict it (``count / members >= threshold``), sorted by start, end and type.

    Nested (``flat=False``), every kept span stays, as a span head predicts them. With ``flat``, kept spans that
    overlap are resolved greedily: the one more members predict wins; on a tie the earlier, then the longer, then
    the type that sorts first.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold={threshold} is not allowed; it must be in (0, 1]")
    if not member_spans:
        raise ValueError("the vote needs at least one member")
    votes: dict[tuple[str, int, int], int] = {}
    for spans in member_spans:
        for span in set(map(tuple, spans)):
            votes[span] = votes.get(span, 0) + 1
    members = len(member_spans)
    # A share compared with a tolerance: 2 of 3 members is "at least 2/3" however 2/3 was rounded.
    kept = [span for span, count in votes.items() if count / members >= threshold - 1e-9]
    if flat:
        kept.sort(key=lambda s: (-votes[s], s[1], -(s[2] - s[1]), s[0]))
        chosen, taken = [], set()
        for kind, start, end in kept:
            words = set(range(start, end))
            if not words & taken:
                chosen.append((kind, start, end))
                taken |= words
        kept = chosen
    return sorted(kept, key=lambda s: (s[1], s[2], s[0]))


def mean_span_scores(member_scores: Sequence[np.ndarray]) -> np.ndarray:
    """``(T, W, W)`` float64: per span of one sentence, the mean over the members that scored it of their span
    scores (``span_scores``' raw values, word-level: ``[t, i, j]`` scores words ``i..j`` as type ``t``).

    ``member_scores``: one ``(T, W, W)`` array per member over the sentence's own words; NaN where a member did not
    score the span (its first or last word cut by truncation, or without a sub-token, for that member's tokenizer);
    ``-inf`` below the diagonal stays ``-inf``. A span no member scored stays NaN (never predicted).

    Raw scores, not sigmoid probabilities: the span loss (multilabel categorical cross-entropy) trains each score
    against a threshold of 0, not each span's sigmoid against its label, so ``sigmoid(s)`` is no calibrated
    probability to average; the flat decoding maximises the total score, so it needs scores (``logit(mean
    sigmoid)`` saturates to infinity in floating point); and an ensemble of one model decodes exactly what that
    model predicts. The decision is the members' own, mean score > 0 (the same as mean probability > 0.5 only for
    one member).
    """
    arrays = [np.asarray(s, dtype=np.float64) for s in member_scores]
    if not arrays:
        raise ValueError("mean_span_scores needs at least one member")
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1 or len(arrays[0].shape) != 3 or arrays[0].shape[1] != arrays[0].shape[2]:
        raise ValueError(f"the members' span scores must be (types, words, words) of one shape, got {sorted(shapes)}")
    stacked = np.stack(arrays)
    scored = ~np.isnan(stacked)
    count = scored.sum(axis=0)
    total = np.where(scored, stacked, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count
    mean[count == 0] = np.nan
    return mean
