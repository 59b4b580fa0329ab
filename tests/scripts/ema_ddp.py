"""EMA under 2-process DDP: count the gradient all-reduces, save each rank's weights, EMA and recorded trajectory.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/ema_ddp.py OUT_DIR

Runs 3 optimizer steps of a tiny BERT (2 micro-batches of 2 per step and process) without EMA ("plain") and with
``ema_decay`` and ``ema_eval`` (evaluating every step, so the swap runs under DDP too), and writes per setting and rank
``{name}_rank{r}.safetensors`` (final raw weights, plus the EMA under ``ema.`` keys and the weights after each
optimizer step under ``step{k}.`` keys, for the test's hand-computed average) and ``{name}_rank{r}.json`` (all-reduce
count, optimizer steps, EMA updates). tests/test_averaging.py launches it and checks the files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from ddp_helpers import AllReduceCountingTrainer, model_weights, save_rank  # noqa: E402
from tiny import (  # noqa: E402
    bert_token_cls,
    ema_of,  # noqa: E402
    token_cls_data,
    tricks_args,
)

SETTINGS = {
    "plain": dict(),
    "ema": dict(ema_decay=0.8, eval_strategy="steps", eval_steps=1),
}
STEPS = 3


class RecordWeights(TrainerCallback):
    """The trainable weights after each optimizer step (on_step_end comes after the step, before any evaluation)."""

    def __init__(self):
        self.after_step: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after_step.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name, setting in SETTINGS.items():
        args = tricks_args(
            out / name,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            gradient_accumulation_steps=2,
            optim="sgd",
            learning_rate=0.5,
            weight_decay=0.0,
            max_steps=STEPS,
            **setting,
        )
        recorder = RecordWeights()
        trainer = AllReduceCountingTrainer(
            model=bert_token_cls(),
            args=args,
            train_dataset=token_cls_data(n=8 * STEPS),
            eval_dataset=token_cls_data(n=4, seed=1),
            callbacks=[recorder],
        )
        trainer.train()
        tensors = model_weights(trainer)
        for step, weights in enumerate(recorder.after_step, start=1):
            tensors.update({f"step{step}.{k}": v for k, v in weights.items()})
        if ema_of(trainer) is not None:
            tensors.update({f"ema.{k}": v for k, v in ema_of(trainer).state_dict()["shadow"].items()})
        report = {
            "ema_updates": None if ema_of(trainer) is None else ema_of(trainer).num_updates,
            "evals": sum("eval_loss" in e for e in trainer.state.log_history),
        }
        save_rank(trainer, out, name, tensors, report)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
