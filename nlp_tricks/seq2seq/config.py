"""Seq2SeqTricksArguments: Seq2SeqTrainingArguments plus every TricksArguments field."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Seq2SeqTrainingArguments

from ..config import TricksArguments

__all__ = ["Seq2SeqTricksArguments"]


@dataclass
class Seq2SeqTricksArguments(TricksArguments, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` (generation for evaluation) with every TricksArguments trick."""

    def __post_init__(self):
        super().__post_init__()
