"""EMA under 2-process DDP: count the gradient all-reduces, save each rank's weights, EMA and recorded trajectory.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/ema_ddp.py OUT_DIR

Runs 3 optimizer steps of a tiny BERT (2 micro-batches of 2 per step and process) without EMA ("plain") and with
``ema_decay`` and ``ema_eval`` (evaluating every step, so the swap runs under DDP too), and writes per setting and rank
``{name}_rank{r}.safetensors`` (final raw weights, plus the EMA under ``ema.`` keys and the weights after each
optimizer step under ``step{k}.`` keys, for the test's hand-computed average) and ``{name}_rank{r}.json`` (all-reduce
count, optimizer steps, EMA updates). tests/test_averaging.py launches it and checks the files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from nlp_tricks import TricksTrainer  # noqa: E402
from tiny import bert_token_cls, token_cls_data, tricks_args  # noqa: E402

SETTINGS = {
    "plain": dict(),
    "ema": dict(ema_decay=0.8, eval_strategy="steps", eval_steps=1),
}
STEPS = 3


class CountingTrainer(TricksTrainer):
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
        trainer = CountingTrainer(
            model=bert_token_cls(),
            args=args,
            train_dataset=token_cls_data(n=8 * STEPS),
            eval_dataset=token_cls_data(n=4, seed=1),
            callbacks=[recorder],
        )
        trainer.train()
        assert trainer.accelerator.num_processes == 2, "launch with --num_processes 2"
        rank = trainer.accelerator.process_index
        tensors = {k: v.detach().contiguous() for k, v in trainer.model.state_dict().items()}
        for step, weights in enumerate(recorder.after_step, start=1):
            tensors.update({f"step{step}.{k}": v for k, v in weights.items()})
        if trainer.ema is not None:
            tensors.update({f"ema.{k}": v for k, v in trainer.ema.state_dict()["shadow"].items()})
        save_file(tensors, str(out / f"{name}_rank{rank}.safetensors"))
        report = {
            "allreduces": trainer.allreduces,
            "steps": trainer.state.global_step,
            "ema_updates": None if trainer.ema is None else trainer.ema.num_updates,
            "evals": sum("eval_loss" in e for e in trainer.state.log_history),
            "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        }
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(report))
        trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
