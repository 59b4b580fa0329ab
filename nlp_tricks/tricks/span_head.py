"""``span_head``: a GlobalPointer / EfficientGlobalPointer head in place of the token classifier, trained with the
multilabel categorical cross-entropy over spans and predicted as the spans scoring > 0. Its math is in
:mod:`nlp_tricks.functional.spans`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..functional.outputs import output_logits
from ..functional.spans import (
    SPAN_HEADS,
    WORD,
    add_span_head,
    check_span_labels,
    decode_spans,
    span_head_of,
    span_loss,
    span_scores,
    word_positions_of,
)
from ..trick import LossInForward
from .base import HeadLossTrick

__all__ = ["SpanHeadTrick", "SpanHeadArguments", "span_predictions"]


@dataclass
class SpanHeadArguments:
    """Span heads (GlobalPointer) for NER, replacing token tagging."""

    span_head: str | None = field(
        default=None,
        metadata={
            "help": "Named-entity recognition with a span head in place of the token classifier: 'global_pointer' "
            "(Su 2021: a query / key of span_head_size per entity type) or 'efficient_global_pointer' (one shared "
            "query / key plus a start / end bias per type: far fewer parameters with many types). It scores every "
            "span of words for every type, so entities may nest; trained with the multilabel categorical "
            "cross-entropy (one item per sentence and type), predicted as the spans scoring > 0. Labels are span "
            "rows (nlp_tricks.data.spans.SpanCollator); the head is saved with the model (config.span_head), load "
            "it with nlp_tricks.load_span_model. Default: token tagging.",
            "choices": list(SPAN_HEADS),
        },
    )
    span_head_size: int = field(
        default=64, metadata={"help": "Query / key size D of the span head, >= 1 (even with span_head_rope)."}
    )
    span_head_rope: bool = field(
        default=True,
        metadata={
            "help": "Rotary position encoding of the span head's queries and keys over word positions (the first "
            "sub-token of each word), so a span's score sees its length in words."
        },
    )
    span_flat: bool = field(
        default=False,
        metadata={
            "help": "Predict flat entities: of the spans scoring > 0, the non-overlapping set with the highest total "
            "score. Default: every span scoring > 0 (nested entities, one span with two types). Needs span_head."
        },
    )
    span_head_lr_scale: float | None = field(
        default=None,
        metadata={
            "help": "Learning-rate multiplier (> 0) of the span head alone (learning_rate x this, no layer decay). "
            "Default: the head's head_lr_scale."
        },
    )
    span_head_max_words: int = field(
        default=512,
        metadata={
            "help": "Longest sentence in words (>= 1) the span head accepts: its scores take batch x types x "
            "words^2 floats (a batch of 16 sentences of 512 words with 10 types: 168 MB, several times that with "
            "the loss and gradients). A longer sentence is refused in one line."
        },
    )


class SpanHeadTrick(HeadLossTrick):
    """``span_head``: puts the span head in the model's classifier's place; the loss (one item per sentence and
    entity type) is computed inside the model's forward by a hook, as the CRF's is, so DDP / FSDP see the whole head
    used; predictions are the decoded spans as ``(B, K, 3)`` rows ``(type, start, end exclusive)`` over words, padded
    with -100 (see :func:`span_predictions`)."""

    arguments = SpanHeadArguments
    flag = "span_head"
    order = 450  # after the CRF, which it refuses; before the loss tricks, which it replaces
    changes_loss = True

    def __init__(self, args):
        super().__init__(args)
        self.num_types: int | None = None

    @classmethod
    def enabled(cls, args) -> bool:
        return args.span_head is not None

    @staticmethod
    def validate(args) -> None:
        if args.span_head is not None and args.span_head not in SPAN_HEADS:
            raise ValueError(
                f"span_head={args.span_head!r} is not allowed; choose one of {', '.join(map(repr, SPAN_HEADS))}"
            )
        if int(args.span_head_size) != args.span_head_size or args.span_head_size < 1:
            raise ValueError(f"span_head_size={args.span_head_size} is not allowed; it must be an integer >= 1")
        if args.span_head_rope and args.span_head_size % 2:
            raise ValueError(
                f"span_head_size={args.span_head_size} is not allowed with span_head_rope=True; it must be even"
            )
        if args.span_head_lr_scale is not None and not args.span_head_lr_scale > 0:
            raise ValueError(f"span_head_lr_scale={args.span_head_lr_scale} is not allowed; it must be > 0")
        if args.span_head_max_words < 1:
            raise ValueError(f"span_head_max_words={args.span_head_max_words} is not allowed; it must be >= 1")
        if args.span_head is None and args.span_flat:
            raise ValueError("span_flat=True needs span_head (global_pointer or efficient_global_pointer)")
        if args.span_head is None and args.span_head_lr_scale is not None:
            raise ValueError(f"span_head_lr_scale={args.span_head_lr_scale} needs span_head")

    def summary(self) -> list[str]:
        args = self.args
        settings = [f"span_head={args.span_head!r}", f"span_head_size={args.span_head_size}"]
        settings += [] if args.span_head_rope else ["span_head_rope=False"]
        settings += ["span_flat=True"] if args.span_flat else []
        if args.span_head_lr_scale is not None:
            settings.append(f"span_head_lr_scale={args.span_head_lr_scale}")
        return [", ".join(settings)]

    def prepare_model(self, trainer, model: nn.Module) -> None:
        args = self.args
        # A new head is drawn under `seed`, leaving the run's random stream as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            head = add_span_head(model, args.span_head, args.span_head_size, args.span_head_rope)
        self.num_types = head.num_types
        model.config.span_flat = bool(args.span_flat)  # saved with the model: how its predictions were decoded
        self._hook = LossInForward.attach(self._hook, trainer, model, self._loss_in_forward)

    def compute_loss(self, trainer, logits, labels, num_items_in_batch=None):
        self.check_length(labels)
        return span_loss(trainer.model, logits, labels, num_items_in_batch)

    def _loss_in_forward(self, trainer, module: nn.Module, outputs, labels, num_items) -> torch.Tensor:
        self.check_length(labels)
        return span_loss(module, output_logits(outputs), labels, num_items)

    def count_items(self, trainer, labels):
        """An item is a sentence (with at least one word) and an entity type."""
        return (labels[..., 0] == WORD).any(dim=-1).sum() * self.num_types

    def check_length(self, labels: torch.Tensor) -> None:
        """The length guard: a sentence longer than ``span_head_max_words`` words is refused in one line."""
        check_span_labels(labels)
        words = int((labels[..., 0] == WORD).sum(dim=-1).max()) if labels.numel() else 0
        limit = self.args.span_head_max_words
        if words > limit:
            floats = labels.shape[0] * self.num_types * words * words
            raise ValueError(
                f"span_head: a sentence of {words} words is longer than span_head_max_words={limit}; its batch's "
                f"span scores alone take {floats * 4 / 2**20:.0f} MiB (batch x types x words^2 floats, several "
                "times that with the loss and its gradient): cut the sentences or raise span_head_max_words"
            )

    def param_group_options(self, trainer, model: nn.Module) -> dict:
        if self.args.span_head_lr_scale is None:
            return {}
        attribute = next(name for name, module in model.named_children() if module is span_head_of(model))
        return {"module_lr_scales": {attribute: self.args.span_head_lr_scale}}

    def adjust_predictions(self, trainer, inputs, logits):
        """The decoded spans of each sentence as ``(B, K, 3)`` rows (see :func:`span_predictions`)."""
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(
                "span_head prediction needs the batch's `labels` rows, which say where each word starts (entity "
                "rows may be left out); for raw text call nlp_tricks.functional.spans.span_scores and decode_spans"
            )
        return span_predictions(trainer.model, logits, labels.to(logits.device), flat=self.args.span_flat)


def span_predictions(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor, flat: bool = False) -> torch.Tensor:
    """The entities :func:`~nlp_tricks.functional.spans.decode_spans` finds, as ``(B, K, 3)`` int64 rows ``(type,
    start, end exclusive)`` over each sentence's words, padded with -100 rows (K >= 1): the Trainer pads and gathers
    such a tensor like any prediction."""
    scores = span_scores(model, logits, word_positions_of(labels))
    spans = decode_spans(scores, flat=flat)
    rows = torch.full((len(spans), max([1, *map(len, spans)]), 3), -100, dtype=torch.long)
    for b, found in enumerate(spans):
        if found:
            rows[b, : len(found)] = torch.tensor(found)
    return rows.to(logits.device)
