"""BuiltInTrick: what a trick nlp_tricks ships declares beside the protocol (:class:`~nlp_tricks.Trick`), and all the
trainer and the registry read of it."""

from __future__ import annotations

from typing import ClassVar

from ..trick import LossBatch, LossInForward, Trick

__all__ = ["BuiltInTrick", "HeadLossTrick"]


class BuiltInTrick(Trick):
    """A built-in trick: one file in ``nlp_tricks/tricks/`` named after its flag, holding its argument dataclass and
    this class, named ``<Flag>Trick`` (``crf.py``: ``CRFTrick``), and one line in
    :data:`~nlp_tricks.tricks.BUILT_IN_TRICKS`. Its fields switch it on (:meth:`enabled`) and are checked
    (:meth:`validate`) whenever the arguments are built; :class:`~nlp_tricks.TricksConfig` is composed of the
    registry's ``arguments``.
    """

    #: The dataclass of its fields (every field with ``metadata={"help": ...}``): a base of TricksConfig.
    arguments: ClassVar[type]
    #: Whether its fields are TricksConfig's; False where another arguments class holds them (tying's are
    #: Seq2SeqTricksArguments').
    in_tricks_config: ClassVar[bool] = True
    #: The files that held its state in a checkpoint written before the state store (what resuming one needs).
    legacy_files: ClassVar[tuple[str, ...]] = ()

    def __init__(self, args):
        #: The arguments it was built from: TricksArguments, or a host trainer's view of its TricksConfig.
        self.args = args

    @classmethod
    def enabled(cls, args) -> bool:
        """Whether ``args`` switch this trick on."""
        raise NotImplementedError(f"{cls.__name__}.enabled")

    @classmethod
    def from_args(cls, args) -> BuiltInTrick | None:
        """The trick ``args`` switch on, or ``None``."""
        return cls(args) if cls.enabled(args) else None

    @staticmethod
    def validate(args) -> None:
        """Check this trick's own fields of ``args``: raise ``ValueError`` naming the field and what is allowed. A
        default that follows other fields is derived here (its name added to ``args._derived``, so that a search
        trial derives it again); a check that involves two tricks goes in
        :func:`~nlp_tricks.tricks.validate_arguments`."""

    def legacy_state(self, legacy: dict) -> dict | None:
        """Its state as a checkpoint written before the state store held it (``legacy``:
        :func:`~nlp_tricks.runtime.state.legacy_state`'s dict), or ``None``: by default its ``logged_state`` counters,
        which ``trainer_state.json`` kept then. Called where :meth:`load_state_dict` would be (after
        ``on_train_begin``)."""
        saved = legacy["trick_state"]
        counters = {key: saved[key] for key in self.logged_state if key in saved}
        return counters or None


class HeadLossTrick(BuiltInTrick):
    """A built-in trick whose head computes the loss inside the model's forward (:class:`~nlp_tricks.trick.
    LossInForward`, attached in ``prepare_model`` as ``self._hook``): the CRF, a span head. Its loss replaces the
    labels' loss, so a batch with teacher logits (distillation) is refused, naming :attr:`flag`."""

    #: The flag that switches it on, as a refusal names it.
    flag: ClassVar[str]

    def __init__(self, args):
        super().__init__(args)
        self._hook: LossInForward | None = None

    def prepare_loss_batch(self, trainer, batch: LossBatch) -> LossBatch:
        if batch.teacher_logits is not None:
            raise ValueError(f"{self.flag} does not apply to batches with teacher_logits (distillation)")
        return batch

    def forward_context(self, trainer, batch: LossBatch):
        return self._hook.computing(batch)
