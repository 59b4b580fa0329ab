"""The k-fold runner's data: the recipe flags it takes after ``--`` (those it sets for each fold itself, those it
refuses), the training and test splits read as the recipe reads them, the folds cut, and the JSON-lines files every
fold reads (written only when they change, so a finished fold is not rerun)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from nlp_tricks.data import DataError, check_labels, kfold_assignment, label_list

from ensemble_folder import EnsembleTask, NerSpanEnsembleTask

# The recipe flags the runner sets for every fold (its data files, its folder): given after --, they only choose
# the data the runner reads, and are not passed on.
RUNNER_FLAGS = (
    "output_dir",
    "overwrite_output_dir",
    "train_file",
    "validation_file",
    "test_file",
    "dataset_name",
    "dataset_config_name",
    "max_train_samples",
    "max_eval_samples",
    "split_seed",
    "tag_names",
    "tag_scheme",
    "entity_types",
)


# Recipe flags that contradict a k-fold run.
REFUSED_FLAGS = {
    "num_folds": "the runner cuts the folds (--folds)",
    "fold": "the runner runs every fold (--folds)",
    "resume_from_checkpoint": "a fold that did not finish is run again from its start",
}


# ---- Flags --------------------------------------------------------------------------------------------------------


def flag_name(arg: str) -> str | None:
    """``--max_steps`` / ``--max_steps=2`` / ``--max-steps`` -> ``max_steps``; None for a value."""
    if not arg.startswith("--") or len(arg) == 2:
        return None
    return arg[2:].split("=", 1)[0].replace("-", "_")


def given_flags(flags: list[str]) -> set[str]:
    return {name for name in map(flag_name, flags) if name}


def strip_flags(flags: list[str], names) -> list[str]:
    """``flags`` without the named flags and their values (``--flag v``, ``--flag v1 v2``, ``--flag=v``)."""
    out, i = [], 0
    while i < len(flags):
        name = flag_name(flags[i])
        if name in names:
            i += 1
            if "=" not in flags[i - 1]:
                while i < len(flags) and flag_name(flags[i]) is None:
                    i += 1
            continue
        out.append(flags[i])
        i += 1
    return out


# ---- Data ---------------------------------------------------------------------------------------------------------


def is_span_task(task: EnsembleTask) -> bool:
    return isinstance(task, NerSpanEnsembleTask)


def read_training_data(task: EnsembleTask, data_args, model_args=None) -> dict:
    """The recipe's training split and test split as lists, and the label list every fold uses: NER's from the
    whole training split (passed to each fold as ``--tag_names``; a span head's entity types as
    ``--entity_types``), classification's from the training examples (stratified folds give every fold each of
    them); a test label outside it is a ``file:line`` error here."""
    recipe = task.recipe
    if is_span_task(task):
        # The types of a saved span model, or --entity_types, or the whole training split's: --entity_types of
        # every fold, so a fold whose training part lacks a type still has it.
        types, known_from = recipe.span_types(data_args, model_args)
        splits, labels, train_examples, eval_examples = recipe.read_span_data(data_args, types, known_from)
    else:
        splits, labels, train_examples, eval_examples = recipe.read_data(data_args)
    train = [dict(ex) for ex in train_examples]
    test = [dict(ex) for ex in eval_examples["test"]] if "test" in eval_examples else None
    if task.name == "classification":
        labels = label_list(train, "label")
        if test:
            check_labels(test, "label", labels, splits["test"][1])
    return {
        "train": train,
        "test": test,
        "labels": labels,
        "sources": {split: source for split, (_, source) in splits.items() if split in ("train", "test")},
    }


def cut_folds(task: EnsembleTask, examples: list[dict], k: int, seed: int, source, context: str = "") -> list[int]:
    """The fold of each example (stratified by label for classification); a cut the examples do not allow is one
    ``DataError`` naming ``source`` and ``--folds`` (after ``context``, what the caller says of the examples)."""
    stratify = [ex["label"] for ex in examples] if task.name == "classification" else None
    try:
        return kfold_assignment(len(examples), k, seed, stratify)
    except ValueError as err:
        raise DataError(source, None, f"{context}--folds {k}: {err}") from None


def example_record(task: EnsembleTask, ex: dict, data_args, example_id) -> dict:
    """One example as a JSON-lines record the recipe reads with the user's column flags, with its ``id``."""
    if is_span_task(task):  # the span recipe's nested JSON lines: word indices, end exclusive
        entities = [{"start": e["start"], "end": e["end"], "type": e["type"]} for e in ex["entities"]]
        return {"id": example_id, data_args.tokens_column: ex["tokens"], "entities": entities}
    if task.name == "ner":
        return {"id": example_id, data_args.tokens_column: ex["tokens"], data_args.tags_column: ex["ner_tags"]}
    record = {"id": example_id, data_args.text_column: ex["text"], data_args.label_column: ex["label"]}
    if "text_pair" in ex:
        record[data_args.text_pair_column] = ex["text_pair"]
    return record


def jsonl_text(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` (atomically) unless it holds it already; whether it changed."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return True
