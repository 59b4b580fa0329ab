"""A model or dataset that cannot be loaded, or a trick that refuses the model: one DataError line, no traceback."""

from __future__ import annotations

import contextlib
import os
import pickle

from nlp_tricks.data import DataError
from nlp_tricks.runtime.checkpoint import STATE_DICT_SUFFIXES, TORCH_SUFFIXES
from nlp_tricks.runtime.resume import weight_file_problem


def first_sentence(err: Exception) -> str:
    """The first sentence of an error's message, on one line (its type name if it has none)."""
    text = " ".join(str(err).split())
    return text.split(". ")[0].rstrip(".") if text else type(err).__name__


@contextlib.contextmanager
def one_line_load_errors(what: str, source: str | os.PathLike | None = None):
    """A model / dataset that cannot be loaded becomes one :class:`DataError` line naming the flag (``what``),
    instead of a traceback: no such folder, a Hub id while offline, a head of another shape, weights that do not load
    (a truncated file, a pickle that needs arbitrary unpickling: its file named when ``source``, the folder or file
    being loaded, is local) and a model that needs its own code without ``--trust_remote_code true``."""
    try:
        yield
    except DataError:
        raise
    except pickle.UnpicklingError as err:
        file = _first_file(source, TORCH_SUFFIXES) or "a weights file"
        raise DataError(
            None,
            None,
            f"{what}: refused to load {file}: it needs arbitrary unpickling, which can run any code the file carries "
            "(only tensors are loaded: torch.load(weights_only=True)); if you trust it, convert it to safetensors",
        ) from err
    except OSError as err:  # transformers' "not a folder, not reachable on the Hub" (and offline mode)
        problem = _weights_problem(source) or first_sentence(err)
        raise DataError(None, None, f"{what}: cannot load it: {problem}") from err
    except (ValueError, RuntimeError) as err:
        line = _load_error_line(err, what, source)
        if line is None:
            raise
        raise DataError(None, None, line) from err
    except Exception as err:  # safetensors' own error type (SafetensorError) derives from Exception alone
        problem = _weights_problem(source) if type(err).__name__ == "SafetensorError" else None
        if problem is None:
            raise
        raise DataError(None, None, f"{what}: cannot load its weights: {problem}") from err


def _load_error_line(err: Exception, what: str, source) -> str | None:
    """The line for a load's ``ValueError`` / ``RuntimeError`` that is the user's to fix, else ``None``."""
    text = str(err)
    if "trust_remote_code=True" in text:
        return (
            f"{what}: the model needs its own code (Python files beside its config), which runs only with "
            "--trust_remote_code true; pass it if you trust that code"
        )
    if "ignore_mismatched_sizes" in text:
        return (
            f"{what}: its head has another shape than this data's labels need; add --ignore_mismatched_sizes true "
            "to start a fresh head"
        )
    problem = _weights_problem(source)
    if problem is not None:  # torch's reader on a truncated file: "PytorchStreamReader failed reading zip archive"
        return f"{what}: cannot load its weights: {problem}"
    return None


def _weight_files(source) -> list[str]:
    if source is None:
        return []
    path = os.fspath(source)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        return []
    return sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(STATE_DICT_SUFFIXES))


def _first_file(source, suffixes: tuple[str, ...]) -> str | None:
    return next((os.path.basename(p) for p in _weight_files(source) if p.endswith(suffixes)), None)


def _weights_problem(source) -> str | None:
    """What is wrong with the first damaged weights file of ``source`` (a folder or a file), named."""
    for path in _weight_files(source):
        problem = weight_file_problem(path)
        if problem is not None:
            return f"{os.path.basename(path)} is {problem}"
    return None


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
