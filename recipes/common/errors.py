"""A model or dataset that cannot be loaded, or a trick that refuses the model: one DataError line, no traceback."""

from __future__ import annotations

import contextlib

from nlp_tricks.data import DataError


def first_sentence(err: Exception) -> str:
    """The first sentence of an error's message, on one line (its type name if it has none)."""
    text = " ".join(str(err).split())
    return text.split(". ")[0].rstrip(".") if text else type(err).__name__


@contextlib.contextmanager
def one_line_load_errors(what: str):
    """A model / dataset that cannot be loaded (no such folder, a Hub id while offline, a head of another shape)
    becomes one :class:`DataError` line naming the flag (``what``), instead of a traceback."""
    try:
        yield
    except OSError as err:  # transformers' "not a folder, not reachable on the Hub" (and offline mode)
        raise DataError(None, None, f"{what}: cannot load it: {first_sentence(err)}") from err
    except RuntimeError as err:
        if "ignore_mismatched_sizes" not in str(err):
            raise
        raise DataError(
            None,
            None,
            f"{what}: its head has another shape than this data's labels need; add --ignore_mismatched_sizes true "
            "to start a fresh head",
        ) from err


@contextlib.contextmanager
def refusals_of_the_model():
    """Around building the trainer: a trick that refuses this model (``--pooling`` on a head it cannot feed,
    ``--reinit_layers`` / ``--freeze_layers`` beyond its layers) raises ``ValueError`` naming the setting; it becomes
    that one line instead of a traceback."""
    try:
        yield
    except DataError:
        raise
    except ValueError as err:
        raise DataError(None, None, str(err).splitlines()[0]) from err
