"""The tricks as objects: the :class:`Trick` protocol and the built-in tricks, in the order TricksTrainer runs them.

Adding a built-in trick: its fields in :class:`~nlp_tricks.TricksArguments`, its module here (a :class:`Trick` with
``from_args(args)`` returning the trick or ``None`` when its fields leave it off, and ``validate(args)``), and one line
in :data:`BUILT_IN_TRICKS`.
"""

from __future__ import annotations

from .adversarial import Adversarial
from .averaging import CheckpointAveraging, ExponentialMovingAverage
from .base import LossBatch, Trick
from .crf import CRFHead
from .layers import LayerFreezing, ReinitLayers
from .loss import LossFunction
from .multi_sample_dropout import MultiSampleDropout
from .pooling import PoolingHead
from .rdrop import RDrop
from .sam import SharpnessAwareMinimization
from .scheduled_sampling import ScheduledSampling
from .smart import SmoothnessRegularization
from .span_head import SpanHeadTrick

__all__ = ["Trick", "LossBatch", "BUILT_IN_TRICKS", "built_in_tricks", "validate_arguments"]

# The built-in tricks in the order their hooks run. Where a hook's first answer wins (the forward, the loss, the item
# count) the earlier trick decides: the CRF's loss and count come before the configured loss function's.
BUILT_IN_TRICKS = (
    # The model's shape first (the heads hooked by later tricks are the pooled model's), then its weights.
    PoolingHead,
    ReinitLayers,
    ScheduledSampling,
    CRFHead,
    SpanHeadTrick,
    MultiSampleDropout,
    RDrop,
    SmoothnessRegularization,
    LossFunction,
    Adversarial,
    SharpnessAwareMinimization,
    ExponentialMovingAverage,
    CheckpointAveraging,
    # After the EMA: it is built when training begins, before this trick freezes what unfreeze_at_step thaws later.
    LayerFreezing,
)


def built_in_tricks(args, user_tricks=()) -> list[Trick]:
    """The built-in tricks ``args`` switch on, in :data:`BUILT_IN_TRICKS`' order, with ``user_tricks`` right before
    the configured loss function (which answers for the loss when no trick before it does)."""
    tricks = []
    for cls in BUILT_IN_TRICKS:
        if cls is LossFunction:
            tricks.extend(user_tricks)
        trick = cls.from_args(args)
        if trick is not None:
            tricks.append(trick)
    return tricks


def validate_arguments(args) -> None:
    """Each built-in trick's own checks, then the checks that involve two of them (here, in one place)."""
    for cls in BUILT_IN_TRICKS:
        cls.validate(args)
    if args.crf and (args.loss_type != "ce" or args.label_smoothing_factor > 0 or args.temperature != 1.0):
        raise ValueError(
            "crf=True replaces the loss with the CRF's negative log-likelihood; use loss_type='ce', "
            "label_smoothing_factor=0 and temperature=1.0 with it"
        )
    if args.crf and args.class_weights is not None:
        raise ValueError("class_weights do not apply to crf=True (the CRF scores whole tag sequences)")
    if args.crf and args.rdrop_alpha > 0:
        raise ValueError(
            f"rdrop_alpha={args.rdrop_alpha} compares per-position distributions, which crf=True does not train "
            "(the CRF scores whole tag sequences); use one of them"
        )
    if args.pooling is not None and args.crf:
        raise ValueError(
            f"pooling={args.pooling!r} applies to sequence classification and crf=True to token classification; "
            "use one of them"
        )
    if args.span_head is not None:
        _validate_span_head_with_others(args)
    # SAM and SMART.
    if args.sam_rho > 0 and args.adversarial != "none":
        raise ValueError(
            f"sam_rho={args.sam_rho} and adversarial={args.adversarial!r} each run the whole training step; use one "
            "of them"
        )
    if args.smart_alpha > 0:
        for clash, setting in (
            (args.crf, "crf=True (its loss is computed inside the forward, on whole tag sequences)"),
            (args.head_dropout_samples > 1, f"head_dropout_samples={args.head_dropout_samples}"),
            (args.scheduled_sampling != "none", f"scheduled_sampling={args.scheduled_sampling!r}"),
        ):
            if clash:
                raise ValueError(
                    f"smart_alpha={args.smart_alpha} regularises the logits of one plain forward; it does not "
                    f"combine with {setting}; use one of them"
                )
    if args.swa_last_k > 0 and args.load_best_model_at_end:
        raise ValueError("swa_last_k and load_best_model_at_end both choose the final weights; use one of them")
    if args.swa_last_k > 0 and args.ema_eval:
        raise ValueError(
            "swa_last_k and ema_eval both choose the final weights; to average the raw checkpoints while keeping an "
            "EMA, set ema_eval=False"
        )


def _validate_span_head_with_others(args) -> None:
    """The span head replaces the token classifier and its loss: the settings that need either are refused."""
    head = f"span_head={args.span_head!r}"
    clashes = (
        (args.crf, "crf=True (both replace the token classifier's loss; use one of them)"),
        (args.pooling is not None, f"pooling={args.pooling!r} (sequence classification)"),
        (
            args.loss_type != "ce" or args.label_smoothing_factor > 0 or args.temperature != 1.0,
            f"loss_type={args.loss_type!r}, label_smoothing_factor={args.label_smoothing_factor}, temperature="
            f"{args.temperature} (the span loss replaces the loss: use 'ce', 0 and 1.0)",
        ),
        (args.class_weights is not None, "class_weights (they weigh token tags, which a span head has none of)"),
        (
            args.rdrop_alpha > 0,
            f"rdrop_alpha={args.rdrop_alpha} (R-Drop's KL compares per-token class distributions; a span head's "
            "logits are projections, its scores independent per span)",
        ),
        (args.smart_alpha > 0, f"smart_alpha={args.smart_alpha} (it regularises per-token class distributions)"),
        (
            args.head_dropout_samples > 1 or args.head_dropout > 0,
            f"head_dropout_samples={args.head_dropout_samples}, head_dropout={args.head_dropout} (multi-sample "
            "dropout needs a linear classifier)",
        ),
    )
    for clash, setting in clashes:
        if clash:
            raise ValueError(f"{head} does not combine with {setting}")
