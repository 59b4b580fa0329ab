"""``loss_type`` (cross-entropy, focal, label smoothing, DFT, Poly-1), ``temperature`` and ``class_weights``: the
configured loss on the logits.

Each loss type is one :class:`LossEntry` of :data:`LOSS_TABLE`: its function (in
:mod:`nlp_tricks.functional.losses`), its own fields of :class:`LossArguments` and what it composes with. The loss
(:meth:`LossTypeTrick.compute_loss`), the validation and the summary (the model card's lines) read the table; adding a
loss is its function, its entry and its fields (docs/tricks.md, "Adding a loss").

A loss's own field counts as set when its value differs from its default: one set while another ``loss_type`` is
chosen is refused, naming the field, its loss and the chosen one (a field given at its default cannot be told from
one left out, and changes nothing).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..functional.losses import (
    balanced_class_weights,
    cross_entropy,
    dft_loss,
    focal_alpha_weights,
    focal_loss,
    label_smoothing_cross_entropy,
    parse_class_weights,
    poly1_loss,
)
from ..functional.models import unwrap_model
from ..trick import LossBatch
from .base import BuiltInTrick

__all__ = ["LossTypeTrick", "LossFunction", "LossArguments", "LossEntry", "LOSS_TABLE", "LOSS_TYPES"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossEntry:
    """One ``loss_type``: its function and what it composes with.

    Attributes:
        function: the loss, ``function(logits, labels, *, num_items_in_batch=None, **keywords)``, in
            :mod:`nlp_tricks.functional.losses` (logits ``(N, C)`` or ``(B, L, C)``, a sum over
            ``num_items_in_batch`` when given, so gradient accumulation is exact).
        help: what it is, for ``--loss_type``'s help (its paper, its fields).
        fields: its own fields of :class:`LossArguments`; one set (not at its default) is refused with another loss.
        keywords: ``keywords(args, class_names) -> dict``: its own fields as the function's keywords
            (``class_names``: the model's labels in id order, for a field that names classes).
        check: ``check(args)`` raises ``ValueError`` naming an own field whose value it cannot take.
        smoothing: the function's keyword that takes ``label_smoothing_factor``; ``None``: a factor > 0 is refused.
        needs_smoothing: its smoothing mass is ``label_smoothing_factor``, refused at 0.
        class_weights: the field its per-class weights come from (``"class_weights"``, or an own field);
            ``None``: it takes none and ``class_weights`` is refused.
        weight: the function's keyword those weights go to; the mean divides by the counted items' weights (as
            ``F.cross_entropy(weight=...)``), so the trainer counts a step's items by them.
        temperature: ``temperature`` divides the logits first; ``False``: a temperature other than 1 is refused.
        chunked: the function takes an :class:`~nlp_tricks.functional.chunked_loss.LMHeadLogits` (a function of each
            item's log-sum-exp, target logit and mean logit): a causal LM's loss is then taken in chunks from the last
            hidden state; ``False``: on the full logits.
    """

    function: Callable[..., torch.Tensor]
    help: str
    fields: tuple[str, ...] = ()
    keywords: Callable[..., dict] | None = None
    check: Callable[..., None] | None = None
    smoothing: str | None = None
    needs_smoothing: bool = False
    class_weights: str | None = None
    weight: str = "weight"
    temperature: bool = True
    chunked: bool = True


def _focal_keywords(args, class_names: list[str]) -> dict:
    alpha = None if args.focal_alpha is None else focal_alpha_weights(args.focal_alpha, class_names)
    return {"gamma": args.focal_gamma, "alpha": alpha}


def _check_focal(args) -> None:
    if args.focal_gamma < 0:
        raise ValueError(f"focal_gamma={args.focal_gamma} is not allowed; it must be >= 0")
    if args.focal_alpha is not None and (len(args.focal_alpha) == 0 or any(a < 0 for a in args.focal_alpha)):
        raise ValueError(
            f"focal_alpha={args.focal_alpha} is not allowed; give one value in [0, 1] or one weight >= 0 per class"
        )


def _check_poly1(args) -> None:
    if not args.poly1_epsilon >= -1:
        raise ValueError(
            f"poly1_epsilon={args.poly1_epsilon} is not allowed; it must be >= -1 (below, the loss rises again as the "
            "target's probability nears 1)"
        )


#: The loss types, by ``loss_type``: the table the loss, the validation and the summary read.
LOSS_TABLE: dict[str, LossEntry] = {
    "ce": LossEntry(
        cross_entropy,
        "cross-entropy; label_smoothing_factor > 0 smooths it",
        smoothing="label_smoothing",
        class_weights="class_weights",
    ),
    "focal": LossEntry(
        focal_loss,
        "Lin et al. 2017, see focal_gamma / focal_alpha",
        fields=("focal_gamma", "focal_alpha"),
        keywords=_focal_keywords,
        check=_check_focal,
        class_weights="focal_alpha",
        weight="alpha",
    ),
    "label_smoothing": LossEntry(
        label_smoothing_cross_entropy,
        "Szegedy et al. 2016, smoothing mass from label_smoothing_factor",
        smoothing="epsilon",
        needs_smoothing=True,
        class_weights="class_weights",
    ),
    "dft": LossEntry(
        dft_loss,
        "dynamic fine-tuning, Wu et al. 2025: each token's cross-entropy weighted by its own probability, held "
        "constant",
    ),
    "poly1": LossEntry(
        poly1_loss,
        "Poly-1, Leng et al. 2022: cross-entropy + poly1_epsilon * (1 - p_target); label_smoothing_factor smooths "
        "both terms, class_weights weigh them",
        fields=("poly1_epsilon",),
        keywords=lambda args, class_names: {"epsilon": args.poly1_epsilon},
        check=_check_poly1,
        smoothing="label_smoothing",
        class_weights="class_weights",
    ),
}

LOSS_TYPES = tuple(LOSS_TABLE)


def _names(takes: Callable[[LossEntry], bool]) -> str:
    """The loss types whose entry ``takes`` something, as ``'ce', 'label_smoothing' or 'poly1'``."""
    names = [repr(name) for name, entry in LOSS_TABLE.items() if takes(entry)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _takes_class_weights(entry: LossEntry) -> bool:
    return entry.class_weights == "class_weights"


def _loss_type_help() -> str:
    kinds = [f"{name!r} ({entry.help})" for name, entry in LOSS_TABLE.items()]
    return f"Training loss on the logits: {', '.join(kinds[:-1])} or {kinds[-1]}."


@dataclass
class LossArguments:
    """The configured loss (``label_smoothing_factor`` is ``TrainingArguments``')."""

    loss_type: str = field(default="ce", metadata={"help": _loss_type_help(), "choices": list(LOSS_TYPES)})
    focal_gamma: float = field(
        default=2.0, metadata={"help": "Focal loss focusing parameter gamma >= 0 (0 gives cross-entropy)."}
    )
    focal_alpha: list[float] | None = field(
        default=None,
        metadata={
            "help": "Focal loss class weights, a weighted mean like cross_entropy's `weight`: one value a (as in "
            "Lin et al.: a for every class but the background 'O', 1 - a for it; e.g. --focal_alpha 0.25), or one "
            "weight per class in the order of the model's id2label (the recipes: the sorted training labels; a wrong "
            "count is an error that prints the order). Default: none."
        },
    )
    poly1_epsilon: float = field(
        default=1.0,
        metadata={
            "help": "Poly-1 (loss_type 'poly1'): the weight epsilon >= -1 of the added (1 - p_target) term; 0 gives "
            "cross-entropy, > 0 keeps a larger gradient on confident items, < 0 a smaller one (Leng et al. 2022: 1 "
            "for a first try, then tune per task)."
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "Divide the logits by this temperature (> 0) before any loss. 1.0 leaves them as they are."},
    )

    chunked_lm_loss: bool = field(
        default=False,
        metadata={
            "help": "Causal LMs with every loss trick off: compute the cross-entropy from the last hidden state "
            "through the LM head in chunks of tokens, skipping ignored positions (as a loss trick does), instead of "
            "the model's own loss on the full logits. It never holds the (tokens, vocab) logits and skips the head's "
            "work on prompt and padding tokens; fused kernels of the model's own loss (use_liger_kernel) then do "
            "not run. See docs/decoder_only.md."
        },
    )
    class_weights: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Per-class weights of the loss (loss_type {_names(_takes_class_weights)}), one per label "
            "(e.g. --class_weights 1 3 3), or 'balanced': n_samples / (n_classes * count) from the training labels. "
            "The loss is a weighted mean like F.cross_entropy(weight=...), over the whole accumulated batch."
        },
    )


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LossArguments)}


def _is_set(args, name: str) -> bool:
    """Whether a loss's own field was set: its value differs from its default."""
    return getattr(args, name) != _DEFAULTS[name]


class LossTypeTrick(BuiltInTrick):
    """``loss_type`` on ``logits / temperature`` (float32), weighted by ``class_weights``: the last trick asked for
    the loss, so it is always there (plain cross-entropy when nothing is set). What each loss takes is its
    :data:`LOSS_TABLE` entry."""

    arguments = LossArguments
    order = 800
    changes_loss = True

    def __init__(self, args):
        self.args = args
        self.class_weights: torch.Tensor | None = None

    @classmethod
    def enabled(cls, args) -> bool:
        return True

    @property
    def entry(self) -> LossEntry:
        return LOSS_TABLE[self.args.loss_type]

    @property
    def needs_logits(self) -> bool:
        """The trainer hands it the full logits or, for a causal LM whose loss takes them, an LMHeadLogits."""
        return not self.entry.chunked

    @staticmethod
    def validate(args) -> None:
        entry = LOSS_TABLE.get(args.loss_type)
        if entry is None:
            raise ValueError(
                f"loss_type={args.loss_type!r} is not allowed; choose one of {', '.join(map(repr, LOSS_TYPES))}"
            )
        _refuse_foreign_fields(args, entry)
        if entry.check is not None:
            entry.check(args)
        if args.temperature <= 0:
            raise ValueError(f"temperature={args.temperature} is not allowed; it must be > 0")
        if not entry.temperature and args.temperature != 1.0:
            raise ValueError(
                f"temperature applies to loss_type {_names(lambda e: e.temperature)}, not {args.loss_type!r}"
            )
        _validate_smoothing(args, entry)
        args.class_weights = parse_class_weights(args.class_weights, name="class_weights")
        if args.class_weights is not None and not _takes_class_weights(entry):
            own = (
                f"; {args.loss_type} takes its class weights from {entry.class_weights}" if entry.class_weights else ""
            )
            raise ValueError(
                f"class_weights apply to loss_type {_names(_takes_class_weights)}, not {args.loss_type!r}{own}"
            )

    def summary(self) -> list[str]:
        args, settings = self.args, []
        if _is_set(args, "loss_type"):
            settings.append(f"loss_type={args.loss_type!r}")
        settings += [f"{name}={getattr(args, name)!r}" for name in self.entry.fields if _is_set(args, name)]
        if _smoothing(args) > 0:
            settings.append(f"label_smoothing_factor={_smoothing(args)}")
        if args.temperature != 1.0:
            settings.append(f"temperature={args.temperature}")
        if args.class_weights is not None:
            settings.append(f"class_weights={args.class_weights!r}")
        return settings

    def is_models_own_loss(self) -> bool:
        """Whether the loss is the one a model computes from its labels: cross-entropy on the logits as they are
        (nothing to summarise)."""
        return not self.summary()

    def setup(self, trainer) -> None:
        self.class_weights = self.resolve_class_weights(trainer)

    def resolve_class_weights(self, trainer) -> torch.Tensor | None:
        """``args.class_weights`` as a float32 (C,) tensor; 'balanced' is computed from the training labels."""
        weights = self.args.class_weights
        if weights is None:
            return None
        config = getattr(unwrap_model(trainer.model), "config", None)
        num_labels = getattr(config, "num_labels", None)
        if weights == "balanced":
            labels = _dataset_labels(trainer.train_dataset)
            if labels is None or num_labels is None:
                raise ValueError(
                    "class_weights='balanced' counts the `labels` of the training dataset and needs the model's "
                    "config.num_labels; pass train_dataset (with a `labels` column) or give the weights as numbers"
                )
            weights = balanced_class_weights(labels, num_labels)
            logger.info(f"class_weights='balanced': {[round(w, 4) for w in weights]}")
        elif num_labels is not None and len(weights) != num_labels:
            id2label = getattr(config, "id2label", None) or {}
            order = ", ".join(f"{i}={id2label.get(i, i)}" for i in range(num_labels))
            raise ValueError(
                f"class_weights has {len(weights)} weights for {num_labels} classes; give one weight per class in "
                f"this order: {order}"
            )
        return torch.tensor(weights, dtype=torch.float32, device=trainer.args.device)

    def prepare_loss_batch(self, trainer, batch: LossBatch) -> LossBatch:
        if batch.teacher_logits is not None and self.class_weights is not None:
            raise ValueError("class_weights do not apply to batches with teacher_logits (distillation)")
        return batch

    def compute_loss(self, trainer, logits, labels, num_items_in_batch=None):
        args = self.args
        if args.temperature != 1.0:
            logits = logits / args.temperature
            if trainer.loss_context is not None and torch.is_tensor(logits):
                trainer.loss_context.logits = logits  # the logits the loss used
        keywords = self.loss_keywords(trainer)
        return self.entry.function(logits, labels, num_items_in_batch=num_items_in_batch, **keywords)

    def loss_keywords(self, trainer) -> dict:
        """The keywords of the entry's function: its own fields, ``label_smoothing_factor``, the class weights."""
        args, entry = self.args, self.entry
        keywords = {} if entry.keywords is None else entry.keywords(args, _class_names(trainer))
        if entry.smoothing is not None:
            keywords[entry.smoothing] = _smoothing(args)
        if _takes_class_weights(entry):
            keywords[entry.weight] = self.class_weights
        return keywords

    def count_items(self, trainer, labels):
        """With class weights (or focal loss's ``focal_alpha``) a position weighs its class's weight: the divisor is
        the weight sum, as in ``F.cross_entropy(weight=...)``."""
        weight = None if self.entry.class_weights is None else self.loss_keywords(trainer).get(self.entry.weight)
        if weight is None:
            return None
        weight = torch.as_tensor(weight, dtype=torch.float32, device=labels.device)
        return weight[labels.clamp(min=0)].mul(labels.ne(-100)).sum()


def _refuse_foreign_fields(args, chosen: LossEntry) -> None:
    """A loss's own field set (not at its default) while another loss is chosen: refused in one line."""
    for name, entry in LOSS_TABLE.items():
        for own in entry.fields:
            if own not in chosen.fields and _is_set(args, own):
                raise ValueError(
                    f"{own}={getattr(args, own)!r} is a field of loss_type={name!r}, not of the chosen "
                    f"loss_type={args.loss_type!r}; leave it at its default ({_DEFAULTS[own]!r}) or choose "
                    f"loss_type={name!r}"
                )


def _validate_smoothing(args, entry: LossEntry) -> None:
    smoothing = _smoothing(args)
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"label_smoothing_factor={smoothing} is not allowed; it must be in [0, 1)")
    if entry.needs_smoothing and smoothing == 0:
        raise ValueError(
            f"loss_type={args.loss_type!r} takes its smoothing mass from label_smoothing_factor, which is 0; "
            "set label_smoothing_factor in (0, 1), e.g. 0.1"
        )
    if entry.smoothing is None and smoothing > 0:
        raise ValueError(
            f"label_smoothing_factor applies to loss_type {_names(lambda e: e.smoothing is not None)}, not "
            f"{args.loss_type!r}; set it to 0"
        )


def _class_names(trainer) -> list[str]:
    """The model's class names in id order (``config.id2label``; none without one)."""
    config = getattr(unwrap_model(trainer.model), "config", None)
    id2label = getattr(config, "id2label", None) or {}
    return [str(id2label[i]) for i in sorted(id2label)]


def _dataset_labels(dataset):
    """The ``labels`` of every item of a map-style dataset (a ``datasets.Dataset`` column at once), or ``None``."""
    if dataset is None:
        return None
    if "labels" in (getattr(dataset, "column_names", None) or ()):
        return dataset["labels"]
    try:
        return [dataset[i]["labels"] for i in range(len(dataset))]
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None


def _smoothing(args) -> float:
    """``label_smoothing_factor`` (a ``TrainingArguments`` field; 0 where the arguments have none)."""
    return getattr(args, "label_smoothing_factor", 0.0)


LossFunction = LossTypeTrick  # its name before the built-ins were named <Flag>Trick
