"""Span heads under 2-process DDP: one SGD step over 8 sentences, each rank's weights saved.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/span_head_ddp.py OUT_DIR

Each rank sees 4 of the 8 sentences (2 micro-batches of 2); three sentences have no word, so micro-batches hold
different item counts. The items (sentences with a word x entity types) are summed over both processes, so the step
equals one process with a batch of 8. tests/test_span_head.py launches it and compares
``{name}_rank{r}.safetensors`` with a single-process step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from ddp_helpers import save_rank  # noqa: E402
from nlp_tricks import TricksTrainer  # noqa: E402
from nlp_tricks.functional.spans import add_span_head  # noqa: E402
from tiny import bert_token_cls, sgd_step_args, span_data  # noqa: E402

SETTINGS = {head: dict(span_head=head, span_head_size=8) for head in ("global_pointer", "efficient_global_pointer")}
# Sentences without a word: no item of the loss.
EMPTY = (1, 3, 5)


def span_model(head: str):
    model = bert_token_cls(num_labels=3)
    add_span_head(model, head, 8)
    return model


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name, setting in SETTINGS.items():
        args = sgd_step_args(out / name, per_device_train_batch_size=2, gradient_accumulation_steps=2, **setting)
        trainer = TricksTrainer(model=span_model(name), args=args, train_dataset=span_data(n=8, empty=EMPTY))
        trainer.train()
        save_rank(trainer, out, name)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
