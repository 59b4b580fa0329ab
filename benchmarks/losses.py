"""Time and peak memory of focal_loss / label_smoothing_cross_entropy against F.cross_entropy, side by side.

    python benchmarks/losses.py                 # (8192, 32000) float32 logits, the README's numbers
    python benchmarks/losses.py --quick         # small shapes, seconds

Forward + backward of each loss on the same logits. Time: the median over interleaved rounds in a rotating order;
ratios are medians of the per-round ratios (``_timing.py``). Memory: each loss runs once in a fresh subprocess; its
peak resident memory above the state before the loss (logits and labels allocated), in units of one logits-sized
buffer. Cross-entropy itself needs about three (its saved log-softmax, the gradient buffer it builds, and logits.grad).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from _timing import paired_ratio, time_interleaved

from nlp_tricks.functional.losses import focal_loss, label_smoothing_cross_entropy

LOSSES = {
    "cross_entropy": lambda logits, labels: F.cross_entropy(logits, labels),
    "focal_loss": lambda logits, labels: focal_loss(logits, labels, gamma=2.0),
    "label_smoothing": lambda logits, labels: label_smoothing_cross_entropy(logits, labels, epsilon=0.1),
}


def _inputs(rows, classes):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, classes, generator=g).requires_grad_()
    labels = torch.randint(0, classes, (rows,), generator=g)
    labels[::10] = -100
    return logits, labels


def _step(name, logits, labels):
    logits.grad = None
    LOSSES[name](logits, labels).backward()


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes():
    # VmHWM belongs to this process image; ru_maxrss would carry over the parent's peak through fork + exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def measure_memory(name, rows, classes):
    """Run in a fresh process: peak RSS growth of one forward + backward, in logits-sized buffers."""
    logits, labels = _inputs(rows, classes)
    before = _rss_bytes()
    _step(name, logits, labels)
    peak = _peak_rss_bytes()
    return (peak - before) / (logits.numel() * logits.element_size())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--classes", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="(512, 1000) logits, 3 repeats")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for benchmarks/run_all.py)")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.classes, args.repeats = 512, 1000, 3
    if args.memory_of:
        print(measure_memory(args.memory_of, args.rows, args.classes))
        return

    logits, labels = _inputs(args.rows, args.classes)
    times = time_interleaved({name: functools.partial(_step, name, logits, labels) for name in LOSSES}, args.repeats)
    del logits, labels

    memory = {}
    for name in LOSSES:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-of", name, "--rows", str(args.rows), "--classes", str(args.classes)],
            capture_output=True,
            text=True,
            check=True,
        )
        memory[name] = float(out.stdout.strip().splitlines()[-1])

    rows = []
    for name in LOSSES:
        t = statistics.median(times[name])
        rows.append(
            {
                "benchmark": "losses",
                "case": name,
                "baseline": "cross_entropy",
                "median_ms": 1000 * t,
                "ratio": paired_ratio(times, name, "cross_entropy"),
                "buffers": memory[name],
                "extra_buffers_vs_ce": memory[name] - memory["cross_entropy"],
            }
        )
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"logits ({args.rows}, {args.classes}) float32, forward + backward, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(
        "| loss | median ms | time / cross_entropy | peak memory (logits buffers) | extra buffers vs cross_entropy |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['median_ms']:.0f} | {r['ratio']:.2f}x | {r['buffers']:.2f} | "
            f"{r['extra_buffers_vs_ce']:+.2f} |"
        )


if __name__ == "__main__":
    main()
