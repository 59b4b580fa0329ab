"""Adversarial training under 2-process DDP: count the gradient all-reduces, save each rank's weights.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/adversarial_ddp.py OUT_DIR

Runs a few optimizer steps of a tiny BERT per setting (plain, FGM, PGD, AWP, FreeLB, R-Drop with accumulation; one
exactness step each for PGD and FreeLB) and
writes, per setting and rank, ``{name}_rank{r}.safetensors`` (the weights) and ``{name}_rank{r}.json`` (all-reduce
count, optimizer steps, skipped attacks). tests/test_adversarial_ddp.py launches it and checks the files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from ddp_helpers import AllReduceCountingTrainer, save_rank  # noqa: E402
from tiny import bert_token_cls, token_cls_data, tricks_args  # noqa: E402

SETTINGS = {
    "plain": dict(max_steps=3, adversarial="none"),
    "fgm": dict(max_steps=3, adversarial="fgm"),
    "pgd": dict(max_steps=3, adversarial="pgd", adv_steps=3, adv_alpha=0.6),
    # One step over all 8 examples; per-example norms make it equal to one single-process batch of 8.
    "example": dict(max_steps=1, adversarial="pgd", adv_norm="example", adv_steps=2, adv_epsilon=0.5),
    # Step 1 plain (adv_start_step), steps 2 and 3 attacked.
    "awp": dict(max_steps=3, adversarial="awp", awp_gamma=0.05, adv_start_step=1),
    # A random start: a clean pass plus K = 2 perturbed passes.
    "freelb": dict(max_steps=3, adversarial="freelb", adv_steps=2, adv_init_mag=0.1),
    # FreeLB's norms are per example: one step over all 8 examples equals one single-process batch of 8.
    "freelb_example": dict(max_steps=1, adversarial="freelb", adv_steps=3, adv_epsilon=0.4),
    "rdrop": dict(max_steps=3, rdrop_alpha=1.0, model=dict(hidden_dropout_prob=0.1)),
}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name, setting in SETTINGS.items():
        setting = dict(setting)
        model_kwargs = setting.pop("model", {})
        args = tricks_args(
            out / name,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            optim="sgd",
            learning_rate=0.5,
            weight_decay=0.0,
            logging_steps=1,
            **setting,
        )
        data = token_cls_data(n=8 * setting["max_steps"])
        trainer = AllReduceCountingTrainer(model=bert_token_cls(**model_kwargs), args=args, train_dataset=data)
        trainer.train()
        report = {
            "adv_skipped": trainer.trick_state.get("adv_skipped"),
            "adv_plain_steps": trainer.trick_state.get("adv_plain_steps"),
            "logged": [e for e in trainer.state.log_history if "loss" in e],
        }
        save_rank(trainer, out, name, report=report)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
