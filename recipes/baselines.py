"""Trivial baselines on the recipes' own splits, so every table shows where a model stands.

    python recipes/baselines.py --baseline gazetteer            # NER: the training entities, longest exact match
    python recipes/baselines.py --baseline tfidf_lr            # classification: TF-IDF + LR, C tuned on validation
    python recipes/baselines.py --baseline lead3               # summarization: the first 3 sentences (copy: all of it)
    python recipes/baselines.py --baseline gazetteer --train_file train.conll --num_folds 5 --fold 0

Each takes the data flags of its task's recipe (files, demo, ``--split_seed``, ``--num_folds`` / ``--fold``) and
ignores training flags, so ``recipes/ablation.py`` runs it as one more row beside the models. It writes the
recipe's test-predictions file and ``all_results.json`` (``eval_`` / ``test_`` metrics computed from the written
predictions) to ``--output_dir``.
"""

from __future__ import annotations

import csv
import functools
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import evidence
from transformers import HfArgumentParser

from nlp_tricks.data.arrow import first_rows
from nlp_tricks.data.schemes import convert_tags, tags_to_spans

from classification import ClassificationDataArguments, load_classification_splits
from common import eval_splits, labelled_splits, run_recipe, write_json_atomic
from ner_data import NerDataArguments
from ner_data import read_data as read_ner_data
from summarization_data import SummarizationDataArguments, load_summarization_splits

BASELINES = {"gazetteer": "ner", "tfidf_lr": "classification", "copy": "summarization", "lead3": "summarization"}


@dataclass
class BaselineArguments:
    baseline: str = field(metadata={"help": "Which baseline.", "choices": list(BASELINES)})
    output_dir: str = field(default="outputs/baseline", metadata={"help": "Where predictions and results go."})
    lowercase: bool = field(default=False, metadata={"help": "gazetteer: match entities case-insensitively."})


# ---- NER: a gazetteer of the training entities ----------------------------------------------------------------------


def build_gazetteer(sentences: list[dict], lowercase: bool = False) -> dict[tuple[str, ...], str]:
    """Every entity of the training sentences (its words; tags of any scheme, read as the NER recipe reads them)
    with its most frequent type."""
    types: dict[tuple[str, ...], Counter] = {}
    for sentence in sentences:
        for kind, start, end in tags_to_spans(list(sentence["ner_tags"])):
            words = tuple(w.lower() if lowercase else w for w in sentence["tokens"][start:end])
            types.setdefault(words, Counter())[kind] += 1
    return {words: counts.most_common(1)[0][0] for words, counts in types.items()}


def tag_with_gazetteer(tokens: list[str], gazetteer: dict[tuple[str, ...], str], lowercase: bool = False) -> list[str]:
    """BIO tags: left to right, the longest entity of the gazetteer that starts at each word; ``O`` elsewhere."""
    words = [w.lower() if lowercase else w for w in tokens]
    longest = max((len(k) for k in gazetteer), default=0)
    tags, i = ["O"] * len(words), 0
    while i < len(words):
        for length in range(min(longest, len(words) - i), 0, -1):
            kind = gazetteer.get(tuple(words[i : i + length]))
            if kind is not None:
                tags[i : i + length] = [f"B-{kind}"] + [f"I-{kind}"] * (length - 1)
                i += length
                break
        else:
            i += 1
    return tags


def write_ner(path: Path, sentences: list[dict], predicted: list[list[str]], scheme: str = "iob2") -> None:
    """The NER recipe's ``test_predictions.txt``: the gold tags as read, the predictions written in ``scheme``."""
    lines = []
    for sentence, tags in zip(sentences, predicted):
        tags = convert_tags(tags, scheme)
        lines += [f"{t}\t{g}\t{p}" for t, g, p in zip(sentence["tokens"], sentence["ner_tags"], tags)] + [""]
    path.write_text("\n".join(lines), encoding="utf-8")


# ---- Classification: TF-IDF + logistic regression -------------------------------------------------------------------


# Inverse regularisation strengths of the logistic regression, chosen on the validation split when there is one.
TFIDF_C_GRID = (0.1, 1.0, 10.0, 100.0, 1000.0)


def tfidf_lr(train: list[dict], seed: int = 0, C: float = 1.0):
    """A fitted scikit-learn pipeline: TF-IDF of word 1-2 grams (sublinear tf) and logistic regression."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    model = make_pipeline(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1),
        LogisticRegression(C=C, max_iter=2000, random_state=seed),
    )
    return model.fit([ex["text"] for ex in train], [ex["label"] for ex in train])


def tfidf_lr_tuned(train: list[dict], validation: list[dict], seed: int = 0):
    """``(model, C)``: :func:`tfidf_lr` at the C of :data:`TFIDF_C_GRID` with the best validation accuracy (the
    smallest on a tie), or C = 1 without validation data. With few training texts the default C = 1 underfits badly
    (50 BBC articles: the model predicts nearly one class), so a fair baseline tunes it, on validation only."""
    if not validation:
        return tfidf_lr(train, seed), 1.0
    texts, gold = [ex["text"] for ex in validation], [ex["label"] for ex in validation]
    best = None
    for C in TFIDF_C_GRID:
        model = tfidf_lr(train, seed, C)
        accuracy = sum(p == g for p, g in zip(model.predict(texts), gold)) / len(gold)
        if best is None or accuracy > best[0]:
            best = (accuracy, model, C)
    return best[1], best[2]


def write_classification(path: Path, examples: list[dict], predicted: list[str]) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "predicted", "text"])
        for ex, pred in zip(examples, predicted):
            writer.writerow([ex["label"], pred, ex["text"]])


# ---- Summarization: copy the input, or its first k sentences -------------------------------------------------------


def lead(text: str, k: int) -> str:
    """The first ``k`` sentences (split after ``.``, ``!`` or ``?`` followed by white space)."""
    sentences = re.split(r"(?<=[.!?])\s+", text.strip())
    return " ".join(sentences[:k])


def write_summarization(path: Path, examples: list[dict], predicted: list[str]) -> None:
    lines = [
        json.dumps({"reference": ex["summary"], "prediction": p}, ensure_ascii=False)
        for ex, p in zip(examples, predicted)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---- The run --------------------------------------------------------------------------------------------------------

DATA_ARGUMENTS = {
    "ner": NerDataArguments,
    "classification": ClassificationDataArguments,
    "summarization": SummarizationDataArguments,
}
METRICS = {"ner": ("f1", "precision", "recall", "accuracy"), "classification": ("accuracy", "f1"),
           "summarization": ("rouge1", "rouge2", "rougeL")}  # fmt: skip


def predict(args: BaselineArguments, task: str, train: list[dict], examples: list[dict], fitted=None) -> list:
    if args.baseline == "gazetteer":
        gazetteer = build_gazetteer(train, args.lowercase)
        return [tag_with_gazetteer(list(ex["tokens"]), gazetteer, args.lowercase) for ex in examples]
    if args.baseline == "tfidf_lr":
        return list(fitted.predict([ex["text"] for ex in examples])) if examples else []
    return [ex["text"] if args.baseline == "copy" else lead(ex["text"], 3) for ex in examples]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    task = next((BASELINES[v] for k, v in zip(argv, argv[1:]) if k == "--baseline" and v in BASELINES), "ner")
    parser = HfArgumentParser((BaselineArguments, DATA_ARGUMENTS[task]))
    parser.prog = "baselines.py"
    args, data, _ = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if task == "ner":
        _, _, train, examples = read_ner_data(data)  # the tag scheme resolved: data.tag_scheme
    elif task == "classification":
        _, train, examples = labelled_splits(load_classification_splits(data), "label", data)
    else:
        splits = load_summarization_splits(data)
        train = first_rows(splits["train"][0], data.max_train_samples)
        examples = eval_splits(splits, data.max_eval_samples)
    writer = {"ner": write_ner, "classification": write_classification, "summarization": write_summarization}[task]
    if task == "ner":
        writer = functools.partial(write_ner, scheme=data.tag_scheme)
    results = {"baseline": args.baseline, "train_samples": len(train)}
    fitted = None
    if args.baseline == "tfidf_lr":
        fitted, results["tfidf_lr_C"] = tfidf_lr_tuned(train, examples.get("validation", []))
    for split, prefix in (("validation", "eval"), ("test", "test")):
        if split not in examples:
            continue
        path = out / (evidence.PREDICTION_FILES[task] if split == "test" else f"{split}_predictions.tmp")
        writer(path, examples[split], predict(args, task, train, examples[split], fitted))
        rows = evidence.example_rows(task, out) if split == "test" else _rows_of(task, path)
        for name in METRICS[task]:
            results[f"{prefix}_{name}"] = evidence.corpus_metric(task, name, rows)
        results[f"{prefix}_samples"] = len(examples[split])
        if split != "test":
            path.unlink()
    write_json_atomic(out / "all_results.json", results)
    print(json.dumps(results, indent=2))


def _rows_of(task: str, path: Path):
    if task == "ner":
        return evidence.ner_rows(path)
    if task == "classification":
        return evidence.classification_rows(path)[0]
    return evidence.summarization_rows(path)


if __name__ == "__main__":
    run_recipe(main)
