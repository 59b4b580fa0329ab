"""Peak memory and time of TricksTrainer's causal-LM losses against upstream's, on the same (B, L, V) logits.

    python benchmarks/causal_lm_loss.py                 # (4, 512, 32000) float32 logits, the numbers in the docs
    python benchmarks/causal_lm_loss.py --quick         # small shapes, seconds

The part of a training step after the model's forward: the loss on the logits and its backward into them.

- model_loss: the model's own loss (``ForCausalLMLoss``), what upstream's Trainer uses by default; the baseline.
- upstream_label_smoothing: upstream's ``LabelSmoother(shift_labels=True)`` (``--label_smoothing_factor``), which
  slices ``logits[..., :-1, :].contiguous()``.
- tricks_ce / tricks_focal / tricks_label_smoothing: ``TricksTrainer.labels_for_logits`` (the labels shifted, the
  logits left as they are) then ``compute_tricks_loss``, exactly the path of ``compute_loss`` after the forward.

Memory: each case runs once in a fresh subprocess; its peak resident memory above the state before the loss (logits
and labels allocated), in units of one logits-sized buffer. Time: the median over interleaved rounds in a rotating
order; ratios are medians of the per-round ratios (``_timing.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from _timing import paired_ratio, time_interleaved
from losses import _peak_rss_bytes, _rss_bytes
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.trainer_pt_utils import LabelSmoother

from nlp_tricks import TricksArguments, TricksTrainer

CASES = ("model_loss", "upstream_label_smoothing", "tricks_ce", "tricks_focal", "tricks_label_smoothing")
TRICKS_SETTINGS = {
    "tricks_ce": {},
    "tricks_focal": {"loss_type": "focal", "focal_gamma": 2.0},
    "tricks_label_smoothing": {"loss_type": "label_smoothing", "label_smoothing_factor": 0.1},
}


def _inputs(batch, length, vocab):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, length, vocab, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (batch, length), generator=g)
    labels[:, : length // 4] = -100  # a prompt without loss
    return logits, labels


def _loss_fn(case, vocab):
    """``(logits, labels) -> loss`` for a case; the TricksTrainer ones on a tiny Llama (only its class matters)."""
    if case == "model_loss":
        return lambda logits, labels: ForCausalLMLoss(logits, labels, vocab)
    if case == "upstream_label_smoothing":
        smoother = LabelSmoother(epsilon=0.1)
        return lambda logits, labels: smoother({"logits": logits}, labels, shift_labels=True)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)
    )
    args = TricksArguments(
        output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, disable_tqdm=True, **TRICKS_SETTINGS[case]
    )
    trainer = TricksTrainer(model=model, args=args)
    assert trainer.loss_shifts_labels
    return lambda logits, labels: trainer.compute_tricks_loss(logits, trainer.labels_for_logits(labels))


def _step(loss_fn, logits, labels):
    logits.grad = None
    loss_fn(logits, labels).backward()


def measure_memory(case, batch, length, vocab):
    """Run in a fresh process: peak RSS growth of one loss + backward, in logits-sized buffers."""
    loss_fn = _loss_fn(case, vocab)
    logits, labels = _inputs(batch, length, vocab)
    before = _rss_bytes()
    _step(loss_fn, logits, labels)
    return (_peak_rss_bytes() - before) / (logits.numel() * logits.element_size())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="(2, 64, 1000) logits, 3 repeats")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for benchmarks/run_all.py)")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.length, args.vocab, args.repeats = 2, 64, 1000, 3
    shape = ["--batch", str(args.batch), "--length", str(args.length), "--vocab", str(args.vocab)]
    if args.memory_of:
        print(measure_memory(args.memory_of, args.batch, args.length, args.vocab))
        return

    logits, labels = _inputs(args.batch, args.length, args.vocab)
    steps = {case: functools.partial(_step, _loss_fn(case, args.vocab), logits, labels) for case in CASES}
    times = time_interleaved(steps, args.repeats)
    del logits, labels, steps

    memory = {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's nlp_tricks in the child
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for case in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-of", case, *shape],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        memory[case] = float(out.stdout.strip().splitlines()[-1])

    rows = [
        {
            "benchmark": "causal_lm_loss",
            "case": case,
            "baseline": "model_loss",
            "median_ms": 1000 * statistics.median(times[case]),
            "ratio": paired_ratio(times, case, "model_loss"),
            "buffers": memory[case],
            "buffers_vs_model_loss": memory[case] - memory["model_loss"],
        }
        for case in CASES
    ]
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"logits ({args.batch}, {args.length}, {args.vocab}) float32, loss + backward, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print("| case | median ms | time / model_loss | peak memory (logits buffers) | vs model_loss |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['median_ms']:.0f} | {r['ratio']:.2f}x | {r['buffers']:.2f} | "
            f"{r['buffers_vs_model_loss']:+.2f} |"
        )


if __name__ == "__main__":
    main()
