"""Optimizer-step time and peak memory of FGM / PGD / AWP / FreeLB / R-Drop / SAM / SMART (nlp_tricks) against plain
training and the classic recipes.

    python benchmarks/adversarial.py              # MiniLM-shaped BERT, batch 16 x 64, CPU: the README's numbers
    python benchmarks/adversarial.py --quick      # a tiny BERT, seconds
    python benchmarks/adversarial.py --device cuda   # on the GPU (scripts/gpu_check.sh)
    python benchmarks/adversarial.py --methods plain,awp,"classic awp",freelb3 --no-vocab   # a subset

One optimizer step = the method's forward/backward passes + fused AdamW step (the Trainer's default optim) + zero_grad,
on a BertForTokenClassification built from config (6 layers, hidden 384, 12 heads, intermediate 1536: MiniLM's
shape). Methods:

- plain: one forward/backward;
- fgm / pgd3: ``FGM(model).step(...)`` / ``PGD(model, steps=3).step(...)`` (perturbation on the embedding output);
- classic fgm / classic pgd3: the popular weight-space implementation, the one the tests compare against
  (tests/classic_recipes.py): back up the vocab x dim
  embedding weight, add ``eps * g / ||g||`` to it, rerun, restore; PGD also backs up and restores every parameter
  gradient and runs full backwards in its intermediate steps.
- awp: ``AWP(model, gamma=0.01).step(...)`` (the Linear weights of the layers, only those backed up); classic awp:
  TorchBlocks' AWP as it is used (every parameter named "weight" backed up with two clamp bounds, the clamp applied).
- freelb3: ``FreeLB(model, steps=3)`` with the clean pass and a zero start (3 passes); freelb3 random start: with
  ``init_mag=0.1`` (4 passes); classic freelb3: the official code (``inputs_embeds``, a full backward per pass) with
  the same random start and a clean pass.
- rdrop: one forward over the doubled batch and ``rdrop_loss``; classic rdrop: the official R-Drop example (two
  forwards, ``F.kl_div`` on softmaxes).
- sam / asam: ``SAM(model, rho=0.05).step([loss_fn])`` (``adaptive=True, rho=1.0``); classic sam: the common SAM
  optimizer wrapper (davda54/sam: ``first_step`` / ``second_step`` with a closure) around the same fused AdamW.
- smart: ``SMART(model)`` (the paper's settings, one ascent step) added to the loss with weight 1; classic smart:
  mt-dnn's ``SmartPerturbation`` loop written out (``inputs_embeds``, its ``stable_kl`` for the ascent and its
  symmetric KL criterion for the term).

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
import sys
from pathlib import Path

import torch
from _timing import paired_ratio, time_interleaved
from transformers import BertConfig, BertForTokenClassification

from nlp_tricks import AWP, FGM, PGD, FreeLB
from nlp_tricks.functional.adversarial import awp_parameters
from nlp_tricks.functional.losses import rdrop_loss
from nlp_tricks.functional.sam import SAM
from nlp_tricks.functional.smart import SMART

# The classic weight-space FGM / PGD: the tests' reference, timed here as it is tested there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from classic_recipes import classic_fgm, classic_pgd  # noqa: E402

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


# ---- The classic recipes (as the popular copies write them) -------------------------------------------------------


def classic_awp_step(model, loss_fn, gamma=0.01, epsilon=0.001, name="weight"):
    """TorchBlocks' AWP (torchblocks/callback/adversarial/awp.py) with its defaults: attack(is_first_attack=True)
    after the clean backward, one adversarial backward, restore()."""
    loss_fn().backward()
    e = 1e-6
    backup, backup_eps = {}, {}
    for n, param in model.named_parameters():
        if param.requires_grad and param.grad is not None and name in n:
            backup[n] = param.data.clone()
            grad_eps = epsilon * param.abs().detach()
            backup_eps[n] = (backup[n] - grad_eps, backup[n] + grad_eps)
            norm1 = torch.norm(param.grad)
            norm2 = torch.norm(param.data.detach())
            if norm1 != 0 and not torch.isnan(norm1):
                r_at = gamma * param.grad / (norm1 + e) * (norm2 + e)
                param.data.add_(r_at)
                param.data = torch.min(torch.max(param.data, backup_eps[n][0]), backup_eps[n][1])
    loss_fn().backward()
    for n, param in model.named_parameters():
        if n in backup:
            param.data = backup[n]


def classic_freelb_step(model, inputs, steps=3, alpha=0.3, init_mag=0.1):
    """FreeLB's official loop (huggingface-transformers/examples/run_glue_freelb.py), after one clean pass."""
    model(**inputs).loss.backward()
    word_embeddings = model.get_input_embeddings()
    rest = {k: v for k, v in inputs.items() if k != "input_ids"}
    embeds_init = word_embeddings(inputs["input_ids"])
    input_mask = inputs["attention_mask"].to(embeds_init)
    delta = torch.zeros_like(embeds_init).uniform_(-1, 1) * input_mask.unsqueeze(2)
    dims = input_mask.sum(1) * embeds_init.size(-1)
    delta = (delta * (init_mag / torch.sqrt(dims)).view(-1, 1, 1)).detach()
    for k in range(steps):
        delta.requires_grad_()
        loss = model(inputs_embeds=delta + embeds_init, **rest).loss / steps
        loss.backward()
        if k == steps - 1:
            break
        grad = delta.grad.clone().detach()
        denorm = torch.clamp(torch.norm(grad.view(grad.size(0), -1), dim=1).view(-1, 1, 1), min=1e-8)
        delta = (delta + alpha * grad / denorm).detach()
        embeds_init = word_embeddings(inputs["input_ids"])


def classic_rdrop_step(model, inputs, alpha=1.0):
    """The R-Drop authors' example (dropreg/R-Drop, README): two forwards, CE averaged, KL on softmaxes."""
    labels = inputs["labels"]
    rest = {k: v for k, v in inputs.items() if k != "labels"}
    logits, logits2 = model(**rest).logits, model(**rest).logits
    num_labels = logits.shape[-1]
    ce = torch.nn.functional.cross_entropy
    ce_loss = 0.5 * (
        ce(logits.view(-1, num_labels), labels.view(-1)) + ce(logits2.view(-1, num_labels), labels.view(-1))
    )
    p_loss = torch.nn.functional.kl_div(logits.log_softmax(-1), logits2.softmax(-1), reduction="none").sum()
    q_loss = torch.nn.functional.kl_div(logits2.log_softmax(-1), logits.softmax(-1), reduction="none").sum()
    (ce_loss + alpha * (p_loss + q_loss) / 2).backward()


class ClassicSAM(torch.optim.Optimizer):
    """The common SAM optimizer wrapper (davda54/sam, as its README uses it): the closure runs forward / backward."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        shared_device = self.param_groups[0]["params"][0].device
        grad_norm = torch.norm(
            torch.stack(
                [
                    p.grad.norm(p=2).to(shared_device)
                    for g in self.param_groups
                    for p in g["params"]
                    if p.grad is not None
                ]
            ),
            p=2,
        )
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure):
        closure = torch.enable_grad()(closure)
        self.first_step(zero_grad=True)
        closure()
        self.second_step()


def _stable_kl(logit, target, epsilon=1e-6):
    """mt-dnn's ``stable_kl`` (mt_dnn/loss.py), summed."""
    logit = logit.view(-1, logit.size(-1)).float()
    target = target.view(-1, target.size(-1)).float()
    p = torch.nn.functional.log_softmax(logit, 1).exp()
    y = torch.nn.functional.log_softmax(target, 1).exp()
    rp = -(1.0 / (p + epsilon) - 1 + epsilon).detach().log()
    ry = -(1.0 / (y + epsilon) - 1 + epsilon).detach().log()
    return (p * (rp - ry) * 2).sum()


def classic_smart_step(model, inputs, alpha=1.0, noise_var=1e-5, step_size=1e-3, epsilon=1e-6):
    """mt-dnn's ``SmartPerturbation.forward`` (one step, inf-norm per token) on ``inputs_embeds``, its
    ``SymKlCriterion`` (batchmean) as the term, added to the cross-entropy."""
    labels = inputs["labels"]
    rest = {k: v for k, v in inputs.items() if k not in ("labels", "input_ids")}
    embed = model.get_input_embeddings()(inputs["input_ids"])
    logits = model(inputs_embeds=embed, **rest).logits
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    noise = (embed.data.new(embed.size()).normal_(0, 1) * noise_var).requires_grad_()
    adv_logits = model(inputs_embeds=embed + noise, **rest).logits
    adv_loss = _stable_kl(adv_logits, logits.detach())
    (delta_grad,) = torch.autograd.grad(adv_loss, noise, only_inputs=True, retain_graph=False)
    norm = delta_grad.norm()
    if not (torch.isnan(norm) or torch.isinf(norm)):
        noise = noise + delta_grad * step_size
        noise = (noise / (noise.abs().max(-1, keepdim=True)[0] + epsilon)).detach()
        adv_logits = model(inputs_embeds=embed + noise, **rest).logits
        a = logits.view(-1, logits.shape[-1]).float()
        b = adv_logits.view(-1, logits.shape[-1]).float()
        kl = torch.nn.functional.kl_div
        adv_loss = kl(b.log_softmax(-1), a.detach().softmax(-1), reduction="batchmean") + kl(
            a.log_softmax(-1), b.detach().softmax(-1), reduction="batchmean"
        )
        loss = loss + alpha * adv_loss
    loss.backward()


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
    """One optimizer step per method, each a closure over the same model, optimizer and batch (classic SAM wraps an
    AdamW of its own, of the same kind)."""
    weight = model.get_input_embeddings().weight
    fgm, pgd = FGM(model, epsilon=1.0), PGD(model, epsilon=1.0, alpha=0.3, steps=3)
    awp = AWP(model, gamma=0.01)
    freelb, freelb_random = FreeLB(model, steps=3), FreeLB(model, steps=3, init_mag=0.1)
    doubled = {key: torch.cat([value, value]) for key, value in inputs.items() if key != "labels"}
    sam, asam = SAM(model, rho=0.05), SAM(model, rho=1.0, adaptive=True)
    classic_sam = ClassicSAM(model.parameters(), torch.optim.AdamW, rho=0.05, lr=1e-5, fused=True)
    smart = SMART(model)
    rest = {key: value for key, value in inputs.items() if key != "labels"}

    def smart_step():
        with smart.capture():
            logits = model(**rest).logits
        labels = inputs["labels"]
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        (loss + smart.loss(lambda: model(**rest).logits, logits, labels)).backward()

    def classic_sam_step():  # the wrapper's README: the first backward, then step(closure)
        loss_fn().backward()
        classic_sam.step(lambda: loss_fn().backward())
        classic_sam.zero_grad(set_to_none=True)

    def loss_fn():
        return model(**inputs).loss

    def rdrop_step():
        logits_a, logits_b = model(**doubled).logits.chunk(2)
        rdrop_loss(logits_a, logits_b, inputs["labels"], alpha=1.0).backward()

    def finish():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {
        "plain": lambda: (loss_fn().backward(), finish()),
        "fgm": lambda: (fgm.step(loss_fn), finish()),
        "pgd3": lambda: (pgd.step(loss_fn), finish()),
        "classic fgm": lambda: (classic_fgm(model, loss_fn, weight, epsilon=1.0), finish()),
        "classic pgd3": lambda: (classic_pgd(model, loss_fn, weight, epsilon=1.0, alpha=0.3, steps=3), finish()),
        "awp": lambda: (awp.step(loss_fn), finish()),
        "classic awp": lambda: (classic_awp_step(model, loss_fn), finish()),
        "freelb3": lambda: (freelb.step(loss_fn), finish()),
        "freelb3 random start": lambda: (
            freelb_random.step(loss_fn, attention_mask=inputs["attention_mask"]),
            finish(),
        ),
        "classic freelb3": lambda: (classic_freelb_step(model, inputs), finish()),
        "rdrop": lambda: (rdrop_step(), finish()),
        "classic rdrop": lambda: (classic_rdrop_step(model, inputs), finish()),
        "sam": lambda: (sam.step([loss_fn]), finish()),
        "asam": lambda: (asam.step([loss_fn]), finish()),
        "classic sam": classic_sam_step,
        "smart": lambda: (smart_step(), finish()),
        "classic smart": lambda: (classic_smart_step(model, inputs), finish()),
    }


METHODS = ["plain", "fgm", "pgd3", "classic fgm", "classic pgd3", "awp", "classic awp", "freelb3",
           "freelb3 random start", "classic freelb3", "rdrop", "classic rdrop", "sam", "asam", "classic sam",
           "smart", "classic smart"]  # fmt: skip
# The goals of the issues, as (case, baseline, goal): time(case) / time(baseline) <= goal.
GOALS = [
    ("fgm", "plain", 2.1),
    ("fgm", "classic fgm", 1.0),
    ("pgd3", "classic pgd3", 0.9),
    ("awp", "plain", 2.1),
    ("awp", "classic awp", 0.95),
    ("freelb3", "plain", 3 + 1.1),
    ("freelb3 random start", "plain", 3 + 1.1),
    ("freelb3 random start", "classic freelb3", 1.0),
    ("rdrop", "plain", 2.1),
    ("rdrop", "classic rdrop", 1.0),
    ("sam", "plain", 2.05),
    ("sam", "classic sam", 1.0),
    ("asam", "plain", 2.05),
    ("smart", "classic smart", 1.0),
]


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


# ---- Main ----------------------------------------------------------------------------------------------------------


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
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of: {', '.join(METHODS)} (plain always)"
    )
    parser.add_argument("--no-vocab", action="store_true", help="skip the FGM vocabulary-size comparison")
    args = parser.parse_args()
    shape = MINILM
    if args.quick:
        shape, args.batch, args.length, args.vocab, args.large_vocab, args.repeats = TINY, 4, 16, 1000, 8000, 3
    methods = ["plain"] + [m for m in METHODS if m != "plain" and m in args.methods.split(",")]
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    torch.set_num_threads(args.threads)
    # Memory first, each method in a child forked while this process still holds no model.
    measured = methods + ["activations"]
    if args.device == "cuda":
        memory = {m: measure_cuda_memory(m, args.vocab, shape, args.batch, args.length) for m in measured}
    else:
        with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
            memory = {m: pool.apply(measure_memory, (m, args.vocab, shape, args.batch, args.length)) for m in measured}

    model, optimizer, inputs = build(args.vocab, shape, args.batch, args.length, device=args.device)
    awp_backup_mb = sum(p.numel() * p.element_size() for _, p in awp_parameters(model)) / 2**20
    all_steps = make_steps(model, optimizer, inputs)
    rounds = time_interleaved({m: all_steps[m] for m in methods}, args.repeats)
    times = {label: statistics.median(t) for label, t in rounds.items()}
    del model, optimizer, inputs, all_steps

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
    goals = [(a, b, goal, paired_ratio(rounds, a, b)) for a, b, goal in GOALS if a in times and b in times]
    plus = memory["plain"] + memory["activations"]  # plain's peak + one pass's activations held beside it
    memory_notes = {m: memory[m] / plus for m in methods if m != "plain"}

    vocab = None
    if not args.no_vocab and "fgm" in methods:
        vocab = vocabulary_comparison(args, shape)

    if args.json:  # rows in the contract of benchmarks/run_all.py
        out = [
            {"benchmark": "adversarial", "case": r["method"], "baseline": "plain", "ratio": r["x_plain"],
             "median_ms": 1000 * r["step_s"], "peak_mb": r["peak_mb"]}
            for r in rows
        ]  # fmt: skip
        out += [
            {"benchmark": "adversarial", "case": a, "baseline": b, "ratio": ratio, "median_ms": 1000 * times[a]}
            for a, b, _, ratio in goals
            if b != "plain"
        ]
        if vocab is not None:
            out += vocab["rows"]
        print(json.dumps(out))
        return
    size = "quick (tiny BERT)" if args.quick else "MiniLM-shaped BERT (6 x 384)"
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(
        f"{size}, batch {args.batch} x {args.length}, vocab {args.vocab}, {where}, "
        f"median of {args.repeats} interleaved steps"
    )
    print()
    print("| method | step time (s) | x plain | peak memory (MB) | memory x plain | memory x (plain + activations) |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        note = f"{memory_notes[row['method']]:.3f}" if row["method"] in memory_notes else ""
        print(
            f"| {row['method']} | {row['step_s']:.3f} | {row['x_plain']:.2f} | {row['peak_mb']:.0f} | "
            f"{row['mem_x_plain']:.3f} | {note} |"
        )
    print()
    print("; ".join(f"{_name(a)} / {_name(b)}: {ratio:.2f}x (goal <= {goal:g})" for a, b, goal, ratio in goals))
    print(
        f"Peak memory: plain + one pass's activations = {plus / 2**20:.0f} MB (goal for FGM / PGD: <= 1.05x that). "
        f"AWP's weight backups: {awp_backup_mb:.1f} MB"
        + (
            f"; AWP's peak - FGM's peak: {(memory['awp'] - memory['fgm']) / 2**20:.1f} MB"
            if "awp" in memory and "fgm" in memory
            else ""
        )
    )
    if vocab is not None:
        for line in vocab["lines"]:
            print(line)


def _name(method):
    """The method as the docs write it: "classic pgd3" -> "classic PGD-3"."""
    names = {
        "fgm": "FGM",
        "pgd3": "PGD-3",
        "awp": "AWP",
        "freelb3": "FreeLB-3",
        "rdrop": "R-Drop",
        "sam": "SAM",
        "asam": "ASAM",
        "smart": "SMART",
    }
    words = method.split(" ")
    return " ".join(names.get(word, word) for word in words)


def vocabulary_comparison(args, shape):
    """FGM / plain at two vocabulary sizes, classic FGM beside, interleaved in one loop."""
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
    rows = [
        {"benchmark": "adversarial", "case": f"fgm, vocab {args.large_vocab}",
         "baseline": f"plain, vocab {args.large_vocab}", "ratio": ratio_large,
         "median_ms": 1000 * vt[("fgm", args.large_vocab)]},
        {"benchmark": "adversarial", "case": f"fgm, vocab {args.large_vocab}",
         "baseline": f"classic fgm, vocab {args.large_vocab}", "ratio": fgm_x_classic_large,
         "median_ms": 1000 * vt[("fgm", args.large_vocab)]},
    ]  # fmt: skip
    lines = [
        f"FGM / plain at vocab {args.vocab}: {ratio_small:.2f}x, at {args.large_vocab}: {ratio_large:.2f}x "
        f"({100 * (ratio_large / ratio_small - 1):+.1f}%; goal within 5%); FGM's extra time over plain: "
        f"{extra_small:.2f} s at {args.vocab}, {extra_large:.2f} s at {args.large_vocab} "
        f"({100 * (extra_large / extra_small - 1):+.1f}%)",
        f"Plain step: {vt[('plain', args.vocab)]:.2f} s at {args.vocab}, "
        f"{vt[('plain', args.large_vocab)]:.2f} s at {args.large_vocab}; "
        f"classic FGM's extra time over plain: {classic_extra_small:.2f} s at {args.vocab}, "
        f"{classic_extra_large:.2f} s at {args.large_vocab}; FGM / classic FGM at {args.large_vocab}: "
        f"{fgm_x_classic_large:.2f}x",
    ]
    return {"rows": rows, "lines": lines}


if __name__ == "__main__":
    main()
