"""What the 2-process DDP scripts (tests/scripts/*_ddp.py) share: a trainer that counts the gradient all-reduces, and
the writer of each rank's ``{name}_rank{r}.safetensors`` and ``{name}_rank{r}.json`` that their tests read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from nlp_tricks import TricksTrainer


class AllReduceCountingTrainer(TricksTrainer):
    """Counts the DDP gradient all-reduces (one comm-hook call per bucket) with a comm hook."""

    allreduces = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        if isinstance(model, DistributedDataParallel) and not getattr(model, "_counted", False):

            def counting_allreduce(state, bucket):
                self.allreduces += 1
                return default_hooks.allreduce_hook(None, bucket)

            model.register_comm_hook(None, counting_allreduce)
            model._counted = True
        return super().training_step(model, inputs, num_items_in_batch)


def model_weights(trainer: TricksTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in trainer.model.state_dict().items()}


def save_rank(
    trainer: TricksTrainer, out: Path, name: str, tensors: dict | None = None, report: dict | None = None
) -> None:
    """Writes this rank's ``{name}_rank{r}.safetensors`` (``tensors``, by default the model's weights) and, with
    ``report``, ``{name}_rank{r}.json``: ``report`` plus the optimizer steps, the world size and the all-reduce count
    (None unless the trainer counts them); then waits for the other rank."""
    assert trainer.accelerator.num_processes == 2, "launch with --num_processes 2"
    rank = trainer.accelerator.process_index
    save_file(model_weights(trainer) if tensors is None else tensors, str(out / f"{name}_rank{rank}.safetensors"))
    if report is not None:
        report = {
            "allreduces": getattr(trainer, "allreduces", None),
            "steps": trainer.state.global_step,
            "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            **report,
        }
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(report))
    trainer.accelerator.wait_for_everyone()
