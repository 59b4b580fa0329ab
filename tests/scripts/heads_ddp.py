"""CRF and class-weighted training under 2-process DDP: one SGD step over 8 examples, each rank's weights saved.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/heads_ddp.py OUT_DIR

Each rank sees 4 of the 8 examples (2 micro-batches of 2); the item counts (sentences for the CRF, weight sums for
class weights) are summed over both processes, so the step equals one process with a batch of 8.
tests/test_heads_ddp.py launches it and compares ``{name}_rank{r}.safetensors`` with a single-process step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from ddp_helpers import save_rank  # noqa: E402
from nlp_tricks import TricksTrainer  # noqa: E402
from tiny import bert_token_cls, sgd_step_args, token_cls_data  # noqa: E402

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
SETTINGS = {
    "crf": dict(crf=True, crf_bio_constraints=True, crf_lr_scale=4.0),
    "class_weights": dict(class_weights=[0.5, 2.0, 1.0, 3.0, 0.25]),
}


def ner_model():
    model = bert_token_cls()
    model.config.id2label = dict(enumerate(LABELS))
    model.config.label2id = {label: i for i, label in enumerate(LABELS)}
    return model


def ner_data():
    """8 sentences of valid BIO tags (O / B-PER / B-LOC only) whose word counts differ."""
    data = token_cls_data(n=8)
    for item in data.items:
        tags = torch.tensor([0, 1, 3])[item["labels"].clamp(min=0) % 3]
        item["labels"] = torch.where(item["labels"] == -100, -100, tags)
    return data


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name, setting in SETTINGS.items():
        args = sgd_step_args(out / name, per_device_train_batch_size=2, gradient_accumulation_steps=2, **setting)
        trainer = TricksTrainer(model=ner_model(), args=args, train_dataset=ner_data())
        trainer.train()
        save_rank(trainer, out, name)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
