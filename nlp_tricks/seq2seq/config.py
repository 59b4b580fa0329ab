"""Seq2SeqTricksArguments: Seq2SeqTrainingArguments plus every TricksArguments field and the seq2seq tricks."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Seq2SeqTrainingArguments

from ..config import TricksArguments
from .scheduled_sampling import MODES, SCHEDULES, validate_mixing, validate_schedule
from .tying import TIE_SCOPES

__all__ = ["Seq2SeqTricksArguments"]


@dataclass
class Seq2SeqTricksArguments(TricksArguments, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` (generation for evaluation) with every TricksArguments trick and the seq2seq ones.

    Bad values raise ``ValueError`` naming the field and what is allowed.
    """

    # --- Scheduled sampling ---
    scheduled_sampling: str = field(
        default="none",
        metadata={
            "help": "Scheduled sampling (Bengio et al. 2015, two decoder passes as in Mihaylova & Martins 2019): the "
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
            "help": "What replaces a gold decoder input: 'argmax' (the pass-1 prediction), 'sample' (a sample from "
            "softmax(logits / ss_temperature)) or 'soft' (the expected embedding "
            "softmax(logits / ss_temperature) @ E).",
            "choices": list(MODES),
        },
    )
    ss_temperature: float = field(
        default=1.0, metadata={"help": "Softmax temperature (> 0) of ss_mode 'sample' and 'soft'."}
    )

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
        if self.scheduled_sampling not in ("none", *SCHEDULES):
            raise ValueError(
                f"scheduled_sampling={self.scheduled_sampling!r} is not allowed; choose one of "
                f"{', '.join(map(repr, ('none', *SCHEDULES)))}"
            )
        if self.scheduled_sampling != "none":
            validate_schedule(
                self.scheduled_sampling,
                self.ss_k,
                self.ss_min_ratio,
                names=("scheduled_sampling", "ss_k", "ss_min_ratio"),
            )
        else:
            if self.ss_k is not None:
                raise ValueError(f"ss_k={self.ss_k} is only used with a scheduled_sampling schedule, which is 'none'")
            if not 0.0 <= self.ss_min_ratio <= 1.0:
                raise ValueError(f"ss_min_ratio={self.ss_min_ratio} is not allowed; it must be in [0, 1]")
        validate_mixing(self.ss_mode, self.ss_temperature, names=("ss_mode", "ss_temperature"))
        if self.tie_encoder_decoder not in TIE_SCOPES:
            raise ValueError(
                f"tie_encoder_decoder={self.tie_encoder_decoder!r} is not allowed; choose one of "
                f"{', '.join(map(repr, TIE_SCOPES))}"
            )
