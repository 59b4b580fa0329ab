"""Optimizer-step time and memory of the EMA (nlp_tricks) against plain training and the popular dict-of-clones EMA.

    python benchmarks/ema.py              # MiniLM-shaped BERT, batch 16 x 64, CPU: the numbers in docs/averaging.md
    python benchmarks/ema.py --quick      # a tiny BERT, seconds

One optimizer step = forward/backward + fused AdamW step (the Trainer's default optim) + zero_grad, on a
BertForTokenClassification built from config (6 layers, hidden 384, 12 heads, intermediate 1536, vocab 30,522:
MiniLM's shape). Methods:

- plain: the step alone;
- ema: the step, then ``EMA.update()`` (one fused ``torch._foreach_lerp_`` over the float32 average);
- classic ema: the step, then the update the popular copies paste: a dict of cloned tensors and, per parameter,
  ``shadow[name] = ((1 - decay) * param.data + decay * shadow[name]).clone()``.

Time: the median over interleaved rounds (the order rotates each round); ratios are medians of the per-round ratios, so
the shared machine's slow drifts hit both sides of a ratio alike (``_timing.py``). On a loaded machine a step's time
still swings by 10-20% between calls, more than the update costs, so the EMA's step is also split within each call:
(step + update) / step, the median over rounds. The updates alone are timed in interleaved rounds as well.
Memory: the bytes each average keeps, against the float32 bytes of the trainable parameters (each tied tensor once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _timing import paired_ratio, synchronize, time_interleaved
from transformers import BertConfig, BertForTokenClassification

from nlp_tricks.runtime.averaging import EMA

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
DECAY = 0.999


class ClassicEMA:
    """The EMA of the popular copies (Kaggle kernels, blog posts), written out as they write it."""

    def __init__(self, model, decay):
        self.model = model
        self.decay = decay
        self.shadow = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                self.shadow[name] = param.data.clone()

    def update(self):
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                new_average = (1.0 - self.decay) * param.data + self.decay * self.shadow[name]
                self.shadow[name] = new_average.clone()


def build(vocab, shape, batch, length, seed=0):
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, num_labels=9, max_position_embeddings=max(512, length), **shape)
    model = BertForTokenClassification(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "input_ids": torch.randint(1, vocab, (batch, length), generator=g),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "labels": torch.randint(0, 9, (batch, length), generator=g),
    }
    return model, optimizer, inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--quick", action="store_true", help="tiny BERT, vocab 1000, batch 4 x 16, 3 repeats")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine; ratios are the point)"
    )
    args = parser.parse_args()
    shape = MINILM
    if args.quick:
        shape, args.batch, args.length, args.vocab, args.repeats = TINY, 4, 16, 1000, 3
    torch.set_num_threads(args.threads)

    model, optimizer, inputs = build(args.vocab, shape, args.batch, args.length)
    ema, classic = EMA(model, DECAY), ClassicEMA(model, DECAY)

    def step():
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    update_in_step = []  # the update's own time inside each timed "ema" step

    def ema_step():
        step()
        start = time.perf_counter()
        ema.update()
        synchronize()
        update_in_step.append(time.perf_counter() - start)

    rounds = time_interleaved(
        {"plain": step, "ema": ema_step, "classic ema": lambda: (step(), classic.update())}, args.repeats
    )
    # Within one call: (step + update) / step. Immune to the machine's drifts between calls, blind to any slowdown
    # the update would cause in the next step (the paired ratio above would show one).
    in_call = statistics.median(t / (t - u) for t, u in zip(rounds["ema"], update_in_step[1:]))
    update_rounds = time_interleaved({"EMA.update": ema.update, "classic update": classic.update}, 5 * args.repeats)
    times = {label: statistics.median(t) for label, t in rounds.items()}
    update_times = {label: statistics.median(t) for label, t in update_rounds.items()}

    unique = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    param_bytes = sum(p.numel() * 4 for p in unique)
    memory = {
        "ema": sum(s.numel() * s.element_size() for s in ema.shadow),
        "classic ema": sum(s.numel() * s.element_size() for s in classic.shadow.values()),
    }
    rows = [
        {"method": m, "step_s": times[m], "x_plain": paired_ratio(rounds, m, "plain"), "avg_mb": memory.get(m, 0)}
        for m in times
    ]
    update_ratio = paired_ratio(update_rounds, "EMA.update", "classic update")

    if args.json:  # rows in the contract of benchmarks/run_all.py
        out = [
            {"benchmark": "ema", "case": r["method"], "baseline": "plain", "ratio": r["x_plain"],
             "median_ms": 1000 * r["step_s"]}
            for r in rows
        ]  # fmt: skip
        out += [
            {"benchmark": "ema", "case": "ema (step + update, within one call)", "baseline": "its step",
             "ratio": in_call, "median_ms": 1000 * times["ema"]},
            {"benchmark": "ema", "case": "EMA.update", "baseline": "classic update", "ratio": update_ratio,
             "median_ms": 1000 * update_times["EMA.update"]},
        ]  # fmt: skip
        print(json.dumps(out))
        return
    size = "quick (tiny BERT)" if args.quick else "MiniLM-shaped BERT (6 x 384)"
    n_params = param_bytes // 4
    print(
        f"{size}, {n_params / 1e6:.1f} M trainable parameters, batch {args.batch} x {args.length}, "
        f"vocab {args.vocab}, CPU ({torch.get_num_threads()} threads), median of {args.repeats} interleaved steps"
    )
    print()
    print("| method | step time (s) | x plain | average kept (MB) | x float32 parameters |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        kept = f"{r['avg_mb'] / 2**20:.1f} | {r['avg_mb'] / param_bytes:.2f}" if r["method"] != "plain" else "- | -"
        print(f"| {r['method']} | {r['step_s']:.3f} | {r['x_plain']:.3f} | {kept} |")
    print()
    print(
        f"Update alone (median of {5 * args.repeats} interleaved): EMA.update {1000 * update_times['EMA.update']:.1f} "
        f"ms, classic {1000 * update_times['classic update']:.1f} ms ({update_ratio:.2f}x)"
    )
    print(
        f"EMA step / plain step (goal <= 1.03): {paired_ratio(rounds, 'ema', 'plain'):.3f}x paired across calls; "
        f"{in_call:.3f}x within each call ((step + update) / step)"
    )


if __name__ == "__main__":
    main()
