"""``scheduled_sampling`` / ``ss_*``: scheduled sampling's two passes, for decoder-only causal LMs (TricksTrainer)
and encoder-decoder models (Seq2SeqTricksTrainer). The passes are in :mod:`nlp_tricks.scheduled_sampling` and
:mod:`nlp_tricks.seq2seq.scheduled_sampling`."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from transformers import Seq2SeqTrainer

from ..functional.models import unwrap_model
from ..functional.scheduled_sampling import (
    MODES,
    SCHEDULES,
    ScheduledSampler,
    causal_scheduled_sampling_forward,
    validate_mixing,
    validate_schedule,
)
from .base import BuiltInTrick

__all__ = ["ScheduledSamplingTrick", "ScheduledSampling", "ScheduledSamplingArguments"]


@dataclass
class ScheduledSamplingArguments:
    """Scheduled sampling (encoder-decoder models and decoder-only causal LMs)."""

    scheduled_sampling: str = field(
        default="none",
        metadata={
            "help": "Scheduled sampling (Bengio et al. 2015, two passes as in Mihaylova & Martins 2019) for "
            "encoder-decoder models (Seq2SeqTricksTrainer) and decoder-only causal LMs (TricksTrainer): the "
            "teacher-forcing ratio's schedule over optimizer steps. 'none' (plain teacher forcing), 'constant' "
            "(ratio ss_k), 'linear' (1 - step / ss_k), 'exponential' (ss_k ** step) or 'inverse_sigmoid' "
            "(ss_k / (ss_k + exp(step / ss_k))).",
            "choices": ["none", *SCHEDULES],
        },
    )
    ss_k: float | None = field(
        default=None,
        metadata={
            "help": "Parameter of the scheduled_sampling schedule: constant: the ratio in [0, 1]; linear: steps to "
            "reach 0 (> 0); exponential: base in (0, 1), e.g. 0.999; inverse_sigmoid: k >= 1, e.g. 1000."
        },
    )
    ss_min_ratio: float = field(
        default=0.0, metadata={"help": "Floor of the teacher-forcing ratio, in [0, 1] (Bengio et al.'s epsilon)."}
    )
    ss_mode: str = field(
        default="argmax",
        metadata={
            "help": "What replaces a gold input token (a decoder input; for a causal LM a completion token, never "
            "the prompt): 'argmax' (the pass-1 prediction), 'sample' (a sample from "
            "softmax(logits / ss_temperature)) or 'soft' (the expected embedding "
            "softmax(logits / ss_temperature) @ E).",
            "choices": list(MODES),
        },
    )
    ss_temperature: float = field(
        default=1.0, metadata={"help": "Softmax temperature (> 0) of ss_mode 'sample' and 'soft'."}
    )


class ScheduledSamplingTrick(BuiltInTrick):
    """In training, the model runs teacher-forced under ``no_grad``, each target input token (a decoder input; for
    a causal LM a completion token) is replaced by its prediction with probability ``1 - ratio``, and the loss is
    taken on a second pass over that input. The ratio is read at ``state.global_step`` (so it resumes with a
    checkpoint) and logged as ``teacher_forcing_ratio``. The passes of one micro-batch of an attack reuse the first
    pass's draw."""

    arguments = ScheduledSamplingArguments
    order = 300
    changes_loss = True
    in_evaluation = False

    def __init__(self, args):
        super().__init__(args)
        self.sampler = ScheduledSampler(args.scheduled_sampling, args.ss_k, args.ss_min_ratio)

    @classmethod
    def enabled(cls, args) -> bool:
        return args.scheduled_sampling != "none"

    @staticmethod
    def validate(args) -> None:
        if args.scheduled_sampling not in ("none", *SCHEDULES):
            raise ValueError(
                f"scheduled_sampling={args.scheduled_sampling!r} is not allowed; choose one of "
                f"{', '.join(map(repr, ('none', *SCHEDULES)))}"
            )
        if args.scheduled_sampling != "none":
            validate_schedule(
                args.scheduled_sampling,
                args.ss_k,
                args.ss_min_ratio,
                names=("scheduled_sampling", "ss_k", "ss_min_ratio"),
            )
        else:
            if args.ss_k is not None:
                raise ValueError(f"ss_k={args.ss_k} is only used with a scheduled_sampling schedule, which is 'none'")
            if not 0.0 <= args.ss_min_ratio <= 1.0:
                raise ValueError(f"ss_min_ratio={args.ss_min_ratio} is not allowed; it must be in [0, 1]")
        validate_mixing(args.ss_mode, args.ss_temperature, names=("ss_mode", "ss_temperature"))

    def summary(self) -> list[str]:
        return [f"scheduled_sampling={self.args.scheduled_sampling!r}"]

    def setup(self, trainer) -> None:
        if trainer.model is None:
            return
        model = unwrap_model(trainer.model)
        seq2seq_model = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
        if isinstance(trainer, Seq2SeqTrainer):
            if not seq2seq_model:
                raise ValueError(
                    f"scheduled_sampling={self.args.scheduled_sampling!r} needs an encoder-decoder model with "
                    f"Seq2SeqTricksTrainer (decoder-only causal LMs: use TricksTrainer), got {type(model).__name__}"
                )
        elif not trainer.loss_shifts_labels:
            hint = " (for encoder-decoder models use Seq2SeqTricksTrainer)" if seq2seq_model else ""
            raise ValueError(
                f"scheduled_sampling={self.args.scheduled_sampling!r} needs a decoder-only causal LM with "
                f"TricksTrainer{hint}, got {type(model).__name__}"
            )

    def forward(self, trainer, model: nn.Module, inputs: dict, labels):
        """The pass-2 outputs at the ratio of ``state.global_step``, or None at ratio 1 (the plain forward). The passes
        of one micro-batch (an attack's) reuse the first pass's draw, kept in ``trainer.loss_context.shared``."""
        ratio = self.sampler.ratio(trainer.state.global_step)
        trainer.record_metric("teacher_forcing_ratio", ratio)
        if ratio >= 1.0:
            return None
        shared = trainer.loss_context.shared if trainer.loss_context is not None else {}
        draw = shared.get("scheduled_sampling")
        unwrapped = unwrap_model(model)
        if getattr(getattr(unwrapped, "config", None), "is_encoder_decoder", False):
            from ..seq2seq.scheduled_sampling import scheduled_sampling_forward as passes
        else:
            passes = causal_scheduled_sampling_forward
        # Pass 1 (and the encoder of an encoder-decoder) run on the unwrapped model (no DDP forward without a
        # backward), under the autocast accelerate otherwise applies in the wrapped forward; pass 2 goes through the
        # wrapper.
        with trainer.accelerator.autocast():
            outputs, draw = passes(
                unwrapped,
                inputs,
                labels,
                ratio,
                mode=self.args.ss_mode,
                temperature=self.args.ss_temperature,
                forward=model,
                draw=draw,
                return_draw=True,
            )
        shared["scheduled_sampling"] = draw
        return outputs


__all__ += ["MODES", "SCHEDULES"]


ScheduledSampling = ScheduledSamplingTrick  # its name before the built-ins were named <Flag>Trick
