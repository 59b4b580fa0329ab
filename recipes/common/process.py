"""Which process of a launched job this is, and warnings that a job of N processes shows once."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("nlp_tricks.recipes")


def is_main_process() -> bool:
    """Rank 0 of a launched job (or a plain run), read from the launcher's environment without any collective."""
    return int(os.environ.get("RANK", "0")) == 0


def warn(message: str) -> None:
    """A warning on the main process only (a launched job with N processes shows it once)."""
    if is_main_process():
        logger.warning(message)
