"""Seq2SeqTricksTrainer: a Seq2SeqTrainer with every TricksTrainer trick."""

from __future__ import annotations

from transformers import Seq2SeqTrainer

from ..trainer import TricksTrainer

__all__ = ["Seq2SeqTricksTrainer"]


class Seq2SeqTricksTrainer(TricksTrainer, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` (``predict_with_generate`` evaluation) whose training loss and optimizer are TricksTrainer's.

    Takes :class:`~nlp_tricks.seq2seq.Seq2SeqTricksArguments`.
    """
