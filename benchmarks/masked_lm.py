"""Time of one masked-LM training step with sparse prediction against the full-vocabulary logits, side by side.

    python benchmarks/masked_lm.py            # MiniLM-L6 shapes (hidden 384, 6 layers, vocab 30,522), batch 16 x 128
    python benchmarks/masked_lm.py --quick    # tiny shapes, seconds

Forward + backward of a BERT masked LM built from config (random weights: the time does not depend on them) on one
batch with 15% of the positions labelled, through ``MaskedLMTrainer.compute_loss``: ``full_logits`` (``sparse=False``:
every position projected onto the vocabulary) against ``sparse_prediction`` (only the labelled positions,
:func:`nlp_tricks.masked_lm.sparse_prediction`); ``model_loss`` is the model's own loss (upstream ``Trainer``).
Times are medians over interleaved rounds; the ratio is the median of the per-round ratios (``_timing.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile

import torch
from _timing import paired_ratio, time_interleaved
from transformers import BertConfig, BertForMaskedLM

from nlp_tricks import TricksArguments
from nlp_tricks.masked_lm import MaskedLMTrainer

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536, vocab_size=30522)
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=1000)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a 2-layer hidden-32 model, vocab 1000, batch 4 x 32")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for benchmarks/run_all.py)")
    args = parser.parse_args()
    shape = TINY if args.quick else MINILM
    if args.quick:
        args.batch, args.length, args.repeats = 4, 32, 3

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**shape, max_position_embeddings=512))
    input_ids = torch.randint(5, shape["vocab_size"], (args.batch, args.length))
    labels = torch.where(torch.rand(input_ids.shape) < 0.15, input_ids, -100)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    with tempfile.TemporaryDirectory() as tmp:
        trainer_args = TricksArguments(output_dir=tmp, report_to="none", use_cpu=True)
        trainers = {sparse: MaskedLMTrainer(model=model, args=trainer_args, sparse=sparse) for sparse in (False, True)}

    def step(sparse: bool | None):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss if sparse is None else trainers[sparse].compute_loss(model, batch)
        loss.backward()

    cases = {"full_logits": False, "sparse_prediction": True, "model_loss": None}
    times = time_interleaved({case: functools.partial(step, sparse) for case, sparse in cases.items()}, args.repeats)
    rows = [
        {
            "benchmark": "masked_lm",
            "case": case,
            "baseline": "full_logits",
            "median_ms": 1000 * statistics.median(times[case]),
            "ratio": paired_ratio(times, case, "full_logits"),
        }
        for case in cases
    ]
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"BERT masked LM hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, vocab "
        f"{shape['vocab_size']}, batch {args.batch} x {args.length}, 15% labelled, forward + backward, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print("| case | median ms | time / full_logits |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median_ms']:.0f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
