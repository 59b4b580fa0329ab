"""TricksArguments and TricksConfig, composed from the argument dataclasses of the built-in tricks (one per trick, in
``nlp_tricks/tricks/``, listed by the registry :data:`~nlp_tricks.tricks.BUILT_IN_TRICKS`): a new trick's fields
join both by its registry line.

- :class:`TricksConfig`: the trick fields alone, validated in ``__post_init__`` (for a trainer of your own, or a
  host trainer whose arguments class you keep).
- :class:`TricksArguments`: ``TrainingArguments`` plus every trick field: what :class:`~nlp_tricks.TricksTrainer` and
  the recipes take. Field names are the CLI and YAML names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from .functional.adversarial import ADV_NORMS
from .runtime.divergence import RunSafetyArguments, validate_divergence_arguments
from .tricks import trick_arguments, validate_arguments
from .tricks.adversarial import ADVERSARIAL_METHODS
from .tricks.loss_type import LOSS_TYPES

__all__ = ["TricksConfig", "TricksArguments", "LOSS_TYPES", "ADVERSARIAL_METHODS", "ADV_NORMS"]

# The fields in --help's order: each trick's in the registry's order, then run safety's. A dataclass collects its
# bases' fields last base first, so the bases are that list reversed.
_FIELD_GROUPS = (*trick_arguments(), RunSafetyArguments)


@dataclass
class TricksConfig(*reversed(_FIELD_GROUPS)):
    """The knobs of every trick in nlp_tricks. Bad values raise ``ValueError`` naming the field and what is
    allowed."""

    def __post_init__(self):
        self._validate_tricks()

    def revalidate(self) -> None:
        """Check the trick fields again after they were set on built arguments (a hyperparameter-search trial sets
        them one by one): defaults that follow other fields derived again, every trick's checks."""
        for name in self._derived:
            setattr(self, name, None)
        self._validate_tricks()

    def _validate_tricks(self) -> None:
        # Defaults that follow other fields (ema_eval follows ema_decay) are recorded here by the tricks' checks.
        self._derived = set()
        # Each trick's checks are in its file (nlp_tricks/tricks/); checks across two tricks in validate_arguments.
        validate_arguments(self)
        validate_divergence_arguments(self)


@dataclass
class TricksArguments(TricksConfig, TrainingArguments):
    """``TrainingArguments`` plus the knobs of every trick in nlp_tricks.

    Every field has a ``help`` text, so ``--help`` on a recipe documents it. Bad values raise ``ValueError`` naming
    the field and what is allowed.
    """

    warmup_ratio: float | None = field(
        default=None,
        metadata={
            "help": "Fraction in [0, 1) of the training steps spent in linear warmup. transformers 5 removed this "
            "argument; it is mapped to the fractional `warmup_steps`."
        },
    )

    def __post_init__(self):
        self._map_warmup_ratio()  # before the parent validates `warmup_steps`
        TrainingArguments.__post_init__(self)
        self._validate_tricks()

    def revalidate(self) -> None:
        self._map_warmup_ratio(replacing=True)
        super().revalidate()

    def _map_warmup_ratio(self, replacing: bool = False) -> None:
        if self.warmup_ratio is None:
            return
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} is not allowed; it must be in [0, 1)")
        if not replacing and self.warmup_steps not in (0, self.warmup_ratio):
            raise ValueError(
                f"give warmup_ratio ({self.warmup_ratio}) or warmup_steps ({self.warmup_steps}), not both"
            )
        self.warmup_steps = self.warmup_ratio
