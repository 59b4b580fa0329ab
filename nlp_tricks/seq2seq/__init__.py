"""Seq2seq tricks: Seq2SeqTricksArguments / Seq2SeqTricksTrainer, scheduled sampling and encoder-decoder tying."""

from ..functional.tying import count_unique_parameters, tie_encoder_decoder
from .config import Seq2SeqTricksArguments
from .scheduled_sampling import ScheduledSampler, scheduled_sampling_forward
from .trainer import Seq2SeqTricksTrainer

__all__ = [
    "Seq2SeqTricksArguments",
    "Seq2SeqTricksTrainer",
    "ScheduledSampler",
    "scheduled_sampling_forward",
    "tie_encoder_decoder",
    "count_unique_parameters",
]
