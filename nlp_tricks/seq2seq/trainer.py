"""Seq2SeqTricksTrainer: a Seq2SeqTrainer with every TricksTrainer trick, scheduled sampling and weight tying."""

from __future__ import annotations

from torch import nn
from transformers import Seq2SeqTrainer
from transformers.utils import logging

from ..trainer import TricksTrainer
from .config import Seq2SeqTricksArguments
from .tying import TIE_SCOPE_CONFIG_KEY, count_unique_parameters, tie_encoder_decoder

__all__ = ["Seq2SeqTricksTrainer"]

logger = logging.get_logger(__name__)


class Seq2SeqTricksTrainer(TricksTrainer, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` (``predict_with_generate`` evaluation) whose training loss and optimizer are TricksTrainer's.

    Takes :class:`~nlp_tricks.seq2seq.Seq2SeqTricksArguments`. On top of TricksTrainer it wires:

    - Scheduled sampling (``--scheduled_sampling``, ``--ss_k``, ``--ss_min_ratio``, ``--ss_mode``,
      ``--ss_temperature``): in training, :meth:`forward_for_loss` runs the encoder once, the decoder teacher-forced
      under ``no_grad``, mixes its predictions into the decoder input with probability ``1 - ratio``, and the
      configured loss (any ``loss_type``, exact gradient accumulation) is taken on a second decoder pass. The ratio
      is read at ``state.global_step``, so it resumes with a checkpoint, and is logged as ``teacher_forcing_ratio``.
      Evaluation is teacher-forced as usual. With FGM / PGD every pass of a micro-batch reuses the clean pass's draw
      (mask and pass-1 predictions). The trick (:class:`nlp_tricks.tricks.scheduled_sampling.ScheduledSampling`) runs
      the encoder-decoder passes on encoder-decoder models and the causal ones on causal LMs (with TricksTrainer).
    - Weight tying (``--tie_encoder_decoder embeddings|all``): applied to the model when the trainer is built (or by
      ``model_init``). A model reloaded from a tied checkpoint (its config records the scope) is tied again even with
      ``tie_encoder_decoder='none'``. The first training log holds ``unique_parameters`` (and
      ``unique_parameters_untied`` when ties were applied).
    """

    def __init__(self, model=None, args: Seq2SeqTricksArguments | None = None, *positional, **kwargs):
        if args is None:
            args = Seq2SeqTricksArguments(output_dir="tmp_trainer")
        if not isinstance(args, Seq2SeqTricksArguments):
            raise TypeError(
                f"Seq2SeqTricksTrainer needs Seq2SeqTricksArguments, got {type(args).__name__}; build it with the "
                "same fields: Seq2SeqTricksArguments(output_dir=..., ...)"
            )
        self._parameter_report: dict[str, int] = {}
        if model is not None:
            self._parameter_report = self._apply_tying(model, args)
        super().__init__(model, args, *positional, **kwargs)
        self._pending_report: dict[str, int] = {}

    # ---- Weight tying ----------------------------------------------------------------------------------------------

    @staticmethod
    def _apply_tying(model: nn.Module, args: Seq2SeqTricksArguments) -> dict[str, int]:
        """Tie per ``args.tie_encoder_decoder`` (or the scope the model's config records); the parameter counts."""
        before = count_unique_parameters(model)
        scope = args.tie_encoder_decoder
        recorded = getattr(getattr(model, "config", None), TIE_SCOPE_CONFIG_KEY, None)
        if recorded == "all" and scope == "embeddings":
            raise ValueError(
                "tie_encoder_decoder='embeddings' but the model's config records scope 'all' (a checkpoint saved with "
                "all layers tied holds only the encoder's copies); use tie_encoder_decoder='all'"
            )
        if scope == "none" and recorded not in (None, "none"):
            logger.info(f"The model's config records tie_encoder_decoder={recorded!r}: tying it again")
            scope = recorded
        if scope == "none":
            return {"unique_parameters": before}
        tie_encoder_decoder(model, scope)
        return {"unique_parameters": count_unique_parameters(model), "unique_parameters_untied": before}

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        self._parameter_report = self._apply_tying(model, self.args)
        return model

    def train(self, *args, **kwargs):
        report = self._parameter_report
        if report:
            untied = (
                f" ({report['unique_parameters_untied']:,} untied)" if "unique_parameters_untied" in report else ""
            )
            logger.info(f"Unique parameters: {report['unique_parameters']:,}{untied}")
        self._pending_report = dict(report)
        return super().train(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._pending_report:
            # Once, in the first training log of the run.
            logs.update(self._pending_report)
            self._pending_report = {}
        super().log(logs, start_time)
