"""Launched with 2 processes by tests/test_self_training.py: predict_logits splits the examples and gathers them back.

Every rank writes the gathered logits (safetensors) and which examples it predicted itself.
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file
from transformers import DataCollatorWithPadding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nlp_tricks.self_training import predict_logits  # noqa: E402
from tiny import bert_token_cls, word_tokenizer  # noqa: E402

SENTENCES = ["the cat", "a dog ran on the mat", "the", "dog sat", "a cat sat on a mat", "ran", "the dog ran"]


def main(out: Path):
    accelerator = Accelerator(cpu=True)
    tokenizer = word_tokenizer()
    rows = [dict(tokenizer(s)) for s in SENTENCES]
    model = bert_token_cls(num_labels=3).eval()
    logits = predict_logits(model, rows, DataCollatorWithPadding(tokenizer), batch_size=2, accelerator=accelerator)
    rank = accelerator.process_index
    save_file({f"logits_{i}": torch.from_numpy(x) for i, x in enumerate(logits)}, str(out / f"rank{rank}.safetensors"))
    with accelerator.split_between_processes(list(range(len(rows)))) as mine:
        (out / f"rank{rank}.json").write_text(json.dumps({"world_size": accelerator.num_processes, "mine": mine}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
