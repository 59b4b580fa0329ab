"""The built-in tricks, one file each, named after its flag, with its argument dataclass; :data:`BUILT_IN_TRICKS` is
the registry.

Adding a built-in trick: a file here, named after its flag, holding its argument dataclass (every field with
``metadata={"help": ...}``) and a :class:`~nlp_tricks.tricks.base.BuiltInTrick` named ``<Flag>Trick`` with
``arguments`` (that dataclass), ``order``, ``enabled(args)`` (whether its fields switch it on) and ``validate(args)``
(raises naming the field); its math in :mod:`nlp_tricks.functional`; and one line in :data:`BUILT_IN_TRICKS`, which
is all :class:`~nlp_tricks.TricksConfig` (and so :class:`~nlp_tricks.TricksArguments`, every recipe's flags) is
composed from. A check that involves two tricks goes in :func:`validate_arguments`.
"""

from __future__ import annotations

from ..runtime.saved_weights import tricks_section
from ..trick import STEPS_INSIDE_BACKWARD, LossBatch, Trick, capability_problem
from .adversarial import AdversarialTrick
from .base import BuiltInTrick
from .crf import CRFTrick
from .distillation import Distillation, DistillationTrick
from .ema import EMATrick
from .freeze_layers import FreezeLayersTrick
from .head_dropout import HeadDropoutTrick
from .layer_decay import LayerDecayTrick
from .lookahead import LookaheadTrick
from .loraplus import LoraPlusTrick
from .loss_type import LossFunction, LossTypeTrick
from .muon import MuonTrick
from .pooling import PoolingTrick
from .rdrop import RDropTrick
from .reinit_layers import ReinitLayersTrick
from .sam import SAMTrick
from .scheduled_sampling import ScheduledSamplingTrick
from .smart import SMARTTrick
from .span_head import SpanHeadTrick
from .swa import SWATrick
from .tie_encoder_decoder import TieEncoderDecoderTrick

__all__ = [
    "Trick",
    "BuiltInTrick",
    "LossBatch",
    "BUILT_IN_TRICKS",
    "built_in_tricks",
    "validate_arguments",
    "trick_arguments",
    "tricks_section",
    "Distillation",
    "LossFunction",
]

# The registry: every built-in trick class. The order they run in is each class's `order` (docs/tricks.md has the
# table); this tuple's order breaks ties and is the order of their fields in TricksConfig (and in --help).
BUILT_IN_TRICKS: tuple[type[BuiltInTrick], ...] = (
    TieEncoderDecoderTrick,
    PoolingTrick,
    ReinitLayersTrick,
    ScheduledSamplingTrick,
    CRFTrick,
    SpanHeadTrick,
    HeadDropoutTrick,
    RDropTrick,
    SMARTTrick,
    DistillationTrick,
    LossTypeTrick,
    AdversarialTrick,
    SAMTrick,
    LookaheadTrick,
    EMATrick,
    SWATrick,
    FreezeLayersTrick,
    LayerDecayTrick,
    LoraPlusTrick,
    MuonTrick,
)


def trick_arguments() -> tuple[type, ...]:
    """The argument dataclasses TricksConfig is composed of, in the registry's order (tying's fields are
    Seq2SeqTricksArguments')."""
    return tuple(cls.arguments for cls in BUILT_IN_TRICKS if cls.in_tricks_config)


def built_in_tricks(args, user_tricks=()) -> list[Trick]:
    """The built-in tricks ``args`` switch on and ``user_tricks``, sorted by ``order`` (ties: built-ins first, in
    :data:`BUILT_IN_TRICKS`' order, then the user's as given)."""
    tricks = [trick for cls in BUILT_IN_TRICKS if (trick := cls.from_args(args)) is not None]
    return sorted([*tricks, *user_tricks], key=lambda trick: trick.order)


def validate_arguments(args) -> None:
    """Each built-in trick's own checks, then what the tricks switched on declare (capability flags), then the checks
    that involve two of them (here, in one place)."""
    for cls in BUILT_IN_TRICKS:
        cls.validate(args)
    optim = getattr(getattr(args, "optim", None), "value", getattr(args, "optim", None))
    if optim in STEPS_INSIDE_BACKWARD:  # the engine (DeepSpeed, FSDP) is checked when the trainer is built
        for trick in built_in_tricks(args):
            problem = capability_problem(trick, optim=optim)
            if problem is not None:
                raise ValueError(problem)
    if args.crf and (
        args.loss_type != "ce" or getattr(args, "label_smoothing_factor", 0) > 0 or args.temperature != 1.0
    ):
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
    if args.span_head is not None:
        _validate_span_head_with_others(args)
    if args.swa_last_k > 0 and getattr(args, "load_best_model_at_end", False):
        raise ValueError("swa_last_k and load_best_model_at_end both choose the final weights; use one of them")
    if args.swa_last_k > 0 and args.ema_eval:
        raise ValueError(
            "swa_last_k and ema_eval both choose the final weights; to average the raw checkpoints while keeping an "
            "EMA, set ema_eval=False"
        )


def _validate_span_head_with_others(args) -> None:
    """The span head replaces the token classifier and its loss: the settings that need either are refused."""
    head = f"span_head={args.span_head!r}"
    smoothing = getattr(args, "label_smoothing_factor", 0)
    clashes = (
        (args.crf, "crf=True (both replace the token classifier's loss; use one of them)"),
        (args.pooling is not None, f"pooling={args.pooling!r} (sequence classification)"),
        (
            args.loss_type != "ce" or smoothing > 0 or args.temperature != 1.0,
            f"loss_type={args.loss_type!r}, label_smoothing_factor={smoothing}, temperature="
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
