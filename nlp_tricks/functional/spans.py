"""Span heads for named-entity recognition: GlobalPointer and EfficientGlobalPointer, over words, flat or nested.

GlobalPointer: Su Jianlin 2021, https://kexue.fm/archives/8373 (and https://arxiv.org/abs/2208.03054);
EfficientGlobalPointer: https://kexue.fm/archives/8877. Rotary position encoding: Su et al. 2021,
https://arxiv.org/abs/2104.09864.

A span head scores every span of words ``i..j`` (``i <= j``, both inclusive in the score matrix) for every entity
type ``t``: ``s[t, i, j] = <q_t(i), k_t(j)> / sqrt(D)`` with ``q`` and ``k`` projections of the first sub-token of each
word, rotated by the word's position (RoPE, so a score depends on ``j - i`` counted in words, not sub-tokens).
GlobalPointer projects a ``q`` and a ``k`` per type (``T x 2D`` outputs); EfficientGlobalPointer shares one ``q`` /
``k`` pair between the types and adds a per-type start and end bias computed from it (``2D + 2T`` outputs): far
fewer parameters with many types. Every span with ``s > 0`` is an entity, so spans may nest or carry two types;
:func:`decode_spans` with ``flat=True`` keeps the non-overlapping set of positive spans with the highest total score
instead. Scores are float32 whatever the model's dtype, with padding and ``i > j`` set to ``-inf``.

The head is the model's classifier: :func:`add_span_head` puts it in place of a ``*ForTokenClassification`` model's
output layer, so the model's ``logits`` are the per-sub-token projections ``(B, L, P)`` and ``save_pretrained``
saves the head with the model (``config.span_head`` records it); :func:`load_span_model` loads such a folder back in
one call. :func:`span_scores` turns the logits into the word-level ``(B, T, W, W)`` scores (what an ensemble
averages), :func:`decode_spans` into entities.

Labels (what ``TricksTrainer(span_head=...)`` trains on) are ``(B, N, 3)`` integer rows, padded with -100 rows:
``(WORD, p, -1)`` says sub-token ``p`` is the first sub-token of the sentence's next word (in order: the k-th such row
is word k), ``(t, start, end)`` is a gold entity of type ``t`` over words ``start .. end - 1`` (``end`` exclusive,
counted over the word rows). :class:`nlp_tricks.data.spans.SpanCollator` builds them.
"""

from __future__ import annotations

import bisect
import math

import torch
import torch.nn.functional as F
from torch import nn

from .losses import multilabel_categorical_crossentropy
from .models import model_class_with, unwrap_model

__all__ = [
    "SPAN_HEADS",
    "WORD",
    "SpanHead",
    "GlobalPointer",
    "EfficientGlobalPointer",
    "rotary",
    "gather_words",
    "word_positions_of",
    "span_targets",
    "check_span_labels",
    "span_scores",
    "span_loss",
    "decode_spans",
    "best_flat_spans",
    "add_span_head",
    "span_head_of",
    "span_model_class",
    "load_span_model",
]

SPAN_HEADS = ("global_pointer", "efficient_global_pointer")
# The first column of a label row that marks a word's first sub-token (entity rows hold a type id >= 0 there).
WORD = -1
# The attributes a token classification model keeps its output layer in (BERT-likes: classifier; Llama-likes: score).
_HEAD_ATTRIBUTES = ("classifier", "score")


def rotary(x: torch.Tensor, positions: torch.Tensor | None = None, base: float = 10000.0) -> torch.Tensor:
    """Rotary position encoding of ``x`` ``(..., W, D)`` (``D`` even) at ``positions`` ``(W,)`` (default
    ``0..W-1``): each pair ``(x[2i], x[2i+1])`` rotated by the angle ``position * base^(-2i / D)``, so that
    ``<rotary(q)[m], rotary(k)[n]>`` depends on ``m - n`` only."""
    width, dim = x.shape[-2], x.shape[-1]
    if dim % 2:
        raise ValueError(f"rotary position encoding needs an even size, got {dim}")
    if positions is None:
        positions = torch.arange(width, device=x.device)
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.to(device=x.device, dtype=torch.float32)[:, None] * inv_freq  # (W, D/2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class SpanHead(nn.Module):
    """A span head's projection of hidden states (its ``forward``, the model's logits) and its word-level scores.

    Args:
        hidden_size (`int`): the size of the features entering the head.
        num_types (`int`): entity types T.
        head_size (`int`, defaults to 64): the size D of each query / key (even with ``rope``).
        rope (`bool`, defaults to True): rotary position encoding over word positions.
    """

    kind: str = ""

    def __init__(self, hidden_size: int, num_types: int, head_size: int = 64, rope: bool = True):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_types", num_types), ("head_size", head_size)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        if rope and head_size % 2:
            raise ValueError(f"span_head_size={head_size} is not allowed with rotary positions; it must be even")
        self.hidden_size, self.num_types, self.head_size, self.rope = hidden_size, num_types, head_size, bool(rope)

    def extra_repr(self) -> str:
        return f"num_types={self.num_types}, head_size={self.head_size}, rope={self.rope}"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The per-position projections ``(..., L, P)`` (the model's logits)."""
        return self.dense(hidden)

    def scores(self, words: torch.Tensor, word_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Span scores ``(B, T, W, W)`` in float32 from the projections of each sentence's words ``(B, W, P)``
        (:func:`gather_words`): ``[b, t, i, j]`` scores words ``i..j`` as type ``t``; ``-inf`` where ``i > j`` or
        where ``word_mask`` ``(B, W)`` is False (padding)."""
        if words.dim() != 3 or words.shape[-1] != self.dense.out_features:
            raise ValueError(
                f"{type(self).__name__} scores word projections (batch, words, {self.dense.out_features}), got "
                f"{tuple(words.shape)}"
            )
        # Scores and masks in float32 whatever autocast or the weights' dtype say: a bfloat16 score has ~3 digits.
        with torch.autocast(words.device.type, enabled=False):
            scores = self._scores(words.float())
        width = words.shape[1]
        valid = torch.ones(width, width, dtype=torch.bool, device=words.device).triu()
        if word_mask is not None:
            word_mask = word_mask.to(words.device).bool()
            valid = valid & word_mask[:, None, :, None] & word_mask[:, None, None, :]
        return scores.masked_fill(~valid, -math.inf)

    def _query_key_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``<q_i, k_j> / sqrt(D)`` of ``(B, H, W, D)`` queries and keys, rotated first with ``rope``."""
        if self.rope:
            q, k = rotary(q), rotary(k)
        return q @ k.transpose(-1, -2) / math.sqrt(self.head_size)


class GlobalPointer(SpanHead):
    """GlobalPointer: a query and a key of size D per type, ``s[t, i, j] = <q_t(i), k_t(j)> / sqrt(D)``; one
    ``hidden -> T x 2D`` layer."""

    kind = "global_pointer"

    def __init__(self, hidden_size: int, num_types: int, head_size: int = 64, rope: bool = True):
        super().__init__(hidden_size, num_types, head_size, rope)
        self.dense = nn.Linear(hidden_size, num_types * 2 * head_size)

    def _scores(self, words: torch.Tensor) -> torch.Tensor:
        batch, width, _ = words.shape
        qk = words.view(batch, width, self.num_types, 2, self.head_size).permute(3, 0, 2, 1, 4)  # (2, B, T, W, D)
        return self._query_key_scores(qk[0], qk[1])


class EfficientGlobalPointer(SpanHead):
    """EfficientGlobalPointer: one query / key pair of size D shared by the types, plus a start and an end bias per
    type read from it: ``s[t, i, j] = <q(i), k(j)> / sqrt(D) + (a_t . [q(i); k(i)] + b_t . [q(j); k(j)]) / 2``;
    layers ``hidden -> 2D`` and ``2D -> 2T``."""

    kind = "efficient_global_pointer"

    def __init__(self, hidden_size: int, num_types: int, head_size: int = 64, rope: bool = True):
        super().__init__(hidden_size, num_types, head_size, rope)
        self.dense = nn.Linear(hidden_size, 2 * head_size)
        self.type_dense = nn.Linear(2 * head_size, 2 * num_types)

    def _scores(self, words: torch.Tensor) -> torch.Tensor:
        q, k = words[..., : self.head_size], words[..., self.head_size :]
        shared = self._query_key_scores(q.unsqueeze(1), k.unsqueeze(1))  # (B, 1, W, W)
        bias = F.linear(words, self.type_dense.weight.float(), self.type_dense.bias.float()) / 2  # (B, W, 2T)
        start, end = bias[..., : self.num_types], bias[..., self.num_types :]
        return shared + start.transpose(1, 2).unsqueeze(-1) + end.transpose(1, 2).unsqueeze(-2)


SPAN_HEAD_CLASSES = {cls.kind: cls for cls in (GlobalPointer, EfficientGlobalPointer)}


# ---- Words and labels ----------------------------------------------------------------------------------------------


def gather_words(projections: torch.Tensor, word_positions: torch.Tensor) -> torch.Tensor:
    """The projections ``(B, L, P)`` at each word's first sub-token, ``word_positions`` ``(B, W)`` (-1 past a
    sentence's words): ``(B, W, P)``, zero rows at -1."""
    index = word_positions.to(projections.device).clamp(min=0)
    words = projections.gather(1, index.unsqueeze(-1).expand(-1, -1, projections.shape[-1]))
    return words * (word_positions >= 0).to(projections.device, words.dtype).unsqueeze(-1)


def word_positions_of(labels: torch.Tensor) -> torch.Tensor:
    """The first sub-token of each word from ``(B, N, 3)`` label rows: ``(B, W)`` positions in word order, -1 past
    each sentence's words (W: the most words of a sentence in the batch)."""
    check_span_labels(labels)
    is_word = labels[..., 0] == WORD
    counts = is_word.sum(dim=1)
    # A stable sort of "not a word row" puts the word rows first without reordering them.
    order = torch.argsort((~is_word).to(torch.int8), dim=1, stable=True)[
        :, : int(counts.max()) if counts.numel() else 0
    ]
    positions = labels[..., 1].gather(1, order)
    return torch.where(torch.arange(order.shape[1], device=labels.device) < counts[:, None], positions, -1)


def span_targets(labels: torch.Tensor, num_types: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(word_positions, targets)`` of ``(B, N, 3)`` label rows: the ``(B, W)`` positions of
    :func:`word_positions_of` and ``(B, T, W, W)`` targets (1: a gold span, 0: any other span ``i <= j`` of the
    sentence's words, -100: ``i > j`` and padding). A gold span outside its sentence raises ``ValueError``."""
    positions = word_positions_of(labels)
    batch, width = positions.shape
    words = (positions >= 0).sum(dim=1)
    device = labels.device
    valid = torch.ones(width, width, dtype=torch.bool, device=device).triu()
    in_sentence = torch.arange(width, device=device) < words[:, None]
    valid = valid & in_sentence[:, None, :, None] & in_sentence[:, None, None, :]
    targets = torch.where(valid.expand(batch, num_types, width, width), 0, -100)
    rows, index = (labels[..., 0] >= 0).nonzero(as_tuple=True)
    if rows.numel():
        kind, start, end = labels[rows, index].unbind(-1)
        bad = (kind >= num_types) | (start < 0) | (end <= start) | (end > words[rows])
        if bad.any():
            k = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"span label row {labels[rows[k], index[k]].tolist()} of sentence {int(rows[k])} is not a span of "
                f"its {int(words[rows[k]])} words and {num_types} types (type, start, end exclusive)"
            )
        targets[rows, kind, start, end - 1] = 1
    return positions, targets


def check_span_labels(labels: torch.Tensor) -> None:
    """Refuse labels that are not ``(B, N, 3)`` integer rows (token tags, say) with one line."""
    if labels.dim() != 3 or labels.shape[-1] != 3 or labels.is_floating_point():
        raise ValueError(
            f"span heads train on integer label rows (batch, rows, 3) (see nlp_tricks.data.spans.SpanCollator), "
            f"got {labels.dtype} labels of shape {tuple(labels.shape)}; token tags need the token classifier instead"
        )


# ---- Scores, loss, decoding ----------------------------------------------------------------------------------------


def span_head_of(model: nn.Module) -> SpanHead:
    """The :class:`SpanHead` of a model (unwrapping DataParallel / DDP), ``ValueError`` if it has none."""
    model = unwrap_model(model)
    for attribute in _HEAD_ATTRIBUTES:
        head = getattr(model, attribute, None)
        if isinstance(head, SpanHead):
            return head
    raise ValueError(f"{type(model).__name__} has no span head; attach one with add_span_head(model, ...)")


def span_scores(model: nn.Module, logits: torch.Tensor, word_positions: torch.Tensor) -> torch.Tensor:
    """The word-level span scores ``(B, T, W, W)`` (float32, ``-inf`` off the sentence and below the diagonal) of a
    span model's ``logits`` ``(B, L, P)``, given the first sub-token of each word ``(B, W)`` (-1 past a sentence's
    words). An ensemble averages these; :func:`decode_spans` turns them into entities.

    Example::

        model = load_span_model("outputs/ner").eval()
        enc = tokenizer(words, is_split_into_words=True, return_tensors="pt")
        first = [i for i, w in enumerate(enc.word_ids()) if w is not None and w not in enc.word_ids()[:i]]
        scores = span_scores(model, model(**enc).logits, torch.tensor([first]))
        entities = decode_spans(scores)[0]          # [(type id, start word, end word exclusive), ...]
    """
    words = gather_words(logits, word_positions)
    return span_head_of(model).scores(words, word_positions >= 0)


def span_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """The multilabel categorical cross-entropy of a span model's ``logits`` against ``(B, N, 3)`` label rows: one
    item per sentence (with a word) and type, summed and divided by ``num_items_in_batch`` (or their mean)."""
    head = span_head_of(model)
    positions, targets = span_targets(labels.to(logits.device), head.num_types)
    if positions.shape[1] == 0:  # no sentence with a word: no item, no loss (and a graph for the backward)
        return logits.sum() * 0.0
    scores = head.scores(gather_words(logits, positions), positions >= 0)
    return multilabel_categorical_crossentropy(
        scores.flatten(-2), targets.flatten(-2), num_items_in_batch=num_items_in_batch
    )


@torch.no_grad()
def decode_spans(scores: torch.Tensor, *, flat: bool = False) -> list[list[tuple[int, int, int]]]:
    """The entities of ``(B, T, W, W)`` span scores, per sentence: ``(type, start, end)`` with ``end`` exclusive,
    sorted by start, end and type.

    Every span with a score > 0 (nested spans and one span with two types allowed); with ``flat``, the
    non-overlapping set of those with the highest total score (:func:`best_flat_spans`): the most probable flat
    labelling when each score is a span's log-odds, as the loss trains it.
    """
    found = (scores > 0).nonzero().tolist()
    values = scores[scores > 0].tolist()
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(scores.shape[0])]
    candidates: list[list[tuple[int, int, int, float]]] = [[] for _ in range(scores.shape[0])]
    for (b, t, i, j), value in zip(found, values):
        candidates[b].append((t, i, j + 1, value))
    for b, spans in enumerate(candidates):
        kept = best_flat_spans(spans) if flat else [span[:3] for span in spans]
        out[b] = sorted(kept, key=lambda span: (span[1], span[2], span[0]))
    return out


def best_flat_spans(spans: list[tuple[int, int, int, float]]) -> list[tuple[int, int, int]]:
    """Of ``(type, start, end exclusive, score)`` spans, the pairwise non-overlapping subset with the highest total
    score (weighted interval scheduling, exact; O(n log n))."""
    spans = sorted(spans, key=lambda s: (s[2], s[1], s[0]))
    ends = [s[2] for s in spans]
    best = [0.0] * (len(spans) + 1)  # best[k]: the best total of the first k spans
    take = [False] * len(spans)
    before = []
    for k, (_, start, _, score) in enumerate(spans):
        before.append(bisect.bisect_right(ends, start, 0, k))  # the spans that end at or before this one starts
        with_it = score + best[before[k]]
        take[k] = with_it > best[k]
        best[k + 1] = with_it if take[k] else best[k]
    kept, k = [], len(spans)
    while k > 0:
        if take[k - 1]:
            kept.append(spans[k - 1][:3])
            k = before[k - 1]
        else:
            k -= 1
    return kept[::-1]


# ---- transformers models -------------------------------------------------------------------------------------------


def _output_layer(model: nn.Module) -> tuple[str, nn.Module]:
    """The attribute name and module of a token classification model's output layer (or span head)."""
    num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    for attribute in _HEAD_ATTRIBUTES:
        layer = getattr(model, attribute, None)
        if isinstance(layer, SpanHead) or (isinstance(layer, nn.Linear) and layer.out_features == num_labels):
            return attribute, layer
    raise ValueError(
        f"span heads replace a token classification model's output layer (an nn.Linear with config.num_labels="
        f"{num_labels} outputs named {' or '.join(_HEAD_ATTRIBUTES)}); {type(model).__name__} has none"
    )


def add_span_head(model: nn.Module, head_type: str, head_size: int = 64, rope: bool = True) -> SpanHead:
    """Put a span head over ``model.config.num_labels`` entity types in place of a ``*ForTokenClassification`` model's
    output layer (``classifier``), and return it; a model that has the same head already keeps it.

    The model's ``logits`` become the head's projections; ``save_pretrained`` then writes the head with the weights
    and ``config.span_head`` / ``span_head_size`` / ``span_head_rope``, which :func:`load_span_model` reads back. The
    head is initialised as the model initialises its layers (``_init_weights``), but for EfficientGlobalPointer's type
    layer (``type_dense``: Glorot-uniform, zero bias, as in the reference implementation), drawn from the CPU random
    state.

    Args:
        head_type (`str`): ``"global_pointer"`` or ``"efficient_global_pointer"``.
        head_size (`int`, defaults to 64): the query / key size D.
        rope (`bool`, defaults to True): rotary position encoding over word positions.
    """
    if head_type not in SPAN_HEAD_CLASSES:
        raise ValueError(f"span_head={head_type!r} is not allowed; choose one of {', '.join(map(repr, SPAN_HEADS))}")
    attribute, layer = _output_layer(model)
    config = model.config
    if isinstance(layer, SpanHead):
        found = (layer.kind, layer.head_size, layer.rope, layer.num_types)
        if found != (head_type, head_size, bool(rope), config.num_labels):
            raise ValueError(
                f"{type(model).__name__} holds a {layer.kind} span head (span_head_size={layer.head_size}, "
                f"span_head_rope={layer.rope}, {layer.num_types} types), not the {head_type} one asked for "
                f"(span_head_size={head_size}, span_head_rope={bool(rope)}, {config.num_labels} types)"
            )
        return layer
    head = SPAN_HEAD_CLASSES[head_type](layer.in_features, config.num_labels, head_size, rope)
    init = getattr(model, "_init_weights", None)
    if init is not None:
        for module in head.modules():
            if isinstance(module, nn.Linear):
                init(module)
    if isinstance(head, EfficientGlobalPointer):
        # The type biases are a layer on top of another (hidden -> 2D -> 2T): at an encoder's init (std 0.02) both
        # are small, the product carries almost no type signal and its gradient almost none either, so the head
        # learnt nothing in the demo's first epoch (validation F1 0; 0.508 with this init). Glorot-uniform for the
        # second layer, the initialiser of the reference implementation (bert4keras, Keras' Dense default).
        nn.init.xavier_uniform_(head.type_dense.weight)
        nn.init.zeros_(head.type_dense.bias)
    # Drawn on the CPU, then moved: the same weights from the same CPU random state on any device.
    head.to(device=layer.weight.device, dtype=layer.weight.dtype)
    setattr(model, attribute, head)
    config.span_head, config.span_head_size, config.span_head_rope = head_type, int(head_size), bool(rope)
    return head


_SPAN_CLASSES: dict[type, type] = {}


def span_model_class(model_class: type) -> type:
    """A subclass of ``model_class`` (a ``*ForTokenClassification`` ``PreTrainedModel``) built with the span head its
    config records, so its ``from_pretrained`` loads the head's weights with the rest. Built once per class."""

    def attach(model, config):
        attribute, layer = _output_layer(model)
        head_class = SPAN_HEAD_CLASSES[config.span_head]
        head = head_class(layer.in_features, config.num_labels, config.span_head_size, config.span_head_rope)
        setattr(model, attribute, head)

    return model_class_with(model_class, "SpanHead", attach, _SPAN_CLASSES, __name__)


def load_span_model(pretrained_model_name_or_path, **kwargs) -> nn.Module:
    """Load a token classification model saved with its span head (``save_pretrained`` after :func:`add_span_head`,
    a TricksTrainer ``span_head=...`` output or checkpoint) in one call, strictly, without remote code.

    ``kwargs`` go to ``from_pretrained`` (``dtype``, ``revision``, ``config``, ...). Raises ``ValueError`` if the
    folder holds no span head.

    Example::

        from nlp_tricks import load_span_model
        model = load_span_model("outputs/ner").eval()
        scores = span_scores(model, model(**enc).logits, word_positions)   # see span_scores
    """
    from transformers import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, AutoConfig

    config_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir") if k in kwargs}
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(pretrained_model_name_or_path, **config_kwargs)
    head_type = getattr(config, "span_head", None)
    if head_type not in SPAN_HEAD_CLASSES:
        raise ValueError(
            f"{pretrained_model_name_or_path} was not saved with a span head (its config has span_head="
            f"{head_type!r}); load it with AutoModelForTokenClassification.from_pretrained, or train it with span_head"
        )
    if type(config) not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING:
        raise ValueError(
            f"{pretrained_model_name_or_path}: {type(config).__name__} has no token classification model in "
            "transformers; build it yourself, call add_span_head(model, ...) and "
            "load_state_dict_portable(model, folder)"
        )
    model_class = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[type(config)]
    model, info = span_model_class(model_class).from_pretrained(
        pretrained_model_name_or_path, config=config, output_loading_info=True, **kwargs
    )
    attribute = _output_layer(model)[0]
    missing = sorted(k for k in info.get("missing_keys", ()) if k.startswith(f"{attribute}."))
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()))
    if missing or mismatched:
        raise ValueError(
            f"{pretrained_model_name_or_path} does not hold the weights of its {head_type} head "
            f"({', '.join(missing or mismatched)} {'missing' if missing else 'of another shape'})"
        )
    return model
