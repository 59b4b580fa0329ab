"""Preemption under 2-process DDP: SIGTERM to rank 1 only, inside step 7; both ranks must stop after step 7 with one
complete checkpoint, and resuming from it must give the uninterrupted run's raw and EMA weights.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/preempt_ddp.py OUT_DIR

A tiny BERT with dropout 0.1, EMA 0.9, R-Drop, FGM and gradient accumulation 2 trains 12 steps uninterrupted
("reference"), then again with the signal ("run"), then resumes "run". Each rank writes ``report_rank{r}.json``
(where it stopped, the largest differences to the reference, the cost of the per-step flag all-reduce);
tests/test_preemption.py launches it and checks the files. Also imported by that test for the one-process case.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from nlp_tricks import TricksTrainer  # noqa: E402
from tiny import (  # noqa: E402
    bert_token_cls,
    ema_of,  # noqa: E402
    token_cls_data,
    tricks_args,
)

STEPS = 12


class SendSignal(TrainerCallback):
    """Sends ``signum`` to this process inside step ``step`` (after its backward passes, before its optimizer step),
    on process ``rank`` only (every process with None): where a real preemption lands, without timing."""

    def __init__(self, step: int, signum: int = signal.SIGTERM, rank: int | None = None):
        self.step, self.signum, self.rank = step, signum, rank

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1 and self.rank in (None, args.process_index):
            os.kill(os.getpid(), self.signum)


def run_settings(out: Path, steps: int, send: SendSignal | None = None, resume: bool = False) -> TricksTrainer:
    """Train the tiny BERT with every stateful trick on (dropout, EMA, R-Drop, FGM, accumulation); the trainer."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = tricks_args(
        out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-2,
        ema_decay=0.9,
        rdrop_alpha=1.0,
        adversarial="fgm",
        enable_jit_checkpoint=True,
        logging_steps=100,
    )
    trainer = TricksTrainer(
        model=bert_token_cls(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
        args=args,
        # 5 optimizer steps an epoch on each process: a stop at step 7 is in the middle of the second epoch.
        train_dataset=token_cls_data(n=20 * world),
        callbacks=[send] if send is not None else None,
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer


def weights(trainer: TricksTrainer) -> tuple[dict, dict]:
    raw = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    ema = {k: v.detach().clone() for k, v in ema_of(trainer).state_dict()["shadow"].items()}
    return raw, ema


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    reference = run_settings(out / "reference", STEPS)
    raw_ref, ema_ref = weights(reference)
    rank = reference.accelerator.process_index
    step_seconds = reference.state.log_history[-1]["train_runtime"] / STEPS

    stopped = run_settings(out / "run", STEPS, send=SendSignal(step=7, rank=1))
    stopped_by, stopped_at = stopped.preempted, stopped.state.global_step
    sync = stopped.preemption
    checkpoints = sorted(p.name for p in (out / "run").iterdir() if p.name.startswith("checkpoint-"))
    stopped.accelerator.wait_for_everyone()

    resumed = run_settings(out / "run", STEPS, resume=True)
    raw, ema = weights(resumed)
    report = {
        "world_size": resumed.accelerator.num_processes,
        "stopped_by": stopped_by,
        "stopped_at": stopped_at,
        "checkpoints": checkpoints,
        "resumed_to": resumed.state.global_step,
        "max_raw_diff": max_diff(raw, raw_ref),
        "max_ema_diff": max_diff(ema, ema_ref),
        "flag_allreduce_ms": 1e3 * sync.sync_seconds / max(sync.syncs, 1),
        "step_ms": 1e3 * step_seconds,
    }
    (out / f"report_rank{rank}.json").write_text(json.dumps(report))
    resumed.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
