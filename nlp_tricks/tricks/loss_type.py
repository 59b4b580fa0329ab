"""``loss_type`` (cross-entropy, focal, label smoothing, DFT), ``temperature`` and ``class_weights``: the configured
loss on the logits. Its math is in :mod:`nlp_tricks.functional.losses`."""

from __future__ import annotations

import logging
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
)
from ..trick import LossBatch
from .base import BuiltInTrick

__all__ = ["LossTypeTrick", "LossFunction", "LossArguments", "LOSS_TYPES"]

logger = logging.getLogger(__name__)

LOSS_TYPES = ("ce", "focal", "label_smoothing", "dft")


@dataclass
class LossArguments:
    """The configured loss (``label_smoothing_factor`` is ``TrainingArguments``')."""

    loss_type: str = field(
        default="ce",
        metadata={
            "help": "Training loss on the logits: 'ce' (cross-entropy; label_smoothing_factor > 0 smooths it), "
            "'focal' (Lin et al. 2017, see focal_gamma / focal_alpha), 'label_smoothing' "
            "(Szegedy et al. 2016, smoothing mass from label_smoothing_factor) or 'dft' (dynamic fine-tuning, Wu et "
            "al. 2025: each token's cross-entropy weighted by its own probability, held constant).",
            "choices": list(LOSS_TYPES),
        },
    )
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
            "help": "Per-class weights of the cross-entropy (loss_type 'ce' or 'label_smoothing'), one per label "
            "(e.g. --class_weights 1 3 3), or 'balanced': n_samples / (n_classes * count) from the training labels. "
            "The loss is a weighted mean like F.cross_entropy(weight=...), over the whole accumulated batch."
        },
    )


class LossTypeTrick(BuiltInTrick):
    """``loss_type`` on ``logits / temperature`` (float32), weighted by ``class_weights``: the last trick asked for
    the loss, so it is always there (plain cross-entropy when nothing is set)."""

    arguments = LossArguments
    order = 800
    changes_loss = True
    needs_logits = False  # the trainer hands it the full logits or, for a causal LM, an LMHeadLogits

    def __init__(self, args):
        self.args = args
        self.class_weights: torch.Tensor | None = None

    @classmethod
    def enabled(cls, args) -> bool:
        return True

    @staticmethod
    def validate(args) -> None:
        if args.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"loss_type={args.loss_type!r} is not allowed; choose one of {', '.join(map(repr, LOSS_TYPES))}"
            )
        if args.focal_gamma < 0:
            raise ValueError(f"focal_gamma={args.focal_gamma} is not allowed; it must be >= 0")
        if args.focal_alpha is not None:
            if args.loss_type != "focal":
                raise ValueError(f"focal_alpha is only used with loss_type='focal', not {args.loss_type!r}")
            if len(args.focal_alpha) == 0 or any(a < 0 for a in args.focal_alpha):
                raise ValueError(
                    f"focal_alpha={args.focal_alpha} is not allowed; give one value in [0, 1] or one weight >= 0 per "
                    "class"
                )
        if args.temperature <= 0:
            raise ValueError(f"temperature={args.temperature} is not allowed; it must be > 0")
        if not 0.0 <= _smoothing(args) < 1.0:
            raise ValueError(f"label_smoothing_factor={_smoothing(args)} is not allowed; it must be in [0, 1)")
        if args.loss_type == "label_smoothing" and _smoothing(args) == 0:
            raise ValueError(
                "loss_type='label_smoothing' takes its smoothing mass from label_smoothing_factor, which is 0; "
                "set label_smoothing_factor in (0, 1), e.g. 0.1"
            )
        if args.loss_type in ("focal", "dft") and _smoothing(args) > 0:
            raise ValueError(
                f"label_smoothing_factor applies to loss_type 'ce' or 'label_smoothing', not {args.loss_type!r}; set "
                "it to 0"
            )
        args.class_weights = parse_class_weights(args.class_weights, name="class_weights")
        if args.class_weights is not None and args.loss_type not in ("ce", "label_smoothing"):
            raise ValueError(
                f"class_weights apply to loss_type 'ce' or 'label_smoothing', not {args.loss_type!r}; focal loss "
                "takes its class weights from focal_alpha"
            )

    def summary(self) -> list[str]:
        args, settings = self.args, []
        if args.loss_type != "ce":
            settings.append(f"loss_type={args.loss_type!r}")
        if _smoothing(args) > 0:
            settings.append(f"label_smoothing_factor={_smoothing(args)}")
        if args.temperature != 1.0:
            settings.append(f"temperature={args.temperature}")
        if args.class_weights is not None:
            settings.append(f"class_weights={args.class_weights!r}")
        return settings

    def is_models_own_loss(self) -> bool:
        """Whether the loss is the one a model computes from its labels: cross-entropy on the logits as they are."""
        args = self.args
        return args.loss_type == "ce" and _smoothing(args) == 0 and args.temperature == 1.0 and not args.class_weights

    def setup(self, trainer) -> None:
        self.class_weights = self.resolve_class_weights(trainer)

    def resolve_class_weights(self, trainer) -> torch.Tensor | None:
        """``args.class_weights`` as a float32 (C,) tensor; 'balanced' is computed from the training labels."""
        weights = self.args.class_weights
        if weights is None:
            return None
        config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
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
        if args.loss_type == "focal":
            return focal_loss(
                logits,
                labels,
                gamma=args.focal_gamma,
                alpha=self.focal_alpha(trainer),
                num_items_in_batch=num_items_in_batch,
            )
        if args.loss_type == "dft":
            return dft_loss(logits, labels, num_items_in_batch=num_items_in_batch)
        if args.loss_type == "label_smoothing" or _smoothing(args) > 0:
            return label_smoothing_cross_entropy(
                logits,
                labels,
                epsilon=_smoothing(args),
                num_items_in_batch=num_items_in_batch,
                weight=self.class_weights,
            )
        return cross_entropy(logits, labels, num_items_in_batch=num_items_in_batch, weight=self.class_weights)

    def focal_alpha(self, trainer) -> list[float] | None:
        """``args.focal_alpha``, one weight per class of the model (:func:`~nlp_tricks.losses.focal_alpha_weights`)."""
        if self.args.focal_alpha is None:
            return None
        id2label = getattr(trainer.accelerator.unwrap_model(trainer.model).config, "id2label", None) or {}
        names = [str(id2label[i]) for i in sorted(id2label)]
        return focal_alpha_weights(self.args.focal_alpha, names)

    def count_items(self, trainer, labels):
        """With class weights (or focal loss's ``focal_alpha``) a position weighs its class's weight: the divisor is
        the weight sum, as in ``F.cross_entropy(weight=...)``."""
        weight = self.class_weights
        if weight is None and self.args.loss_type == "focal" and self.args.focal_alpha is not None:
            weight = torch.tensor(self.focal_alpha(trainer), dtype=torch.float32)
        if weight is None:
            return None
        weight = weight.to(labels.device)
        return weight[labels.clamp(min=0)].mul(labels.ne(-100)).sum()


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
