"""SAM and SMART under 2-process DDP: count the gradient all-reduces, save each rank's weights.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/sam_smart_ddp.py OUT_DIR

Runs 2 optimizer steps of a tiny BERT per setting (plain, SAM, SMART + FGM; 2 micro-batches per step)
and writes, per setting and rank, ``{name}_rank{r}.safetensors`` (the weights) and ``{name}_rank{r}.json``
(all-reduce count, optimizer steps, logs). tests/test_sam_smart_ddp.py launches it and checks the files.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from nlp_tricks import TricksTrainer  # noqa: E402
from tiny import bert_token_cls, token_cls_data, tricks_args  # noqa: E402

SETTINGS = {
    "plain": dict(),
    "sam": dict(sam_rho=0.5),
    "smart_fgm": dict(smart_alpha=2.0, smart_epsilon=0.05, smart_step_size=0.02, adversarial="fgm"),
}
STEPS = 2


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


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name, setting in SETTINGS.items():
        args = tricks_args(
            out / name,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=STEPS,
            optim="sgd",
            learning_rate=0.5,
            weight_decay=0.0,
            logging_steps=1,
            **setting,
        )
        trainer = CountingTrainer(model=bert_token_cls(), args=args, train_dataset=token_cls_data(n=8 * STEPS))
        trainer.train()
        assert trainer.accelerator.num_processes == 2, "launch with --num_processes 2"
        rank = trainer.accelerator.process_index
        weights = {k: v.detach().contiguous() for k, v in trainer.model.state_dict().items()}
        save_file(weights, str(out / f"{name}_rank{rank}.safetensors"))
        report = {
            "allreduces": trainer.allreduces,
            "steps": trainer.state.global_step,
            "trick_state": dict(trainer.trick_state),
            "logged": [e for e in trainer.state.log_history if "loss" in e],
            "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        }
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(report))
        trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
