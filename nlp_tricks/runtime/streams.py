"""A trick's own stream of batches (``trainer.data_stream(...)``): unlabelled text for a consistency term, a replay
buffer, a second task.

One batch per micro-batch, the same way the training data is split: each process reads its own shard, each
micro-batch of an accumulated step takes the next batch, and the position (epoch, batch) is saved in every checkpoint
and restored on resume, so an interrupted run reads exactly the batches an uninterrupted one would. The order is a
seeded permutation per epoch, so resuming needs no replay of the batches before the position.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from . import upstream

__all__ = ["TrickDataStream"]


class TrickDataStream:
    """Batches of ``dataset`` for a trick, sharded over processes and resumable (see the module docstring).

    Args:
        trainer: the :class:`~nlp_tricks.TricksTrainer` (its processes, device, collator and seed).
        dataset: a map-style dataset (``len`` and integer indexing: a ``datasets.Dataset``, a list of dicts).
        batch_size (`int`, *optional*): examples per process per micro-batch (default ``per_device_train_batch_size``).
        collate_fn (*optional*): turns a list of examples into a batch (default: the trainer's data collator).
        shuffle (`bool`, defaults to True): a new seeded permutation each epoch (``seed + epoch``).
        seed (`int`, *optional*): default ``args.seed``.
    """

    def __init__(
        self,
        trainer,
        dataset: Sequence,
        *,
        batch_size: int | None = None,
        collate_fn: Callable[[list], dict] | None = None,
        shuffle: bool = True,
        seed: int | None = None,
    ):
        if len(dataset) == 0:
            raise ValueError("data_stream got an empty dataset")
        self.trainer, self.dataset = trainer, dataset
        self.batch_size = int(batch_size or trainer.args.per_device_train_batch_size)
        if self.batch_size < 1:
            raise ValueError(f"data_stream batch_size={batch_size} is not allowed; it must be >= 1")
        self.collate_fn = collate_fn or trainer.data_collator
        self.shuffle = shuffle
        self.seed = trainer.args.seed if seed is None else int(seed)
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        """Batches each process reads per epoch (the shards are padded by wrapping, so every process reads as many)."""
        world = self.trainer.accelerator.num_processes
        return math.ceil(math.ceil(len(self.dataset) / world) / self.batch_size)

    def _shard(self) -> list[int]:
        n, world = len(self.dataset), self.trainer.accelerator.num_processes
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        per_process = math.ceil(n / world)
        order = (order * math.ceil(per_process * world / n))[: per_process * world]  # wrap so shards are equal
        return order[self.trainer.accelerator.process_index :: world]

    def next_batch(self) -> dict:
        """This micro-batch's batch, collated and on the training device."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        shard = self._shard()
        indices = shard[self.position * self.batch_size : (self.position + 1) * self.batch_size]
        self.position += 1
        batch = self.collate_fn([self.dataset[i] for i in indices])
        return upstream.prepare_inputs(self.trainer, batch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
