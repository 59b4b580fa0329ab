"""Seq2SeqTricksTrainer: a Seq2SeqTrainer with every TricksTrainer trick, scheduled sampling and weight tying."""

from __future__ import annotations

from transformers import Seq2SeqTrainer

from ..trainer import TricksTrainer
from .config import Seq2SeqTricksArguments

__all__ = ["Seq2SeqTricksTrainer"]


class Seq2SeqTricksTrainer(TricksTrainer, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` (``predict_with_generate`` evaluation) whose training loss and optimizer are TricksTrainer's.

    Takes :class:`~nlp_tricks.seq2seq.Seq2SeqTricksArguments`. Beside TricksTrainer's tricks, two are seq2seq's:

    - Scheduled sampling (``--scheduled_sampling``, ``--ss_k``, ``--ss_min_ratio``, ``--ss_mode``,
      ``--ss_temperature``): in training the encoder runs once, the decoder teacher-forced under ``no_grad``, its
      predictions are mixed into the decoder input with probability ``1 - ratio``, and the configured loss (any
      ``loss_type``, exact gradient accumulation) is taken on a second decoder pass. The ratio is read at
      ``state.global_step``, so it resumes with a checkpoint, and is logged as ``teacher_forcing_ratio``. Evaluation
      is teacher-forced as usual. With FGM / PGD every pass of a micro-batch reuses the clean pass's draw
      (:class:`~nlp_tricks.tricks.scheduled_sampling.ScheduledSamplingTrick`).
    - Weight tying (``--tie_encoder_decoder embeddings|all``): applied to the model when the trainer is built (or by
      ``model_init``); a model reloaded from a tied checkpoint (its config records the scope) is tied again even with
      ``tie_encoder_decoder='none'``. The first training log holds ``unique_parameters`` (and
      ``unique_parameters_untied`` when ties were applied)
      (:class:`~nlp_tricks.tricks.tie_encoder_decoder.TieEncoderDecoderTrick`).
    """

    def __init__(self, model=None, args: Seq2SeqTricksArguments | None = None, *positional, **kwargs):
        if args is None:
            args = Seq2SeqTricksArguments(output_dir="tmp_trainer")
        if not isinstance(args, Seq2SeqTricksArguments):
            raise TypeError(
                f"Seq2SeqTricksTrainer needs Seq2SeqTricksArguments, got {type(args).__name__}; build it with the "
                "same fields: Seq2SeqTricksArguments(output_dir=..., ...)"
            )
        super().__init__(model, args, *positional, **kwargs)
