"""Optimizer-step time and peak memory of FGM / PGD (nlp_tricks) against plain training and the classic recipe.

    python benchmarks/adversarial.py              # MiniLM-shaped BERT, batch 16 x 64, CPU: the README's numbers
    python benchmarks/adversarial.py --quick      # a tiny BERT, seconds
    python benchmarks/adversarial.py --device cuda   # on the GPU (scripts/gpu_check.sh)

One optimizer step = the method's forward/backward passes + fused AdamW step (the Trainer's default optim) + zero_grad,
on a BertForTokenClassification built from config (6 layers, hidden 384, 12 heads, intermediate 1536: MiniLM's
shape). Methods:

- plain: one forward/backward;
- fgm / pgd3: ``FGM(model).step(...)`` / ``PGD(model, steps=3).step(...)`` (perturbation on the embedding output);
- classic fgm / classic pgd3: the popular weight-space implementation, written out below: back up the vocab x dim
  embedding weight, add ``eps * g / ||g||`` to it, rerun, restore; PGD also backs up and restores every parameter
  gradient and runs full backwards in its intermediate steps.

Time: the median over interleaved rounds (the order rotates each round); ratios are medians of the per-round ratios, so
the shared machine's slow drifts hit both sides of a ratio alike (``_timing.py``). Memory: each method runs in a fresh
forked process; its peak resident memory above the state after building the model and the optimizer (so it counts
gradients, AdamW state and activations), compared with plain's peak plus one pass's activations (a second pass runs
while the first pass's gradients are held). Vocabulary: the FGM / plain time ratio at vocab 250,002 (XLM-R's) against
30,522 (BERT's), interleaved in one loop with classic FGM at both, and the extra time over plain of FGM and of classic
FGM at each.
With ``--device cuda`` times are taken between ``torch.cuda.synchronize()`` calls and memory is the
peak of ``torch.cuda.max_memory_allocated()`` above the model and the optimizer, each method measured in
turn in this process.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import resource
import statistics

import torch
from _timing import paired_ratio, time_interleaved
from transformers import BertConfig, BertForTokenClassification

from nlp_tricks import FGM, PGD

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


# ---- The classic weight-space recipe (as the popular copies write it) ----------------------------------------------


def classic_fgm_step(model, loss_fn, weight, epsilon=1.0):
    loss_fn().backward()
    backup = weight.data.clone()
    norm = torch.norm(weight.grad)
    if norm != 0 and not torch.isnan(norm):
        weight.data.add_(epsilon * weight.grad / norm)
    loss_fn().backward()
    weight.data = backup


def classic_pgd_step(model, loss_fn, weight, epsilon=1.0, alpha=0.3, steps=3):
    loss_fn().backward()
    emb_backup = weight.data.clone()
    grad_backup = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for t in range(steps):
        norm = torch.norm(weight.grad)
        if norm != 0 and not torch.isnan(norm):
            weight.data.add_(alpha * weight.grad / norm)
            r = weight.data - emb_backup
            if torch.norm(r) > epsilon:
                r = epsilon * r / torch.norm(r)
            weight.data = emb_backup + r
        if t != steps - 1:
            model.zero_grad()
        else:
            for n, p in model.named_parameters():
                if n in grad_backup:
                    p.grad = grad_backup[n]
        loss_fn().backward()
    weight.data = emb_backup


# ---- Setup ----------------------------------------------------------------------------------------------------------


def build(vocab, shape, batch, length, seed=0, device="cpu"):
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, num_labels=9, max_position_embeddings=max(512, length), **shape)
    model = BertForTokenClassification(config).train().to(device)
    # fused: the AdamW kernel transformers.Trainer uses by default (optim="adamw_torch_fused"), so the step is the one
    # users run; torch's default AdamW on CPU (a loop over the parameters) spends >1 s per step at vocab 250,002.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "input_ids": torch.randint(1, vocab, (batch, length), generator=g),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "labels": torch.randint(0, 9, (batch, length), generator=g),
    }
    return model, optimizer, {key: value.to(device) for key, value in inputs.items()}


def make_steps(model, optimizer, inputs):
    """One optimizer step per method, each a closure over the same model, optimizer and batch."""
    weight = model.get_input_embeddings().weight
    fgm, pgd = FGM(model, epsilon=1.0), PGD(model, epsilon=1.0, alpha=0.3, steps=3)

    def loss_fn():
        return model(**inputs).loss

    def finish():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {
        "plain": lambda: (loss_fn().backward(), finish()),
        "fgm": lambda: (fgm.step(loss_fn), finish()),
        "pgd3": lambda: (pgd.step(loss_fn), finish()),
        "classic fgm": lambda: (classic_fgm_step(model, loss_fn, weight), finish()),
        "classic pgd3": lambda: (classic_pgd_step(model, loss_fn, weight), finish()),
    }


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure_memory(method, vocab, shape, batch, length):
    """In a fresh process: peak RSS growth over 2 steps of `method`, after building the model and optimizer.

    "activations" is one forward whose graph is kept: the memory a second pass adds while the first pass's
    gradients are held.
    """
    # Serve every allocation above 64 KiB by mmap, so freed tensors leave the resident set at once and the peak
    # reflects live memory rather than glibc's heap fragmentation.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    model, optimizer, inputs = build(vocab, shape, batch, length)
    before = _rss_bytes()
    if method == "activations":
        model(**inputs)  # the peak comes at the forward's end, with its whole graph alive
    else:
        step = make_steps(model, optimizer, inputs)[method]
        for _ in range(2):
            step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # Linux reports KiB


def measure_cuda_memory(method, vocab, shape, batch, length):
    """Peak CUDA memory growth over 2 steps of `method` (or one kept forward), above the model and optimizer."""
    model, optimizer, inputs = build(vocab, shape, batch, length, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if method == "activations":
        out = model(**inputs)  # noqa: F841 (the graph stays alive until the peak is read)
    else:
        step = make_steps(model, optimizer, inputs)[method]
        for _ in range(2):
            step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before  # everything here is freed on return


# ---- Main -----------------------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--large-vocab", type=int, default=250002)
    parser.add_argument("--quick", action="store_true", help="tiny BERT, vocab 1000 / 8000, batch 4 x 16, 3 repeats")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model trains")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine; ratios are the point)"
    )
    args = parser.parse_args()
    shape = MINILM
    if args.quick:
        shape, args.batch, args.length, args.vocab, args.large_vocab, args.repeats = TINY, 4, 16, 1000, 8000, 3
    torch.set_num_threads(args.threads)
    # Memory first, each method in a child forked while this process still holds no model.
    methods = ["plain", "fgm", "pgd3", "classic fgm", "classic pgd3", "activations"]
    if args.device == "cuda":
        memory = {m: measure_cuda_memory(m, args.vocab, shape, args.batch, args.length) for m in methods}
    else:
        with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
            memory = {m: pool.apply(measure_memory, (m, args.vocab, shape, args.batch, args.length)) for m in methods}

    model, optimizer, inputs = build(args.vocab, shape, args.batch, args.length, device=args.device)
    steps = make_steps(model, optimizer, inputs)
    rounds = time_interleaved(steps, args.repeats)
    times = {label: statistics.median(t) for label, t in rounds.items()}
    del model, optimizer, inputs, steps

    small = build(args.vocab, shape, args.batch, args.length, device=args.device)
    large = build(args.large_vocab, shape, args.batch, args.length, device=args.device)
    small_steps, large_steps = make_steps(*small), make_steps(*large)
    vocab_rounds = time_interleaved(
        {
            ("plain", args.vocab): small_steps["plain"],
            ("fgm", args.vocab): small_steps["fgm"],
            ("classic fgm", args.vocab): small_steps["classic fgm"],
            ("plain", args.large_vocab): large_steps["plain"],
            ("fgm", args.large_vocab): large_steps["fgm"],
            ("classic fgm", args.large_vocab): large_steps["classic fgm"],
        },
        args.repeats,
    )
    ratio_small = paired_ratio(vocab_rounds, ("fgm", args.vocab), ("plain", args.vocab))
    ratio_large = paired_ratio(vocab_rounds, ("fgm", args.large_vocab), ("plain", args.large_vocab))
    vt = {label: statistics.median(t) for label, t in vocab_rounds.items()}
    extra_small = vt[("fgm", args.vocab)] - vt[("plain", args.vocab)]
    extra_large = vt[("fgm", args.large_vocab)] - vt[("plain", args.large_vocab)]
    classic_extra_small = vt[("classic fgm", args.vocab)] - vt[("plain", args.vocab)]
    classic_extra_large = vt[("classic fgm", args.large_vocab)] - vt[("plain", args.large_vocab)]
    fgm_x_classic_large = paired_ratio(vocab_rounds, ("fgm", args.large_vocab), ("classic fgm", args.large_vocab))

    rows = []
    for method, seconds in times.items():
        rows.append(
            {
                "method": method,
                "step_s": seconds,
                "x_plain": paired_ratio(rounds, method, "plain"),
                "peak_mb": memory[method] / 2**20,
                "mem_x_plain": memory[method] / memory["plain"],
            }
        )
    goals = {
        "fgm_x_plain": paired_ratio(rounds, "fgm", "plain"),
        "fgm_x_classic_fgm": paired_ratio(rounds, "fgm", "classic fgm"),
        "pgd3_x_classic_pgd3": paired_ratio(rounds, "pgd3", "classic pgd3"),
        "fgm_mem_x_plain_plus_activations": memory["fgm"] / (memory["plain"] + memory["activations"]),
        "pgd3_mem_x_plain_plus_activations": memory["pgd3"] / (memory["plain"] + memory["activations"]),
        f"fgm_x_plain_vocab_{args.vocab}": ratio_small,
        f"fgm_x_plain_vocab_{args.large_vocab}": ratio_large,
        "vocab_ratio_change": ratio_large / ratio_small - 1,
        f"fgm_extra_s_vocab_{args.vocab}": extra_small,
        f"fgm_extra_s_vocab_{args.large_vocab}": extra_large,
        "fgm_extra_change": extra_large / extra_small - 1,
        f"classic_fgm_extra_s_vocab_{args.vocab}": classic_extra_small,
        f"classic_fgm_extra_s_vocab_{args.large_vocab}": classic_extra_large,
        f"fgm_x_classic_fgm_vocab_{args.large_vocab}": fgm_x_classic_large,
    }
    if args.json:  # rows in the contract of benchmarks/run_all.py
        out = [
            {"benchmark": "adversarial", "case": r["method"], "baseline": "plain", "ratio": r["x_plain"],
             "median_ms": 1000 * r["step_s"], "peak_mb": r["peak_mb"]}
            for r in rows
        ]  # fmt: skip
        out += [
            {"benchmark": "adversarial", "case": "fgm", "baseline": "classic fgm", "ratio": goals["fgm_x_classic_fgm"],
             "median_ms": 1000 * times["fgm"]},
            {"benchmark": "adversarial", "case": "pgd3", "baseline": "classic pgd3",
             "ratio": goals["pgd3_x_classic_pgd3"], "median_ms": 1000 * times["pgd3"]},
            {"benchmark": "adversarial", "case": f"fgm, vocab {args.large_vocab}",
             "baseline": f"plain, vocab {args.large_vocab}", "ratio": ratio_large,
             "median_ms": 1000 * vt[("fgm", args.large_vocab)]},
            {"benchmark": "adversarial", "case": f"fgm, vocab {args.large_vocab}",
             "baseline": f"classic fgm, vocab {args.large_vocab}", "ratio": fgm_x_classic_large,
             "median_ms": 1000 * vt[("fgm", args.large_vocab)]},
        ]  # fmt: skip
        print(json.dumps(out))
        return
    size = "quick (tiny BERT)" if args.quick else "MiniLM-shaped BERT (6 x 384)"
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(
        f"{size}, batch {args.batch} x {args.length}, vocab {args.vocab}, {where}, "
        f"median of {args.repeats} interleaved steps"
    )
    print()
    print("| method | step time (s) | x plain | peak memory (MB) | memory x plain |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['method']} | {row['step_s']:.3f} | {row['x_plain']:.2f} | {row['peak_mb']:.0f} | "
            f"{row['mem_x_plain']:.3f} |"
        )
    print()
    print(
        f"FGM / plain: {goals['fgm_x_plain']:.2f}x (goal <= 2.1); "
        f"FGM / classic FGM: {goals['fgm_x_classic_fgm']:.2f}x (goal <= 1); "
        f"PGD-3 / classic PGD-3: {goals['pgd3_x_classic_pgd3']:.2f}x (goal <= 0.9)"
    )
    plus = (memory["plain"] + memory["activations"]) / 2**20
    print(
        f"Peak memory: plain + one pass's activations = {plus:.0f} MB; FGM / that: "
        f"{goals['fgm_mem_x_plain_plus_activations']:.3f}, PGD-3 / that: "
        f"{goals['pgd3_mem_x_plain_plus_activations']:.3f} (goal <= 1.05)"
    )
    print(
        f"FGM / plain at vocab {args.vocab}: {ratio_small:.2f}x, at {args.large_vocab}: {ratio_large:.2f}x "
        f"({100 * goals['vocab_ratio_change']:+.1f}%; goal within 5%); FGM's extra time over plain: "
        f"{extra_small:.2f} s at {args.vocab}, {extra_large:.2f} s at {args.large_vocab} "
        f"({100 * goals['fgm_extra_change']:+.1f}%)"
    )
    print(
        f"Plain step: {vt[('plain', args.vocab)]:.2f} s at {args.vocab}, "
        f"{vt[('plain', args.large_vocab)]:.2f} s at {args.large_vocab}; "
        f"classic FGM's extra time over plain: {classic_extra_small:.2f} s at {args.vocab}, "
        f"{classic_extra_large:.2f} s at {args.large_vocab}; FGM / classic FGM at {args.large_vocab}: "
        f"{fgm_x_classic_large:.2f}x"
    )


if __name__ == "__main__":
    main()
