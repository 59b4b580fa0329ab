"""Time of an NER training step with a span head (GlobalPointer, EfficientGlobalPointer) against the same step with
the CRF, and of predicting a batch (scores and decoding) against Viterbi.

    python benchmarks/span_head.py              # MiniLM-shaped encoder, batch 16 x 48 and 16 x 128 sub-tokens
    python benchmarks/span_head.py --quick      # tiny shapes, seconds

Rows, each a median over interleaved rounds in a rotating order, ratios paired by round (``_timing.py``):

- ``ner_step_<head> L6 H384 16xN``: one ``TricksTrainer`` training step (forward, backward, AdamW step) of a
  MiniLM-shaped BertForTokenClassification (6 layers, hidden 384, batch 16 x N sub-tokens, a quarter of them
  continuations of a word) with ``span_head=<head>`` (6 entity types, span_head_size 64), against the same step with
  ``crf=True`` (13 BIO tags: the same 6 types); ``ner_step_ce``: softmax tagging against the CRF.
- ``predict_<head>``: ``prediction_step`` on the same batch (the span scores and their decoding) against the CRF's
  (Viterbi paths).

A span head's scores are batch x types x words^2: its cost grows with the square of the sentence length, the CRF's
linearly, so the 128 row shows where that starts to tell.
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
from nlp_tricks.data.spans import span_label_rows

TYPES = 6
VARIANTS = {
    "ce": {},
    "crf": {"crf": True},
    "global_pointer": {"span_head": "global_pointer"},
    "efficient_global_pointer": {"span_head": "efficient_global_pointer"},
}


def batches(batch: int, length: int) -> tuple[dict, dict]:
    """The same sentences as a tagging batch (BIO tag ids at first sub-tokens) and as a span batch (label rows)."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1000, 30000, (batch, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    attention = (torch.arange(length) < lengths[:, None]).long()
    tags = torch.full((batch, length), -100)
    rows = []
    for b in range(batch):
        continuation = torch.rand(length, generator=g) < 0.25
        positions = [p for p in range(1, int(lengths[b]) - 1) if p == 1 or not continuation[p]]
        spans, word = [], 0
        while word < len(positions):  # flat entities of 1-3 words over about a fifth of the words
            if torch.rand(1, generator=g) < 0.1:
                end = min(len(positions), word + int(torch.randint(1, 4, (1,), generator=g)))
                spans.append((int(torch.randint(0, TYPES, (1,), generator=g)), word, end))
                word = end
            else:
                word += 1
        word_tags = [0] * len(positions)
        for kind, start, end in spans:
            word_tags[start:end] = [1 + 2 * kind] + [2 + 2 * kind] * (end - start - 1)
        tags[b, positions] = torch.tensor(word_tags)
        rows.append(span_label_rows(positions, spans))
    width = max(map(len, rows))
    labels = torch.tensor([r + [[-100, -100, -100]] * (width - len(r)) for r in rows])
    inputs = {"input_ids": input_ids, "attention_mask": attention}
    return {**inputs, "labels": tags}, {**inputs, "labels": labels}


def step_rows(layers: int, hidden: int, batch: int, length: int, repeats: int) -> list[dict]:
    from transformers import BertConfig, BertForTokenClassification

    tagged, spanned = batches(batch, length)
    steps, predictions = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, settings in VARIANTS.items():
            torch.manual_seed(0)
            config = BertConfig(
                vocab_size=30522,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=max(1, hidden // 32),
                intermediate_size=4 * hidden,
                num_labels=TYPES if "span_head" in settings else 2 * TYPES + 1,
            )
            args = TricksArguments(
                output_dir=tmp, report_to="none", use_cpu=True, learning_rate=1e-4, disable_tqdm=True, **settings
            )
            trainer = TricksTrainer(model=BertForTokenClassification(config), args=args)
            trainer.create_optimizer()
            inputs = spanned if "span_head" in settings else tagged
            steps[name] = _train_step(trainer, inputs)
            if name != "ce":
                predictions[name] = _predict(trainer, copy.copy(inputs))
        times = time_interleaved(steps, repeats)
        predict_times = time_interleaved(predictions, repeats)
    shape = f"L{layers} H{hidden} {batch}x{length}"
    rows = []
    for name in VARIANTS:
        if name != "crf":
            rows.append(_row(f"ner_step_{name} {shape}", "ner_step_crf", times, name, "crf"))
    for name in predictions:
        if name != "crf":
            rows.append(_row(f"predict_{name} {shape}", "predict_crf", predict_times, name, "crf"))
    return rows


def _row(case: str, baseline: str, times: dict, name: str, reference: str) -> dict:
    return {
        "benchmark": "span_head",
        "case": case,
        "baseline": baseline,
        "median_ms": 1000 * statistics.median(times[name]),
        "baseline_ms": 1000 * statistics.median(times[reference]),
        "ratio": paired_ratio(times, name, reference),
    }


def _train_step(trainer: TricksTrainer, inputs: dict):
    def step():
        count = trainer._get_num_items_in_batch([inputs], torch.device("cpu"))
        trainer.training_step(trainer.model, inputs, count)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    return step


def _predict(trainer: TricksTrainer, inputs: dict):
    def step():
        trainer.model.eval()  # the training step puts it back in training mode
        trainer.prediction_step(trainer.model, inputs, prediction_loss_only=False)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for benchmarks/run_all.py)")
    args = parser.parse_args()
    if args.quick:
        rows = step_rows(1, 32, 2, 12, 3)
    else:
        rows = step_rows(6, 384, 16, 48, args.repeats) + step_rows(6, 384, 16, 128, args.repeats)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, medians of interleaved rounds")
    print("| case | ms | baseline | baseline ms | time / baseline |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median_ms']:.1f} | {r['baseline']} | {r['baseline_ms']:.1f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
