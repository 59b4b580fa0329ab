"""Run safety under 2-process DDP: every process takes the same decision.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/run_safety_ddp.py OUT_DIR

- "diverged": rank 1's loss is NaN at step 3 with finite gradients (a NaN constant added), so only the loss flag of
  one process says so; both ranks must stop at step 3 with the same TrainingDivergedError.
- "busy": OUT_DIR/held is locked by another process (the test); both ranks must raise OutputDirBusyError, without
  one of them waiting on a lock or on the other.
- "free": a run on a free folder: the main process holds the lock while it trains, the other never blocks on it.

Each rank writes ``report_rank{r}.json``; tests/test_run_safety_ddp.py launches it and reads them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from nlp_tricks import Trick, TricksTrainer  # noqa: E402
from nlp_tricks.runtime.divergence import TrainingDivergedError  # noqa: E402
from nlp_tricks.runtime.lock import LOCK_NAME, OutputDirBusyError  # noqa: E402
from tiny import bert_seq_cls, seq_cls_data, tricks_args  # noqa: E402


class NanLossOnRank(Trick):
    """Adds NaN to the loss at one step on one process: the loss is NaN, its gradients stay finite."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def adjust_loss(self, trainer, inputs, outputs, loss):
        if trainer.args.process_index == self.rank and trainer.state.global_step + 1 == self.step:
            return loss + float("nan")
        return loss


class LockSeen(Trick):
    """Records, during training, whether the folder's lock file exists (the main process holds it)."""

    seen = None

    def adjust_loss(self, trainer, inputs, outputs, loss):
        LockSeen.seen = (Path(trainer.args.output_dir) / LOCK_NAME).exists()
        return loss


def train(out: Path, tricks=()) -> tuple[TricksTrainer, str | None, int | None]:
    trainer = TricksTrainer(
        model=bert_seq_cls(),
        args=tricks_args(out, max_steps=5, per_device_train_batch_size=2),
        train_dataset=seq_cls_data(n=20),
        tricks=list(tricks),
    )
    try:
        trainer.train()
    except (TrainingDivergedError, OutputDirBusyError) as error:
        return trainer, f"{type(error).__name__}: {error}", getattr(error, "step", None)
    return trainer, None, None


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    trainer, diverged, diverged_step = train(out / "diverged", [NanLossOnRank(rank=1, step=3)])
    rank = trainer.accelerator.process_index
    steps_when_diverged = trainer.state.global_step
    _, busy, _ = train(out / "held")
    free, free_error, _ = train(out / "free", [LockSeen()])
    report = {
        "world_size": trainer.accelerator.num_processes,
        "diverged": diverged,
        "diverged_step": diverged_step,
        "steps_when_diverged": steps_when_diverged,
        "busy": busy,
        "free_error": free_error,
        "free_steps": free.state.global_step,
        "lock_seen_while_training": LockSeen.seen,
        "lock_left_after": (out / "free" / LOCK_NAME).exists(),
    }
    (out / f"report_rank{rank}.json").write_text(json.dumps(report))
    free.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
