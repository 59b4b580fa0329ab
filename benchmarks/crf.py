"""Time of nlp_tricks' CRF against the pytorch-crf package, and of an NER training step with and without the CRF.

    pip install pytorch-crf                 # the reference (not a dependency of nlp_tricks; skipped if absent)
    python benchmarks/crf.py                # batch 32 x 64, 21 tags; NER step of a MiniLM-shaped encoder
    python benchmarks/crf.py --quick        # tiny shapes, seconds

Rows, each a median over interleaved rounds in a rotating order, ratios paired by round (``_timing.py``):

- ``nll+backward``: the negative log-likelihood of a padded batch (lengths 32..64) and its backward, against
  ``torchcrf.CRF(batch_first=True)`` with the same scores.
- ``viterbi``: decoding the same batch to lists of tags, against ``torchcrf.CRF.decode``.
- ``ner_step_crf``: one ``TricksTrainer`` training step (forward, backward, AdamW step) of a MiniLM-shaped
  BertForTokenClassification (6 layers, hidden 384, 13 labels, batch 16 x 48 sub-tokens, a third of them labelled
  -100) with ``crf=True``, against the same step with cross-entropy.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile

import torch
from _timing import paired_ratio, time_interleaved

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.functional.crf import CRF

try:
    from torchcrf import CRF as ReferenceCRF
except ImportError:  # pytorch-crf is optional: its rows are skipped
    ReferenceCRF = None


def crf_rows(batch: int, length: int, num_tags: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    emissions = torch.randn(batch, length, num_tags, generator=g).requires_grad_()
    tags = torch.randint(0, num_tags, (batch, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    lengths[0] = length  # pytorch-crf wants the first position on and the longest sequence full
    mask = torch.arange(length) < lengths[:, None]
    ours = CRF(num_tags)
    with torch.no_grad():
        for p in ours.parameters():
            p.uniform_(-0.1, 0.1, generator=g)
    steps = {"nlp_tricks": lambda: _nll(ours.log_likelihood(emissions, tags, mask), emissions)}
    decode = {"nlp_tricks": lambda: ours.decode(emissions, mask)}
    if ReferenceCRF is not None:
        ref = ReferenceCRF(num_tags, batch_first=True)
        ref.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("allowed_")})
        steps["pytorch-crf"] = lambda: _nll(ref(emissions, tags, mask, reduction="none"), emissions)
        decode["pytorch-crf"] = lambda: ref.decode(emissions, mask)
        with torch.no_grad():
            torch.testing.assert_close(ours.log_likelihood(emissions, tags, mask), ref(emissions, tags, mask, "none"))
        assert ours.decode(emissions, mask) == ref.decode(emissions, mask)
    rows = []
    for case, variants in (("nll+backward", steps), ("viterbi", decode)):
        times = time_interleaved(variants, repeats)
        baseline = "pytorch-crf" if "pytorch-crf" in times else "nlp_tricks"
        rows.append(
            {
                "benchmark": "crf",
                "case": f"{case} {batch}x{length}x{num_tags}",
                "baseline": baseline if baseline != "nlp_tricks" else "none (pip install pytorch-crf)",
                "median_ms": 1000 * statistics.median(times["nlp_tricks"]),
                "baseline_ms": 1000 * statistics.median(times[baseline]),
                "ratio": paired_ratio(times, "nlp_tricks", baseline),
            }
        )
    return rows


def _nll(log_likelihood: torch.Tensor, emissions: torch.Tensor) -> None:
    emissions.grad = None
    (-log_likelihood.sum()).backward()


def ner_step_row(layers: int, hidden: int, batch: int, length: int, repeats: int) -> dict:
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        intermediate_size=4 * hidden,
        num_labels=13,
    )
    base = BertForTokenClassification(config)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1000, 30000, (batch, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    attention = (torch.arange(length) < lengths[:, None]).long()
    labels = torch.randint(0, 13, (batch, length), generator=g)
    continuation = torch.rand(batch, length, generator=g) < 0.25  # later sub-tokens of a word
    labels[(attention == 0) | continuation] = -100
    labels[:, 0] = -100  # [CLS]
    labels[torch.arange(batch), lengths - 1] = -100  # [SEP]
    inputs = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}

    steps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, crf in (("ce", False), ("crf", True)):
            args = TricksArguments(
                output_dir=tmp, report_to="none", use_cpu=True, crf=crf, learning_rate=1e-4, disable_tqdm=True
            )
            trainer = TricksTrainer(model=copy.deepcopy(base), args=args)
            trainer.create_optimizer()
            steps[name] = _train_step(trainer, inputs)
        times = time_interleaved(steps, repeats)
    return {
        "benchmark": "crf",
        "case": f"ner_step_crf L{layers} H{hidden} {batch}x{length}",
        "baseline": "ner_step_ce",
        "median_ms": 1000 * statistics.median(times["crf"]),
        "baseline_ms": 1000 * statistics.median(times["ce"]),
        "ratio": paired_ratio(times, "crf", "ce"),
    }


def _train_step(trainer: TricksTrainer, inputs: dict):
    def step():
        count = trainer._get_num_items_in_batch([inputs], torch.device("cpu"))
        trainer.training_step(trainer.model, inputs, count)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for benchmarks/run_all.py)")
    args = parser.parse_args()
    if args.quick:
        rows = crf_rows(4, 8, 5, 3) + [ner_step_row(1, 32, 2, 8, 3)]
    else:
        rows = crf_rows(32, 64, 21, args.repeats) + [ner_step_row(6, 384, 16, 48, args.repeats)]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, medians of interleaved rounds")
    print("| case | nlp_tricks ms | baseline | baseline ms | time / baseline |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median_ms']:.1f} | {r['baseline']} | {r['baseline_ms']:.1f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
