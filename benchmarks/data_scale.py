"""Rows, seconds and peak memory of the recipes' data paths against the plain ``datasets`` pipeline, as files grow.

    python benchmarks/data_scale.py                          # 60k / 240k / 480k rows, every task
    python benchmarks/data_scale.py --rows 60000 --tasks classification
    python benchmarks/data_scale.py --quick                  # 2k rows: does it run
    python benchmarks/data_scale.py --tasks classification --rows 480000 --labels 3 --model tiny \
        --variants plain full                               # the whole recipe against the plain pipeline

The data is synthetic, written by this script (seeded): sentences of 8-30 words drawn from a fixed vocabulary of
English words, so the texts tokenize to about 12-45 WordPiece tokens with the demo's MiniLM tokenizer.

- classification: a CSV ``text,label`` (``--labels``, 4 by default), 80/10/10 split by the recipe.
- ner: a CoNLL file (``word tag``, 6-20 words a sentence, BIO tags of 3 types).
- summarization: JSON lines ``{"text", "summary"}`` (a 15-40-word document, its first 5-12 words as summary).

Each task's rows, each in its own process, its peak RSS read from ``os.wait4`` (the process and its children):

- ``plain``: ``load_dataset("csv" / "json")`` and a batched ``map`` of the tokenizer with truncation, the
  pipeline Hugging Face's examples use (``run_classification.py``, ``run_ner.py``, ``run_summarization.py``).
- ``recipe data``: the recipe's own data preparation (read and check every line, split, labels, tokenize, count what
  truncation cuts), without a model.
- ``recipe run``: the whole recipe, ``--max_steps 1`` with 64 evaluation examples (data, model load, one step,
  evaluation, writing the outputs).
- ``recipe rerun``: the same run again, its tokenized data now in the ``datasets`` cache.
- ``recipe full run``: the whole recipe as a user runs it, ``--max_steps 1 --max_seq_length 64 --eval_strategy no``
  and nothing else: it also evaluates on every validation row and predicts (and writes) every test row. With
  ``plain`` in the same run it prints the ratio and whether it meets the goal: at most 1.5x the plain pipeline's
  seconds + 30 s, and at most 1.5 GB peak.
- ``data rerun``: the recipe's data preparation again, in the cache of ``recipe data``.

``seconds`` is the child's wall time; ``data s`` the data work alone, timed inside the child after its imports and
tokenizer load (the recipes import torch and the Trainer, the plain pipeline does not). Every run gets a fresh
``HF_DATASETS_CACHE`` (except the rerun, which reuses the run's), so a first run pays the
whole cost. ``--threads`` sets ``OMP_NUM_THREADS`` / ``RAYON_NUM_THREADS`` of every child. ``--model tiny`` runs the
recipes on a 2-layer BERT of width 32 with the demo's tokenizer (built here, seeded), so that the model's forward
passes do not hide the data path; ``demo`` (the default) on the demo's MiniLM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be has had not or its "
    "first new after who they have their two she been one all during time other when into more would there city "
    "year team game world state school season between later under while second three film people years house since "
    "group national american war over river league government most where about album series company played music "
    "system county part only known west north south east york early including well public named club music town "
    "village family local station university history record several four area party won made number following "
    "single major court church around final work best original army members united power center field line market"
).split()
NER_TYPES = ("PER", "ORG", "LOC")
MAX_SEQ_LENGTH = 64


# ---- Synthetic data -----------------------------------------------------------------------------------------------


def sentence(rng: random.Random, low: int, high: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(low, high))]


def write_classification(path: Path, rows: int, labels: int = 4) -> None:
    rng = random.Random(0)
    names = "abcdefghijklmnopqrstuvwxyz"[:labels]
    with path.open("w", encoding="utf-8") as f:
        f.write("text,label\n")
        for _ in range(rows):
            f.write(f"{' '.join(sentence(rng, 8, 30))},{rng.choice(names)}\n")


def write_ner(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            words, k = sentence(rng, 6, 20), 0
            tags = ["O"] * len(words)
            while k < len(words):
                if rng.random() < 0.15:
                    kind, span = rng.choice(NER_TYPES), rng.randint(1, 3)
                    for j in range(k, min(k + span, len(words))):
                        tags[j] = ("B-" if j == k else "I-") + kind
                    k += span
                else:
                    k += 1
            f.write("".join(f"{w} {t}\n" for w, t in zip(words, tags)) + "\n")


def write_summarization(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            words = sentence(rng, 15, 40)
            summary = words[: rng.randint(5, 12)]
            f.write(json.dumps({"text": " ".join(words), "summary": " ".join(summary)}) + "\n")


LABELS = {
    "plain": "plain",
    "data": "recipe data",
    "redata": "data rerun",
    "run": "recipe run",
    "rerun": "recipe rerun",
    "full": "recipe full run",
}
# The goal of the whole recipe against the plain pipeline: seconds <= RATIO * plain + SLACK, peak <= PEAK_GB.
GOAL_RATIO, GOAL_SLACK_S, GOAL_PEAK_GB = 1.5, 30.0, 1.5
REUSES = {"redata": "data", "rerun": "run"}  # variants that run in another variant's cache
WRITERS = {"classification": write_classification, "ner": write_ner, "summarization": write_summarization}
SUFFIXES = {"classification": ".csv", "ner": ".conll", "summarization": ".jsonl"}


# ---- What each child process runs ---------------------------------------------------------------------------------


def plain(task: str, path: str) -> None:
    """Hugging Face's examples' pipeline: ``load_dataset`` of the file and a batched ``map`` of the tokenizer."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from nlp_tricks.data import demo_model_path

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    start = time.perf_counter()
    if task == "classification":
        raw = load_dataset("csv", data_files=path)["train"]
        raw.map(
            lambda batch: tokenizer(batch["text"], truncation=True, max_length=MAX_SEQ_LENGTH),
            batched=True,
            remove_columns=raw.column_names,
        )
    elif task == "summarization":
        raw = load_dataset("json", data_files=path)["train"]

        def preprocess(batch):
            inputs = tokenizer(batch["text"], truncation=True, max_length=MAX_SEQ_LENGTH)
            inputs["labels"] = tokenizer(text_target=batch["summary"], truncation=True, max_length=32)["input_ids"]
            return inputs

        raw.map(preprocess, batched=True, remove_columns=raw.column_names)
    else:  # run_ner.py reads CoNLL through a dataset script; its JSON-lines twin is what load_dataset reads
        raw = load_dataset("json", data_files=path)["train"]
        label2id = {}

        def preprocess(batch):
            inputs = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=MAX_SEQ_LENGTH)
            labels = []
            for i, tags in enumerate(batch["ner_tags"]):
                previous, row = None, []
                for word in inputs.word_ids(batch_index=i):
                    row.append(-100 if word is None or word == previous else label2id.setdefault(tags[word], 0))
                    previous = word
                labels.append(row)
            inputs["labels"] = labels
            return inputs

        raw.map(preprocess, batched=True, remove_columns=raw.column_names)
    print(f"work {time.perf_counter() - start:.2f}")


def write_tiny_model(folder: Path) -> str:
    """A 2-layer BERT of width 32 (random weights, seeded) with the demo model's tokenizer: the recipes' data path
    at full size, a model that costs next to nothing."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from nlp_tricks.data import demo_model_path

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
    )
    BertModel(config).save_pretrained(folder)
    return str(folder)


def recipe_args(task: str, path: str, out: str, evaluate_all: bool = False) -> list[str]:
    args = ["--train_file", path, "--output_dir", out, "--report_to", "none"]
    if not evaluate_all:
        args += ["--max_eval_samples", "64"]
    if task == "summarization":
        return args + ["--max_source_length", str(MAX_SEQ_LENGTH), "--max_target_length", "32"]
    return args + ["--max_seq_length", str(MAX_SEQ_LENGTH)]


def recipe_data(task: str, path: str) -> None:
    """The recipe's data preparation, as its ``main`` runs it, without a model."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from transformers import AutoTokenizer

    from nlp_tricks.data import demo_model_path

    import common

    module = __import__(task)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    with tempfile.TemporaryDirectory() as out:
        data_args, *_ = common.parse_recipe_args(
            module.RECIPE_ARGUMENT_TYPES, task, module.RECIPE_DEFAULTS, recipe_args(task, path, out)
        )
        start = time.perf_counter()
        module.prepare_data(data_args, tokenizer)
        print(f"work {time.perf_counter() - start:.2f}")


# ---- The parent: run each child, read its peak memory -------------------------------------------------------------


def measure(command: list[str], env: dict) -> tuple[float, float | None, float, int]:
    """``(seconds, seconds of the data work alone, peak RSS in GB, exit status)`` of ``command`` as a child process
    (the data work: what a child that prints ``work SECONDS`` timed after its imports and tokenizer load)."""
    # Files, not pipes: progress bars could fill a pipe and block the child.
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        work = [line.split()[1] for line in stdout.read().decode(errors="replace").splitlines() if line[:5] == "work "]
        if returncode:
            stderr.seek(0)
            error = stderr.read().decode(errors="replace")
            print(f"  {' '.join(command[:4])}... exit {returncode}:\n{error[-2000:]}", file=sys.stderr)
    return seconds, float(work[-1]) if work else None, usage.ru_maxrss / 1024**2, returncode  # KB on Linux


def child_env(cache: Path, threads: int) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'recipes'}",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_CACHE": str(cache),
        "OMP_NUM_THREADS": str(threads),
        "RAYON_NUM_THREADS": str(threads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[60_000, 240_000, 480_000])
    parser.add_argument("--tasks", nargs="+", default=list(WRITERS), choices=list(WRITERS))
    parser.add_argument(
        "--variants", nargs="+", default=["plain", "data", "redata", "run", "rerun"], choices=list(LABELS)
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--labels", type=int, default=4, help="classes of the classification file (2-26)")
    parser.add_argument(
        "--model", choices=["demo", "tiny"], default="demo", help="the recipes' model: the demo's MiniLM, a tiny BERT"
    )
    parser.add_argument("--quick", action="store_true", help="2,000 rows only")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "TASK", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, task, path = args.child
        (plain if kind == "plain" else recipe_data)(task, path)
        return
    rows_list = [2_000] if args.quick else args.rows
    print(
        f"threads {args.threads}; load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    print(f"{'task':<15}{'rows':>9}  {'variant':<16}{'seconds':>9}{'data s':>9}{'peak GB':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = ["--model_name_or_path", write_tiny_model(tmp / "tiny_model")] if args.model == "tiny" else []
        for task in args.tasks:
            for rows in rows_list:
                data = tmp / f"{task}_{rows}{SUFFIXES[task]}"
                if task == "classification":
                    write_classification(data, rows, args.labels)
                else:
                    WRITERS[task](data, rows)
                measured = {}
                if task == "ner" and "plain" in args.variants:
                    write_ner_jsonl(data, data.with_suffix(".jsonl"))
                for variant in args.variants:
                    cache = tmp / f"cache_{task}_{rows}_{REUSES.get(variant, variant)}"
                    if variant not in REUSES:
                        shutil.rmtree(cache, ignore_errors=True)
                    out = tmp / f"out_{task}_{rows}"
                    if variant in ("plain", "data", "redata"):
                        path = data.with_suffix(".jsonl") if (task, variant) == ("ner", "plain") else data
                        kind = "plain" if variant == "plain" else "data"
                        command = [sys.executable, __file__, "--child", kind, task, str(path)]
                    else:
                        shutil.rmtree(out, ignore_errors=True)
                        recipe = str(ROOT / "recipes" / f"{task}.py")
                        flags = recipe_args(task, str(data), str(out), evaluate_all=variant == "full")
                        flags += ["--eval_strategy", "no"] if variant == "full" else []
                        command = [sys.executable, recipe, *flags, *model, "--max_steps", "1"]
                    seconds, work, peak, status = measure(command, child_env(cache, args.threads))
                    measured[variant] = (seconds, peak, status)
                    failed = "" if status == 0 else f"  (exit {status})"
                    work = "" if work is None else f"{work:.1f}"
                    print(
                        f"{task:<15}{rows:>9}  {LABELS[variant]:<16}{seconds:>9.1f}{work:>9}{peak:>9.2f}{failed}",
                        flush=True,
                    )
                if "plain" in measured and "full" in measured:
                    print(goal_line(measured["plain"], measured["full"]), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


def goal_line(plain: tuple[float, float, int], full: tuple[float, float, int]) -> str:
    """Whether the whole recipe run met the goal against the plain pipeline (seconds, peak GB, exit status)."""
    budget = GOAL_RATIO * plain[0] + GOAL_SLACK_S
    met = full[2] == 0 and full[0] <= budget and full[1] <= GOAL_PEAK_GB
    return (
        f"  recipe full run / plain: {full[0] / plain[0]:.2f}x the seconds, {full[1] / plain[1]:.2f}x the memory; "
        f"goal <= {GOAL_RATIO}x + {GOAL_SLACK_S:.0f} s = {budget:.1f} s and <= {GOAL_PEAK_GB} GB: "
        f"{'met' if met else 'NOT met'}"
    )


def write_ner_jsonl(conll: Path, out: Path) -> None:
    """The CoNLL file as JSON lines (``tokens`` / ``ner_tags``), what ``load_dataset("json")`` reads."""
    with conll.open(encoding="utf-8") as f, out.open("w", encoding="utf-8") as g:
        tokens, tags = [], []
        for line in f:
            if line.strip():
                word, tag = line.split()
                tokens.append(word)
                tags.append(tag)
            elif tokens:
                g.write(json.dumps({"tokens": tokens, "ner_tags": tags}) + "\n")
                tokens, tags = [], []


if __name__ == "__main__":
    main()
