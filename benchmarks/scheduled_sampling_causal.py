"""Time of one scheduled-sampling training step of a decoder-only (causal) LM against teacher forcing, side by side.

    python benchmarks/scheduled_sampling_causal.py --threads 1 --repeats 15           # the docs' numbers
    python benchmarks/scheduled_sampling_causal.py --threads 1 --repeats 7 --smollm2  # and these
    python benchmarks/scheduled_sampling_causal.py          # Llama d 256, 4 layers, vocab 32k, batch 4, 64 + 64
    python benchmarks/scheduled_sampling_causal.py --smollm2  # SmolLM2-135M's shape (30 layers, vocab 49k), batch 2
    python benchmarks/scheduled_sampling_causal.py --quick  # tiny Llama, seconds
    python benchmarks/scheduled_sampling_causal.py --device cuda   # on the GPU

One step = forward, the causal-LM cross-entropy (logits at t - 1 against the label at t, on the completion tokens
only), backward (the optimizer update is the same for every variant and is left out, so the ratios are the
strictest). The models are built from config with random weights (no download): the default is a small Llama whose
vocabulary projection dominates the step; ``--smollm2`` takes SmolLM2-135M's architecture, where the 30 layers do.
Variants, on the same model and batch (prompt labelled -100, completion labelled, some right padding):

- teacher_forcing: one plain forward.
- scheduled_sampling: ``causal_scheduled_sampling_forward`` at ratio 0.5: pass 1 teacher-forced under no_grad (no
  key/value cache), half the completion tokens replaced by pass 1's predictions, pass 2 with the gradient; with
  ``mode="argmax"``, ``"sample"`` and ``"soft"`` (the expected embedding adds a (tokens x vocab) @ (vocab x d)
  product and its backward).

Time: the median over interleaved rounds, the order rotating each round; the ratio to teacher forcing is the median
of the per-round ratios (``_timing.py``), on CPU (or, with ``--device cuda``, on the GPU between
``torch.cuda.synchronize()`` calls).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import torch.nn.functional as F
from _timing import paired_ratio, time_interleaved
from transformers import LlamaConfig, LlamaForCausalLM

from nlp_tricks.functional.scheduled_sampling import causal_scheduled_sampling_forward

FULL = dict(d_model=256, layers=4, ffn=688, heads=4, kv_heads=4, vocab=32000, batch=4, prompt=64, completion=64,
            repeats=7)  # fmt: skip
# SmolLM2-135M (LlamaForCausalLM): hidden 576, 30 layers, 9 heads / 3 key-value heads, ffn 1536, vocab 49152, tied.
SMOLLM2 = dict(d_model=576, layers=30, ffn=1536, heads=9, kv_heads=3, vocab=49152, batch=2, prompt=64, completion=64,
               repeats=5)  # fmt: skip
QUICK = dict(d_model=32, layers=2, ffn=64, heads=4, kv_heads=4, vocab=1000, batch=4, prompt=16, completion=16,
             repeats=3)  # fmt: skip
RATIO = 0.5


def build(cfg, device="cpu"):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["d_model"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        intermediate_size=cfg["ffn"],
        max_position_embeddings=cfg["prompt"] + cfg["completion"],
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).train().to(device)
    g = torch.Generator().manual_seed(0)
    length = cfg["prompt"] + cfg["completion"]
    input_ids = torch.randint(4, cfg["vocab"], (cfg["batch"], length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    labels[:, : cfg["prompt"]] = -100
    for i in range(cfg["batch"]):  # completions of different lengths, right-padded
        end = length - (i * 7) % (cfg["completion"] // 2)
        labels[i, end:] = -100
        attention_mask[i, end:] = 0
        input_ids[i, end:] = 0
    inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    return model, inputs, labels.to(device)


def _loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def teacher_forcing(model, inputs, labels):
    return model(**inputs).logits


def scheduled_sampling(mode, model, inputs, labels):
    return causal_scheduled_sampling_forward(model, inputs, labels, RATIO, mode=mode).logits


VARIANTS = {
    "teacher_forcing": teacher_forcing,
    "scheduled_sampling (argmax)": functools.partial(scheduled_sampling, "argmax"),
    "scheduled_sampling (sample)": functools.partial(scheduled_sampling, "sample"),
    "scheduled_sampling (soft)": functools.partial(scheduled_sampling, "soft"),
}


def step(fn, model, inputs, labels):
    model.zero_grad(set_to_none=True)
    _loss(fn(model, inputs, labels), labels).backward()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny Llama, 3 repeats")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M's architecture (random weights)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for benchmarks/run_all.py)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    args = parser.parse_args()
    cfg = dict(QUICK if args.quick else SMOLLM2 if args.smollm2 else FULL)
    if args.repeats:
        cfg["repeats"] = args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)

    model, inputs, labels = build(cfg, args.device)
    steps = {name: functools.partial(step, fn, model, inputs, labels) for name, fn in VARIANTS.items()}
    times = time_interleaved(steps, cfg["repeats"])

    shape = (
        f"Llama d_model {cfg['d_model']}, {cfg['layers']} layers, {cfg['heads']}/{cfg['kv_heads']} heads, "
        f"vocab {cfg['vocab']}, batch {cfg['batch']}, "
        f"prompt {cfg['prompt']} + completion up to {cfg['completion']}; ratio {RATIO}; "
        f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else f'{torch.get_num_threads()} threads'}; "
        f"median of {cfg['repeats']}"
    )
    if args.json:
        bench = "scheduled_sampling_causal" + ("_smollm2" if args.smollm2 else "")
        rows = [
            {"benchmark": bench, "case": name, "baseline": "teacher_forcing",
             "ratio": paired_ratio(times, name, "teacher_forcing"), "median_ms": 1000 * statistics.median(ts)}
            for name, ts in times.items()
        ]  # fmt: skip
        print(json.dumps(rows))
        return
    print(shape)
    print("| step (forward + backward) | median s | x teacher forcing |")
    print("|---|---|---|")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"| {name} | {median:.3f} | {paired_ratio(times, name, 'teacher_forcing'):.2f} |")


if __name__ == "__main__":
    main()
