"""A causal LM's chunked loss (DFT, label smoothing) under 2-process DDP: one SGD step over 8 sequences, each rank's
weights saved.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/causal_lm_ddp.py OUT_DIR

Each rank sees 4 of the 8 sequences (2 micro-batches of 2); the loss is a sum over the step's label count over both
processes, so the step equals one process with a batch of 8. tests/test_causal_lm.py launches it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from ddp_helpers import save_rank  # noqa: E402
from nlp_tricks import TricksTrainer  # noqa: E402
from tiny import sgd_step_args  # noqa: E402
from tiny_causal import causal_lm_data, llama_lm  # noqa: E402

SETTINGS = {
    "dft": dict(loss_type="dft"),
    "label_smoothing": dict(loss_type="label_smoothing", label_smoothing_factor=0.1),
}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name, setting in SETTINGS.items():
        args = sgd_step_args(out / name, per_device_train_batch_size=2, gradient_accumulation_steps=2, **setting)
        trainer = TricksTrainer(model=llama_lm(), args=args, train_dataset=causal_lm_data(n=8))
        assert trainer.lm_loss_path == "chunked"
        trainer.train()
        save_rank(trainer, out, name)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
