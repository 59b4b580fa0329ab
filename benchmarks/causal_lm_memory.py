"""Peak memory and time of a causal LM's training step: plain ``Trainer`` against ``TricksTrainer`` with every trick
off, with label smoothing (the loss in chunks from the last hidden state) and with label smoothing on the full logits
(the path every loss trick took before), side by side in one run.

    python benchmarks/causal_lm_memory.py            # tiny Llama, vocab 49,152: batch 4 x 512 and 2 x 2048 tokens
    python benchmarks/causal_lm_memory.py --quick    # small shapes, seconds

The model: a Llama built from config (hidden 128, 2 layers, 4 heads / 2 key-value heads, ffn 512, vocab 49,152 as
SmolLM2's, tied embeddings), full fine-tuning with AdamW; labels are the input ids (every position counts, so no
saving comes from skipped prompt tokens). A step is the Trainer's: the item count, ``training_step`` (forward, loss,
backward), ``optimizer.step`` and ``zero_grad``.

- Memory: each case in a fresh process: the peak resident memory of two steps above the memory once the model and the
  trainer are built (the peak is reset there).
- Time: all cases in this process, the median over interleaved rounds; ratios are medians of the per-round ratios
  (``_timing.py``). With one thread (``--threads 1``, the default) the time is this process's CPU time, which other
  jobs on the machine barely change; with more, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from _timing import paired_ratio, time_interleaved
from losses import _peak_rss_bytes, _rss_bytes
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from nlp_tricks import Trick, TricksArguments, TricksTrainer

SMOOTHING = {"loss_type": "label_smoothing", "label_smoothing_factor": 0.1}


class KeepFullLogits(Trick):
    """Declares that it reads the full logits: the run keeps them (the path every loss trick took before)."""

    needs_logits = True


# case -> (trainer class, arguments class, trick fields, tricks)
CASES = {
    "plain Trainer": (Trainer, TrainingArguments, {}, ()),
    "TricksTrainer, tricks off": (TricksTrainer, TricksArguments, {}, ()),
    "label smoothing, chunked": (TricksTrainer, TricksArguments, SMOOTHING, ()),
    "label smoothing, full logits": (TricksTrainer, TricksArguments, SMOOTHING, (KeepFullLogits,)),
}
BASELINE = "plain Trainer"
SHAPES = ((4, 512), (2, 2048))
QUICK_SHAPES = ((2, 64),)
MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


def build_step(case: str, batch_size: int, length: int, vocab: int, output_dir: str):
    """``(step, batch)`` for one case: a fresh model (seed 0) and trainer, and the Trainer's optimizer step."""
    trainer_cls, args_cls, settings, tricks = CASES[case]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=length, tie_word_embeddings=True, **MODEL)
    model = LlamaForCausalLM(config)
    args = args_cls(
        output_dir=output_dir, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, **settings
    )
    kwargs = {"tricks": [t() for t in tricks]} if tricks else {}
    trainer = trainer_cls(model=model, args=args, **kwargs)
    trainer.create_optimizer()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch_size, length), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    device = trainer.args.device

    def step():
        num_items = trainer._get_num_items_in_batch([batch], device)
        trainer.training_step(trainer.model, batch, num_items)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    return step, trainer


def measure_memory(case: str, batch_size: int, length: int, vocab: int) -> float:
    """In a fresh process: MB of peak resident memory of two steps above the built model and trainer."""
    with tempfile.TemporaryDirectory() as tmp:
        step, _ = build_step(case, batch_size, length, vocab, tmp)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak (VmHWM) to the current resident size
        except OSError:
            pass
        before = _rss_bytes()
        step()
        step()
        return (_peak_rss_bytes() - before) / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 2 x 64 tokens, vocab 4,096, 2 rounds")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5; 2 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: CPU time is measured)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for run_all.py)")
    parser.add_argument("--memory-of", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_of:
        case, batch_size, length, vocab = args.memory_of
        print(measure_memory(case, int(batch_size), int(length), int(vocab)))
        return 0
    clock = time.process_time if args.threads == 1 else time.perf_counter
    repeats = args.repeats or (2 if args.quick else 5)
    shapes, vocab = (QUICK_SHAPES, 4096) if args.quick else (SHAPES, 49152)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's nlp_tricks in the children
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    rows = []
    for batch_size, length in shapes:
        memory = {}
        for case in CASES:
            out = subprocess.run(
                [sys.executable, __file__, "--threads", str(args.threads), "--memory-of", case]
                + [str(batch_size), str(length), str(vocab)],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            memory[case] = float(out.stdout.strip().splitlines()[-1])
        with tempfile.TemporaryDirectory() as tmp:
            steps = {case: build_step(case, batch_size, length, vocab, tmp)[0] for case in CASES}
            times = time_interleaved(steps, repeats, clock)
            del steps
        shape = f"{batch_size} x {length}"
        for case in CASES:
            rows.append(
                {
                    "benchmark": "causal_lm_memory",
                    "case": f"{case} ({shape})",
                    "baseline": f"{BASELINE} ({shape})",
                    "ratio": paired_ratio(times, case, BASELINE),
                    "median_ms": 1000 * statistics.median(times[case]),
                    "peak_mb": memory[case],
                    "memory_ratio": memory[case] / memory[BASELINE],
                    "vs_full_logits": paired_ratio(times, case, "label smoothing, full logits"),
                }
            )
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"tiny Llama (vocab {vocab}), torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, "
        f"{'CPU' if args.threads == 1 else 'wall'} time, median of {repeats} interleaved rounds"
    )
    print(
        "| case | peak MB above the model | memory / plain Trainer | median ms | time / plain Trainer | "
        "time / full logits |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['case']} | {r['peak_mb']:.0f} | {r['memory_ratio']:.2f}x | {r['median_ms']:.0f} | "
            f"{r['ratio']:.2f}x | {r['vs_full_logits']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
