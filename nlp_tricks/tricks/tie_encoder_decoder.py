"""``tie_encoder_decoder``: weights shared between an encoder-decoder's encoder and decoder (Seq2SeqTricksTrainer).
The mechanics are :func:`nlp_tricks.seq2seq.tying.tie_encoder_decoder`."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

from torch import nn

from ..functional.tying import TIE_SCOPE_CONFIG_KEY, TIE_SCOPES, count_unique_parameters, tie_encoder_decoder
from .base import BuiltInTrick

__all__ = ["TieEncoderDecoderTrick", "TieEncoderDecoder", "TieArguments"]

logger = logging.getLogger(__name__)


@dataclass
class TieArguments:
    """Weight tying between encoder and decoder."""

    tie_encoder_decoder: str = field(
        default="none",
        metadata={
            "help": "Share weights between encoder and decoder (Press & Wolf 2017; Rothe et al. 2020): 'none', "
            "'embeddings' (one matrix for encoder input, decoder input and output embeddings) or 'all' (also every "
            "decoder weight whose name and shape match an encoder weight; cross-attention stays the decoder's).",
            "choices": list(TIE_SCOPES),
        },
    )


class TieEncoderDecoderTrick(BuiltInTrick):
    """Ties the model when the trainer is built (or by ``model_init``). A model reloaded from a tied checkpoint (its
    config records the scope) is tied again even with ``tie_encoder_decoder='none'``. The first training log holds
    ``unique_parameters`` (and ``unique_parameters_untied`` when ties were applied)."""

    arguments = TieArguments
    in_tricks_config = False  # its field is Seq2SeqTricksArguments'
    order = 50  # before anything reads the model's parameters

    def __init__(self, args):
        super().__init__(args)
        self.report: dict[str, int] = {}
        self._trainer = None

    @classmethod
    def enabled(cls, args) -> bool:
        # Only arguments that have the field (Seq2SeqTricksArguments); there always, for reloaded tied models.
        return hasattr(args, "tie_encoder_decoder")

    @staticmethod
    def validate(args) -> None:
        scope = getattr(args, "tie_encoder_decoder", "none")
        if scope not in TIE_SCOPES:
            raise ValueError(
                f"tie_encoder_decoder={scope!r} is not allowed; choose one of {', '.join(map(repr, TIE_SCOPES))}"
            )

    def summary(self) -> list[str]:
        scope = self.args.tie_encoder_decoder
        return [] if scope == "none" else [f"tie_encoder_decoder={scope!r}"]

    def prepare_model(self, trainer, model: nn.Module) -> None:
        before = count_unique_parameters(model)
        scope = self.args.tie_encoder_decoder
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
            self.report = {"unique_parameters": before}
            return
        tie_encoder_decoder(model, scope)
        self.report = {"unique_parameters": count_unique_parameters(model), "unique_parameters_untied": before}

    def setup(self, trainer) -> None:
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        report, trainer = self.report, self._trainer() if self._trainer else None
        if not report or trainer is None:
            return
        untied = f" ({report['unique_parameters_untied']:,} untied)" if "unique_parameters_untied" in report else ""
        logger.info(f"Unique parameters: {report['unique_parameters']:,}{untied}")
        for name, count in report.items():  # in the first training log of the run
            trainer.record_metric(name, count)


TieEncoderDecoder = TieEncoderDecoderTrick  # its name before the built-ins were named <Flag>Trick
