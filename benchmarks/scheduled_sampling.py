"""Time of one scheduled-sampling training step against teacher forcing and a naive two-pass version, side by side.

    python benchmarks/scheduled_sampling.py --threads 1 --repeats 15   # the README's numbers
    python benchmarks/scheduled_sampling.py            # BART d_model 256, 3+3 layers, vocab 32k, batch 16, 256 -> 64
    python benchmarks/scheduled_sampling.py --quick    # tiny BART, seconds
    python benchmarks/scheduled_sampling.py --device cuda   # on the GPU (scripts/gpu_check.sh)

One step = forward, cross-entropy on the labels, backward (the optimizer update is the same for every variant and is
left out, so the ratios are the strictest). Variants, on the same model and batch:

- teacher_forcing: one plain forward.
- scheduled_sampling: ``scheduled_sampling_forward`` (encoder once, decoder pass 1 under no_grad, pass 2 reusing the
  encoder outputs), ratio 0.5, argmax; and the same with ``mode="soft"`` (the expected embedding adds a
  (tokens x vocab) @ (vocab x d_model) product and its backward).
- naive: pass 1 reruns the whole model (encoder included) under no_grad, then a full forward on the mixed input.

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
from transformers import BartConfig, BartForConditionalGeneration

from nlp_tricks.seq2seq.scheduled_sampling import mix_decoder_inputs, replacement_mask, scheduled_sampling_forward

FULL = dict(d_model=256, layers=3, ffn=1024, heads=4, vocab=32000, batch=16, source=256, target=64, repeats=7)
QUICK = dict(d_model=32, layers=2, ffn=64, heads=4, vocab=1000, batch=4, source=32, target=16, repeats=3)
RATIO = 0.5


def build(cfg, device="cpu"):
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=cfg["vocab"],
        d_model=cfg["d_model"],
        encoder_layers=cfg["layers"],
        decoder_layers=cfg["layers"],
        encoder_attention_heads=cfg["heads"],
        decoder_attention_heads=cfg["heads"],
        encoder_ffn_dim=cfg["ffn"],
        decoder_ffn_dim=cfg["ffn"],
        max_position_embeddings=max(cfg["source"], cfg["target"]),
    )
    model = BartForConditionalGeneration(config).train().to(device)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, cfg["vocab"], (cfg["batch"], cfg["source"]), generator=g).to(device)
    labels = torch.randint(4, cfg["vocab"], (cfg["batch"], cfg["target"]), generator=g).to(device)
    for i in range(cfg["batch"]):  # targets of different lengths
        labels[i, cfg["target"] - (i * 7) % (cfg["target"] // 2) :] = -100
    inputs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "decoder_input_ids": model.prepare_decoder_input_ids_from_labels(labels=labels),
    }
    return model, inputs, labels


def _loss(logits, labels):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def teacher_forcing(model, inputs, labels):
    return model(**inputs).logits


def scheduled_sampling(model, inputs, labels):
    return scheduled_sampling_forward(model, inputs, labels, RATIO).logits


def scheduled_sampling_soft(model, inputs, labels):
    return scheduled_sampling_forward(model, inputs, labels, RATIO, mode="soft").logits


def naive(model, inputs, labels):
    with torch.no_grad():
        first = model(**inputs).logits
    mixed = mix_decoder_inputs(inputs["decoder_input_ids"], first, replacement_mask(labels, RATIO))
    return model(**{**inputs, **mixed}).logits


VARIANTS = {
    "teacher_forcing": teacher_forcing,
    "scheduled_sampling (argmax)": scheduled_sampling,
    "scheduled_sampling (soft)": scheduled_sampling_soft,
    "naive (reruns the encoder)": naive,
}


def step(fn, model, inputs, labels):
    model.zero_grad(set_to_none=True)
    _loss(fn(model, inputs, labels), labels).backward()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny BART, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for benchmarks/run_all.py)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    args = parser.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    if args.repeats:
        cfg["repeats"] = args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)

    model, inputs, labels = build(cfg, args.device)
    steps = {name: functools.partial(step, fn, model, inputs, labels) for name, fn in VARIANTS.items()}
    times = time_interleaved(steps, cfg["repeats"])

    shape = (
        f"BART d_model {cfg['d_model']}, {cfg['layers']}+{cfg['layers']} layers, vocab {cfg['vocab']}, batch "
        f"{cfg['batch']}, source {cfg['source']}, target {cfg['target']}; ratio {RATIO}; "
        f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else f'{torch.get_num_threads()} threads'}; "
        f"median of {cfg['repeats']}"
    )
    if args.json:
        rows = [
            {"benchmark": "scheduled_sampling", "case": name, "baseline": "teacher_forcing",
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
