"""The settings that choose each loss type of nlp_tricks' loss table, for the tests that cover every loss (a new
entry of LOSS_TABLE is covered by them without editing a test)."""

from nlp_tricks.tricks.loss_type import LOSS_TABLE


def loss_settings(name: str) -> dict:
    """``loss_type=name`` with its own fields at their defaults, and the smoothing mass of a loss that needs one."""
    return {"loss_type": name, **({"label_smoothing_factor": 0.1} if LOSS_TABLE[name].needs_smoothing else {})}


#: Every loss type's settings, by name.
EVERY_LOSS = {name: loss_settings(name) for name in LOSS_TABLE}

#: The loss types whose function takes an LMHeadLogits (a causal LM's loss in chunks from the last hidden state).
CHUNKED_LOSSES = [name for name, entry in LOSS_TABLE.items() if entry.chunked]
