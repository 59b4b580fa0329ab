"""What TricksTrainer keeps of its tricks across checkpoints: the state holders (the tricks with state, their data
streams, the trainer's own numbers), the one store written into every ``checkpoint-N``, what resuming needs of a
checkpoint, and the restore. A mixin of :class:`~nlp_tricks.TricksTrainer`; the store's format is
:mod:`nlp_tricks.runtime.state`.

The restore comes once every trick's ``on_train_begin`` has run: a trick builds what holds its state there (the EMA,
from the weights training starts from), and ``load_state_dict`` fills it; no trick keeps a state waiting for its
holder.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping

from transformers import TrainerCallback

from .resume import checkpoint_to_resume
from .state import (
    TRAINER_ENTRY,
    TRICKS_STATE_NAME,
    StateEntries,
    TrickStateView,
    restore_states,
    save_trick_states,
)
from .streams import TrickDataStream

__all__ = ["TrickStateStore"]


class TrickStateStore:
    """The tricks' state in checkpoints: saved with each ``checkpoint-N``, restored on resume (see the module
    docstring). The trainer provides ``tricks``, ``_streams``, ``_own_state`` and :meth:`_legacy_holders`."""

    def _state_holders(self) -> dict[str, object]:
        """Everything whose ``state_dict()`` each checkpoint carries, by its unique name: the tricks with state and
        the tricks' data streams."""
        holders = {trick.state_name: trick for trick in self.tricks if trick.has_state()}
        holders.update(self._streams)
        return holders

    @property
    def required_checkpoint_files(self) -> tuple:
        """What the tricks of this run need in a ``checkpoint-N`` folder to resume from it: their entries in the
        state store (a checkpoint written before the store: the files that held the same state then)."""
        holders = self._state_holders()
        if not holders:
            return ()
        legacy = self._legacy_holders()
        files = tuple(name for holder in legacy.values() for name in holder.legacy_files)
        return (StateEntries(tuple(holders), legacy=len(legacy) == len(holders), legacy_files=files),)

    def _resume_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint ``train(resume_from_checkpoint=...)`` resumes from: ``True`` picks the newest complete one;
        a named one that is incomplete is refused, saying what is missing."""
        required = self.required_checkpoint_files
        resume_from_checkpoint = checkpoint_to_resume(resume_from_checkpoint, self.args.output_dir, required)
        return os.fspath(resume_from_checkpoint) if resume_from_checkpoint else None

    def _save_trick_states(self, folder: str) -> None:
        states = {name: holder.state_dict() for name, holder in self._state_holders().items()}
        states[TRAINER_ENTRY] = {"trick_state": dict(self._own_state), "optimizer_groups": self._optimizer_groups}
        save_trick_states(os.path.join(folder, TRICKS_STATE_NAME), states)

    def _add_state_restorer(self) -> None:
        """Put the restore right after the tricks among the callbacks (again after a search trial re-adds them)."""
        restorer = getattr(self, "_state_restorer", None)
        if restorer is None:
            restorer = self._state_restorer = _RestoreAfterTrainBegin(self)
        else:
            self.remove_callback(restorer)
        self.add_callback(restorer)

    def _restore_trick_states(self) -> None:
        """Restore every state holder's entry of the checkpoint ``train()`` resumes from (if any) and the trainer's
        own numbers."""
        checkpoint, self._resume_states_from = self._resume_states_from, None
        if checkpoint is None:
            return
        own = restore_states(checkpoint, self._state_holders(), self._legacy_holders())
        self._own_state.clear()
        self._own_state.update(own)

    @property
    def trick_state(self) -> dict:
        """The cumulative numbers logged as they are in every training log: the trainer's own (a subclass writes
        ``trainer.trick_state[name] = value``; saved with each checkpoint) and each trick's ``logged_state`` (read
        from its ``state_dict()``)."""
        logged = {}
        for trick in self.tricks:
            if trick.logged_state:
                state = trick.state_dict()
                logged.update({key: state[key] for key in trick.logged_state if key in state})
        return TrickStateView(self._own_state, logged)

    @trick_state.setter
    def trick_state(self, value: Mapping) -> None:
        self._own_state = dict(value)

    def data_stream(self, name: str, dataset, **options) -> TrickDataStream:
        """A trick's own stream of batches (unlabelled text for a consistency term, a replay buffer): sharded over
        processes, one batch per micro-batch, its position saved in every checkpoint under ``name`` and restored on
        resume. ``options``: see :class:`~nlp_tricks.runtime.streams.TrickDataStream`. Call it in ``setup``."""
        taken = {trick.state_name for trick in self.tricks if trick.has_state()} | set(self._streams) | {TRAINER_ENTRY}
        if name in taken:
            raise ValueError(
                f"data_stream name {name!r} is taken (by a trick's state or another stream); choose another"
            )
        stream = TrickDataStream(self, dataset, **options)
        self._streams[name] = stream
        return stream


class _RestoreAfterTrainBegin(TrainerCallback):
    """Restores the states of the checkpoint ``train()`` resumes from at ``on_train_begin``, placed after the tricks'
    callbacks so that their own ``on_train_begin`` has built what holds the state. It holds the trainer weakly."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._restore_trick_states()
