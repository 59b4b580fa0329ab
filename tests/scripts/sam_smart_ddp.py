"""SAM and SMART under 2-process DDP: count the gradient all-reduces, save each rank's weights.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/sam_smart_ddp.py OUT_DIR

Runs 2 optimizer steps of a tiny BERT per setting (plain, SAM, SMART + FGM; 2 micro-batches per step)
and writes, per setting and rank, ``{name}_rank{r}.safetensors`` (the weights) and ``{name}_rank{r}.json``
(all-reduce count, optimizer steps, logs). tests/test_sam_smart_ddp.py launches it and checks the files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from ddp_helpers import AllReduceCountingTrainer, save_rank  # noqa: E402
from tiny import bert_token_cls, token_cls_data, tricks_args  # noqa: E402

SETTINGS = {
    "plain": dict(),
    "sam": dict(sam_rho=0.5),
    "smart_fgm": dict(smart_alpha=2.0, smart_epsilon=0.05, smart_step_size=0.02, adversarial="fgm"),
}
STEPS = 2


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
        trainer = AllReduceCountingTrainer(
            model=bert_token_cls(), args=args, train_dataset=token_cls_data(n=8 * STEPS)
        )
        trainer.train()
        report = {
            "trick_state": dict(trainer.trick_state),
            "logged": [e for e in trainer.state.log_history if "loss" in e],
        }
        save_rank(trainer, out, name, report=report)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
