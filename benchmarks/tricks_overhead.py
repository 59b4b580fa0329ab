"""Step time of TricksTrainer with every trick off against plain ``transformers.Trainer``, side by side.

    python benchmarks/tricks_overhead.py          # MiniLM-shaped BERT, batch 16 x 64: the figure in docs/tricks.md
    python benchmarks/tricks_overhead.py --quick  # a tiny BERT, seconds

One optimizer step as the Trainer's loop runs it: the item count of the batch (``_get_num_items_in_batch``),
``training_step`` (forward, loss, backward), the AdamW step and ``zero_grad``. Both trainers hold identical copies of a
BertForTokenClassification built from config (6 layers, hidden 384, 12 heads, intermediate 1536, vocab 30,522:
MiniLM's shape) and get the same batch. What TricksTrainer adds with every trick off: its loss pipeline (labels
popped, the configured cross-entropy on the logits, a sum over the item count) instead of the model's own loss, and
the loops over its tricks. Time: the median over interleaved rounds of the per-round ratio (``_timing.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile

import torch
from _timing import paired_ratio, time_interleaved
from transformers import BertConfig, BertForTokenClassification, Trainer, TrainingArguments

from nlp_tricks import TricksArguments, TricksTrainer

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def build(args_class, trainer_class, model, output_dir):
    args = args_class(output_dir=output_dir, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = trainer_class(model=model, args=args)
    trainer.create_optimizer()
    device = trainer.args.device

    def step(batch):
        num_items = trainer._get_num_items_in_batch([batch], device)
        trainer.training_step(trainer.model, batch, num_items)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny BERT: seconds")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 30; 5 with --quick)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for run_all.py)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 30)
    shape, batch_size, length = (TINY, 4, 16) if args.quick else (MINILM, 16, 64)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, num_labels=9, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **shape
    )
    base = BertForTokenClassification(config)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (batch_size, length)),
        "attention_mask": torch.ones(batch_size, length, dtype=torch.long),
        "labels": torch.randint(0, 9, (batch_size, length)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        plain = build(TrainingArguments, Trainer, copy.deepcopy(base), tmp)
        tricks = build(TricksArguments, TricksTrainer, copy.deepcopy(base), tmp)
        times = time_interleaved(
            {"plain Trainer": lambda: plain(batch), "TricksTrainer, tricks off": lambda: tricks(batch)}, repeats
        )
    rows = [
        {
            "benchmark": "tricks_overhead",
            "case": case,
            "baseline": "plain Trainer",
            "ratio": paired_ratio(times, case, "plain Trainer"),
            "median_ms": 1000 * statistics.median(times[case]),
        }
        for case in times
    ]
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"threads: {torch.get_num_threads()}, rounds: {repeats}, batch {batch_size} x {length}")
        for row in rows:
            print(f"{row['case']:28s} {row['ratio']:.3f}x plain   median {row['median_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
