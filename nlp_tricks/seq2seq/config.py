"""Seq2SeqTricksArguments: Seq2SeqTrainingArguments plus every TricksArguments field and the seq2seq tricks.

The scheduled-sampling fields (``scheduled_sampling``, ``ss_*``) are TricksArguments' (decoder-only models use them
too) and are inherited from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Seq2SeqTrainingArguments

from ..config import TricksArguments
from .tying import TIE_SCOPES

__all__ = ["Seq2SeqTricksArguments"]


@dataclass
class Seq2SeqTricksArguments(TricksArguments, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` (generation for evaluation) with every TricksArguments trick and the seq2seq ones.

    Bad values raise ``ValueError`` naming the field and what is allowed.
    """

    # --- Weight tying ---
    tie_encoder_decoder: str = field(
        default="none",
        metadata={
            "help": "Share weights between encoder and decoder (Press & Wolf 2017; Rothe et al. 2020): 'none', "
            "'embeddings' (one matrix for encoder input, decoder input and output embeddings) or 'all' (also every "
            "decoder weight whose name and shape match an encoder weight; cross-attention stays the decoder's).",
            "choices": list(TIE_SCOPES),
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.tie_encoder_decoder not in TIE_SCOPES:
            raise ValueError(
                f"tie_encoder_decoder={self.tie_encoder_decoder!r} is not allowed; choose one of "
                f"{', '.join(map(repr, TIE_SCOPES))}"
            )
