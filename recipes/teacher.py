"""A teacher's soft targets for distillation (``--teacher DIR`` of recipes/classification.py, recipes/ner.py and
recipes/kfold.py ``--distill true``): the ``teacher_logits`` the student learns through ``TricksTrainer``'s
distillation (``--distill_temperature``, ``--distill_alpha``).

The teacher is any model folder, ensemble folder (``kfold_ensemble.json``) or k-fold run (``folds.json`` too), over
the student's labels (in any order), of any architecture and tokenizer: it reads the words or texts with its own
tokenizer, and its targets are per text (classification: its probabilities) or per word (NER: each word's tag
distribution from its first sub-token, as the ensembles combine members: a CRF teacher's marginals). For a k-fold run,
a training row the run trained on gets its out-of-fold target: the fold model that held it out (the others saw it,
and would mostly repeat its label); any other row gets the whole ensemble's. Rows are matched to the run's training
rows by their text (classification: text and pair; NER: the words); a text the run holds twice, in two folds, has no
unseen model and takes the first one's fold.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nlp_tricks.data import DataError

from ensemble_folder import MANIFEST, TASKS, predict_members, prediction_args, read_manifest


def _teacher_members(path: Path, recipe: str) -> tuple[str, list[Path], list[str]]:
    """``(kind, member folders, labels)``: a k-fold run, an ensemble folder or one model folder."""
    if (path / MANIFEST).is_file():
        manifest = read_manifest(path, recipe)
        kind = "kfold" if (path / "folds.json").is_file() else "ensemble"
        return kind, [path / m for m in manifest["members"]], list(manifest["labels"])
    config = path / "config.json"
    if not config.is_file():
        raise DataError(None, None, f"--teacher {path}: neither a model folder (config.json) nor an ensemble folder")
    saved = json.loads(config.read_text(encoding="utf-8")).get("id2label") or {}
    if json.loads(config.read_text(encoding="utf-8")).get("span_head") is not None:
        raise DataError(config, None, "--teacher: a span head scores spans, not per-word tags; it cannot teach")
    return "model", [path], [saved[key] for key in sorted(saved, key=int)]


def _key(recipe: str, row: dict, keys: dict) -> tuple:
    if recipe == "ner":
        return tuple(row[keys.get("tokens", "tokens")])
    return row[keys.get("text", "text")], row.get(keys.get("text_pair") or "", None)


def _folds_of(path: Path, recipe: str, rows: list[dict]) -> list[int | None]:
    """Per row, the fold of the k-fold run ``path`` that held it out (None: a row the run did not train on)."""
    folds = json.loads((path / "folds.json").read_text(encoding="utf-8"))
    keys = folds.get("record_keys", {})
    records = [json.loads(line) for line in (path / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]  # fmt: skip
    fold_of: dict = {}
    for record, fold in zip(records, folds["fold_of_example"]):
        fold_of.setdefault(_key(recipe, record, keys), fold)
    own = {"tokens": "tokens", "text": "text", "text_pair": "text_pair"}
    return [fold_of.get(_key(recipe, row, own)) for row in rows]


def soft_targets(path: str | Path, recipe: str, rows: list[dict], labels: list[str], data_args, model_args,
                 training_args) -> tuple[list[np.ndarray], dict]:  # fmt: skip
    """Per row, the teacher's probabilities over ``labels`` (classification ``(C,)``; NER ``(W, C)`` per word, NaN
    rows for the words it did not see) and a record of where they came from (``teacher_rows``: how many rows each
    member set labelled)."""
    path = Path(path)
    kind, members, teacher_labels = _teacher_members(path, recipe)
    if sorted(teacher_labels) != sorted(labels):
        raise DataError(path, None, f"--teacher: its labels {teacher_labels} are not the student's {list(labels)}")
    columns = [teacher_labels.index(label) for label in labels]
    task = TASKS[recipe]
    groups = _folds_of(path, recipe, rows) if kind == "kfold" else [None] * len(rows)
    plain = [{"tokens": r["tokens"]} if recipe == "ner" else {k: r[k] for k in ("text", "text_pair") if k in r}
             for r in rows]  # fmt: skip
    targets: list = [None] * len(rows)
    counts = {}
    args = prediction_args(training_args, training_args.output_dir)
    for group in sorted(set(groups), key=lambda g: -1 if g is None else g):
        index = [i for i, g in enumerate(groups) if g == group]
        chosen = members if group is None else [members[group]]
        outputs = predict_members(task, chosen, {"rows": [plain[i] for i in index]}, teacher_labels, data_args,
                                  model_args, args)["rows"]  # fmt: skip
        for i, target in zip(index, task.soft_targets(outputs)):
            targets[i] = np.asarray(target, dtype=np.float32)[..., columns]
        counts["ensemble" if group is None else f"fold{group}"] = len(index)
    return targets, {"teacher": str(path), "kind": kind, "teacher_rows": counts}


def check_teacher(data_args, training_args, recipe: str) -> None:
    """What ``--teacher`` does not combine with, in one line naming the flags."""
    teacher = getattr(data_args, "teacher", None)
    if teacher is None:
        return
    if getattr(data_args, "multi_label", False):
        raise DataError(None, None, "--teacher with --multi_label: the soft targets are one distribution per text")
    if getattr(training_args, "span_head", None) is not None:
        raise DataError(None, None, "--teacher with --span_head: a span head takes no per-token teacher_logits")
    if getattr(training_args, "crf", False):
        raise DataError(None, None, "--teacher with --crf: a CRF scores whole tag paths and takes no per-token "
                        "teacher_logits; add --crf false")  # fmt: skip
    if getattr(training_args, "class_weights", None):
        raise DataError(None, None, "--teacher with --class_weights: the soft targets are not weighed by class")


def with_teacher(recipe: str, args: tuple, labels: list[str], train_examples, train_dataset, tokenizer, collator):
    """``(train_dataset, collator)``: with ``--teacher``, each training example carries its ``teacher_logits`` (the
    log of the teacher's probabilities; a word the teacher did not see gets the gold one-hot) and the collator pads
    them; without it, both as they are. ``args``: the recipe's ``(data_args, model_args, training_args)``."""
    data_args, model_args, training_args = args
    if getattr(data_args, "teacher", None) is None:
        return train_dataset, collator
    from datasets import Dataset

    from nlp_tricks.self_training import TeacherLogitsCollator

    check_teacher(data_args, training_args, recipe)
    examples = [dict(ex) for ex in train_examples]
    targets, info = soft_targets(data_args.teacher, recipe, examples, labels, data_args, model_args, training_args)
    print(f"[teacher] {info['teacher']} ({info['kind']}): soft targets of {info['teacher_rows']}", flush=True)
    logits = [np.log(np.clip(t, 1e-30, None)).astype(np.float32) for t in targets]
    task = TASKS[recipe].recipe.NER_TASK if recipe == "ner" else TASKS[recipe].recipe.CLASSIFICATION_TASK
    label2id = {label: i for i, label in enumerate(labels)}
    column = task.teacher_logits(examples, logits, train_dataset, tokenizer, label2id, data_args)
    dataset = Dataset.from_dict({**train_dataset.to_dict(), "teacher_logits": [c.tolist() for c in column]})
    return dataset, TeacherLogitsCollator(collator, tokenizer.padding_side)
