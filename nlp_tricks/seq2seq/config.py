"""Seq2SeqTricksArguments: Seq2SeqTrainingArguments plus every TricksArguments field and the seq2seq tricks.

The scheduled-sampling fields (``scheduled_sampling``, ``ss_*``) are TricksArguments' (decoder-only models use them
too); weight tying's (``tie_encoder_decoder``) are :class:`~nlp_tricks.tricks.tie_encoder_decoder.TieArguments`.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Seq2SeqTrainingArguments

from ..config import TricksArguments
from ..tricks.tie_encoder_decoder import TieArguments

__all__ = ["Seq2SeqTricksArguments"]


@dataclass
class Seq2SeqTricksArguments(TricksArguments, TieArguments, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` (generation for evaluation) with every TricksArguments trick and the seq2seq ones.

    Bad values raise ``ValueError`` naming the field and what is allowed.
    """
