"""``scheduled_sampling`` / ``ss_*``: scheduled sampling's two passes, for decoder-only causal LMs (TricksTrainer)
and encoder-decoder models (Seq2SeqTricksTrainer). The passes are in :mod:`nlp_tricks.scheduled_sampling` and
:mod:`nlp_tricks.seq2seq.scheduled_sampling`."""

from __future__ import annotations

import contextlib

from torch import nn
from transformers import Seq2SeqTrainer

from ..functional.scheduled_sampling import (
    MODES,
    SCHEDULES,
    ScheduledSampler,
    causal_scheduled_sampling_forward,
    validate_mixing,
    validate_schedule,
)
from .base import Trick

__all__ = ["ScheduledSampling"]


class ScheduledSampling(Trick):
    """In training, the model runs teacher-forced under ``no_grad``, each target input token (a decoder input; for
    a causal LM a completion token) is replaced by its prediction with probability ``1 - ratio``, and the loss is
    taken on a second pass over that input. The ratio is read at ``state.global_step`` (so it resumes with a
    checkpoint) and logged as ``teacher_forcing_ratio``. The passes of one micro-batch of an attack reuse the first
    pass's draw."""

    changes_loss = True

    def __init__(self, args):
        self.args = args
        self.sampler = ScheduledSampler(args.scheduled_sampling, args.ss_k, args.ss_min_ratio)
        self._shared: dict | None = None  # inside micro_batch(): {"draw": the first pass's draw}

    @classmethod
    def from_args(cls, args) -> ScheduledSampling | None:
        return cls(args) if args.scheduled_sampling != "none" else None

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
        model = trainer.accelerator.unwrap_model(trainer.model)
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
        """The pass-2 outputs at the ratio of ``state.global_step``, or None at ratio 1 (the plain forward)."""
        if not model.training:
            return None
        ratio = self.sampler.ratio(trainer.state.global_step)
        trainer.record_metric("teacher_forcing_ratio", ratio)
        if ratio >= 1.0:
            return None
        shared = self._shared
        draw = shared.get("draw") if shared is not None else None
        unwrapped = trainer.accelerator.unwrap_model(model)
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
        if shared is not None:
            shared["draw"] = draw
        return outputs

    @contextlib.contextmanager
    def micro_batch(self, trainer):
        self._shared = {}
        try:
            yield
        finally:
            self._shared = None


__all__ += ["MODES", "SCHEDULES"]
