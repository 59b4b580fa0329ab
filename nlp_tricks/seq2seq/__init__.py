"""Seq2seq tricks: Seq2SeqTricksArguments / Seq2SeqTricksTrainer."""

from .config import Seq2SeqTricksArguments
from .trainer import Seq2SeqTricksTrainer

__all__ = ["Seq2SeqTricksArguments", "Seq2SeqTricksTrainer"]
