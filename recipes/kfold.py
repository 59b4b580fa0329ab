"""K-fold ensembles: train K fold models, pool their out-of-fold predictions, ensemble them on the test data.

    python recipes/kfold.py --recipe ner --folds 5 --output_dir outputs/kfold_ner
    python recipes/kfold.py --recipe classification --folds 5 --jobs 2 --output_dir outputs/kfold_cls -- \\
        --train_file train.csv --test_file test.csv
    python recipes/kfold.py --recipe ner --folds 5 --unlabeled_file raw.txt --pseudo_label_rounds 1 \\
        --distill true --output_dir outputs/kfold_ner_pl -- --train_file train.conll --test_file test.conll

The recipe's training split (the demo's, or ``--train_file``; flags after ``--`` are the recipe's) is cut into K
folds once (``--split_seed``; stratified by label for classification): every example is held out exactly once.
Fold k is a normal run of the recipe (``python recipes/<recipe>.py``) in ``DIR/fold{k}/`` that trains on the other
folds, validates on its held-out fold and predicts the test split (the recipe's: the demo's, or ``--test_file``).
Then, in ``DIR``:

- ``oof_predictions.*``: every training example, in training order, predicted by the fold model that did not see
  it, in the recipe's predictions format (classification also ``oof_probabilities.npy``); ``folds.json`` says which
  fold held out which example.
- ``test_predictions.*``: the ensemble's predictions (``nlp_tricks.ensemble``: the mean of the folds' probabilities;
  NER by word, with a CRF the mean emissions and scores decoded once by Viterbi, with a span head
  (``--span_head`` after ``--``) the mean word-level span scores decoded once, flat or nested as the folds were
  trained; or ``--ensemble_vote T``), and for classification ``test_probabilities.npy`` (float32, one row per test
  example in file order, columns in the order of ``fold0/config.json``'s ``id2label``) here and in every
  ``fold{k}/``.
- ``all_results.json``: ``oof_<metric>``, ``test_<metric>``, ``fold_test_<metric>`` (one per fold) and
  ``fold_test_<metric>_mean``, each recomputed from the predictions files written, and the wall times.
- ``kfold_ensemble.json``: the manifest that makes ``DIR`` an ensemble the recipes predict with
  (``python recipes/ner.py --model_name_or_path DIR --do_train false --test_file new.conll``).

Pseudo-labels (``--unlabeled_file F``): in round r + 1, fold k trains on its own training part plus F labelled by
fold model k of round r, which never saw fold k's held-out part, so ``oof_<metric>`` stays an honest estimate. Round
r < R is kept whole in ``DIR/round{r}/`` (an ensemble folder too); ``DIR`` is the last round. ``--distill true``
trains one student on all the training data (and F) against the ensemble's soft targets (``teacher_logits``) in
``DIR/student/``: ``student_test_<metric>``, at the inference cost of one model.

Runs (``recipes/sweep.py``, the ablation's executor): ``--jobs N`` folds at a time, each in its own process with its
share of the cores (``OMP_NUM_THREADS``) and, with GPUs visible, its own GPU (``CUDA_VISIBLE_DEVICES``,
``--gpus_per_run``); ``--backend ray`` trains each fold as a Ray task on a cluster (``--ray_address``; the output
folder on storage every node sees), while this process cuts the folds, predicts and trains the student. A fold that
finished with the same flags and data is not rerun, so an interrupted run resumes where it stopped. See
docs/recipes.md, "K-fold ensembles", and docs/evidence.md, "Sweeps on a cluster".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from nlp_tricks.data import DataError, check_labels, kfold_assignment, label_list

import sweep
from ablation import multi_label_requested
from ensemble_folder import (
    TASKS,
    EnsembleTask,
    MemberOutput,
    NerSpanEnsembleTask,
    predict_members,
    prediction_args,
    rescore,
    write_manifest,
)

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


# ---- Jobs ---------------------------------------------------------------------------------------------------------


class FoldJob(NamedTuple):
    """One fold's training run: ``python script --output_dir run_dir <flags>`` in the environment ``env`` (None:
    this process's; the executor adds the run's threads and GPUs)."""

    round: int
    fold: int
    script: str
    run_dir: Path
    flags: list[str]
    env: dict | None = None


class FoldFailed(RuntimeError):
    """A fold's run ended without results (its folder holds its log)."""


def run_fold(job: FoldJob) -> dict:
    """Run one fold (unless it finished with these flags: ``sweep.run_one``); its record. A plain function of a
    :class:`FoldJob`: the local executor's way to run a job, replaced by tests that run folds in this process."""
    return sweep.run_one(job.script, job.run_dir, job.flags, env=job.env, label="kfold")


def share_of_cores(jobs: int) -> int:
    """A fold's threads when ``OMP_NUM_THREADS`` is not set: the cores shared out among the folds at a time."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // jobs)


def train_runtime(folder: Path) -> float | None:
    """The Trainer's own training time (``train_runtime``, its last log entry) of the run saved in ``folder``."""
    state = folder / "trainer_state.json"
    if not state.is_file():
        return None
    logged = [e["train_runtime"] for e in json.loads(state.read_text()).get("log_history", []) if "train_runtime" in e]
    return logged[-1] if logged else None


def invalidate(run_dir: Path) -> None:
    """Forget that the run in ``run_dir`` finished (its data changed): it runs again."""
    (run_dir / "ablation_run.json").unlink(missing_ok=True)


# ---- The k-fold run -----------------------------------------------------------------------------------------------


class KFold:
    """One k-fold run: its folds, files and rounds (see the module docstring). ``executor`` (``recipes/sweep.py``)
    runs the fold jobs; by default the local one, each job run by ``run``."""

    def __init__(self, args, task: EnsembleTask, recipe_flags: list[str], run=run_fold, executor=None):
        self.args = args
        self.task = task
        self.out = Path(args.output_dir)
        self.data_dir = self.out / "data"
        self.executor = executor or sweep.LocalExecutor(args.jobs, default_threads=share_of_cores, run=run)
        self.fold_flags = strip_flags(recipe_flags, RUNNER_FLAGS)
        self.rounds = args.pseudo_label_rounds if args.unlabeled_file else 0
        # This process reads the data, predicts and trains the student: --max_time is each fold process's budget.
        self.data_args, self.model_args, self.training_args = task.parse(
            strip_flags(recipe_flags, ("output_dir", "max_time")) + ["--output_dir", str(self.out)]
        )
        if task.name == "ner" and self.training_args.span_head is not None:
            self.task = NerSpanEnsembleTask(self.training_args.span_flat)

    def round_dir(self, r: int) -> Path:
        return self.out if r == self.rounds else self.out / f"round{r}"

    # ---- Setup ----

    def prepare(self) -> None:
        """Read the data, cut the folds, write the files every fold reads; refuse bad input in one line."""
        task, data_args, k = self.task, self.data_args, self.args.folds
        data = read_training_data(task, data_args, self.model_args)
        self.train, self.test, self.labels, self.sources = data["train"], data["test"], data["labels"], data["sources"]
        self.fold_of = cut_folds(task, self.train, k, self.args.split_seed, self.sources["train"])
        if task.name == "ner" and not is_span_task(task):
            bad = [label for label in self.labels if "," in label]
            if bad:
                raise DataError(self.sources["train"], None, f"tag {bad[0]!r} holds a comma, which --tag_names splits")
        self.unlabeled = None
        if self.args.unlabeled_file:
            column = data_args.tokens_column if task.name == "ner" else data_args.text_column
            from nlp_tricks.self_training import read_unlabeled_file

            self.unlabeled = read_unlabeled_file(self.args.unlabeled_file, task.name, column)
        self.heldout = [[i for i, f in enumerate(self.fold_of) if f == fold] for fold in range(k)]
        records = [example_record(task, ex, data_args, i) for i, ex in enumerate(self.train)]
        self.records = records
        write_if_changed(self.data_dir / "train.jsonl", jsonl_text(records))
        self.test_changed = False
        if self.test is not None:
            test_records = [example_record(task, ex, data_args, f"test{i}") for i, ex in enumerate(self.test)]
            self.test_changed = write_if_changed(self.data_dir / "test.jsonl", jsonl_text(test_records))
        # A fold whose held-out part changed is run again too: its eval_ numbers score that part.
        self.heldout_changed = [
            write_if_changed(
                self.data_dir / f"fold{fold}_heldout.jsonl", jsonl_text([records[i] for i in self.heldout[fold]])
            )
            for fold in range(k)
        ]
        from common import write_json_atomic

        write_json_atomic(
            self.out / "folds.json",
            {
                "folds": k,
                "split_seed": self.args.split_seed,
                "stratified": task.name == "classification",
                "examples": len(self.train),
                "fold_of_example": self.fold_of,
            },
        )

    def data_flags(self, train_file: Path, fold: int) -> list[str]:
        flags = [
            "--train_file",
            str(train_file),
            "--validation_file",
            str(self.data_dir / f"fold{fold}_heldout.jsonl"),
        ]
        if self.test is not None:
            flags += ["--test_file", str(self.data_dir / "test.jsonl")]
        if is_span_task(self.task):
            flags += ["--entity_types", *self.labels]
        elif self.task.name == "ner":
            flags += ["--tag_names", *self.labels]
        return flags

    def fold_job(self, r: int, fold: int, pseudo: list[dict]) -> FoldJob:
        """Fold ``fold`` of round ``r``: its training part (plus ``pseudo``, JSON-lines records) written to its own
        file; a changed file (or test file) means the fold runs again."""
        own = [self.records[i] for i in range(len(self.train)) if self.fold_of[i] != fold]
        name = f"fold{fold}_train.jsonl" if r == 0 else f"round{r}_fold{fold}_train.jsonl"
        train_file = self.data_dir / name
        run_dir = self.round_dir(r) / f"fold{fold}"
        changed = write_if_changed(train_file, jsonl_text(own + pseudo))
        if changed or self.test_changed or self.heldout_changed[fold]:
            invalidate(run_dir)
        recipe_file = str(Path(self.task.recipe.__file__).resolve())
        return FoldJob(r, fold, recipe_file, run_dir, self.fold_flags + self.data_flags(train_file, fold))

    # ---- One round ----

    def predict_round(self, r: int, with_unlabeled: bool) -> dict:
        """Every fold model of round ``r`` on its held-out part, the test split and (``with_unlabeled``) F."""
        task, start = self.task, time.perf_counter()
        outputs, seconds = [], {"heldout": 0.0, "test": 0.0, "unlabeled": 0.0}
        args = prediction_args(self.training_args, self.round_dir(r))
        for fold in range(self.args.folds):
            splits = {"heldout": [self.train[i] for i in self.heldout[fold]]}
            if self.test is not None:
                splits["test"] = self.test
            if with_unlabeled:
                splits["unlabeled"] = self.unlabeled
            member = predict_members(
                task,
                [self.round_dir(r) / f"fold{fold}"],
                splits,
                self.labels,
                self.data_args,
                self.model_args,
                args,
                seconds=seconds,
            )
            outputs.append({split: outs[0] for split, outs in member.items()})
        return {"outputs": outputs, "seconds": seconds, "elapsed": time.perf_counter() - start}

    def write_round(self, r: int, records: list[dict], predicted: dict, pseudo_stats: list[dict] | None) -> dict:
        """The round's OOF and ensemble files and its manifest; its results (``all_results.json`` is written by
        the caller, last)."""
        task, labels, folder, k = self.task, self.labels, self.round_dir(r), self.args.folds
        outputs = predicted["outputs"]
        suffix = Path(task.predictions_file).suffix
        oof = [None] * len(self.train)
        for fold in range(k):
            for i, prediction in zip(self.heldout[fold], task.member_predictions(outputs[fold]["heldout"], labels)):
                oof[i] = prediction
        task.write(folder / f"oof_predictions{suffix}", self.train, oof, self.data_args)
        results = {
            f"oof_{key}": value
            for key, value in self._main(rescore(task, folder / f"oof_predictions{suffix}", labels)).items()
        }
        if task.name == "classification":
            probabilities = np.zeros((len(self.train), len(labels)), dtype=np.float32)
            for fold in range(k):
                probabilities[self.heldout[fold]] = task.probabilities([outputs[fold]["heldout"]])
            np.save(folder / "oof_probabilities.npy", probabilities)
        if self.test is not None:
            test_outputs = [o["test"] for o in outputs]
            predictions = task.combine(test_outputs, labels, self.args.ensemble_vote)
            task.write(folder / task.predictions_file, self.test, predictions, self.data_args)
            if task.name == "classification":
                np.save(folder / "test_probabilities.npy", task.probabilities(test_outputs))
                for fold in range(k):
                    np.save(
                        folder / f"fold{fold}" / "test_probabilities.npy", task.probabilities([test_outputs[fold]])
                    )
            results.update(
                {
                    f"test_{key}": v
                    for key, v in self._main(rescore(task, folder / task.predictions_file, labels)).items()
                }
            )
            per_fold = [
                self._main(rescore(task, folder / f"fold{f}" / task.predictions_file, labels)) for f in range(k)
            ]
            for key in task.metrics:
                values = [scores[key] for scores in per_fold]
                results[f"fold_test_{key}"] = values
                results[f"fold_test_{key}_mean"] = float(np.mean(values))
            results["test_samples"] = len(self.test)
        write_manifest(folder, task.name, [f"fold{f}" for f in range(k)], labels, self.args.ensemble_vote)
        results.update(
            {
                "round": r,
                "folds": k,
                "split_seed": self.args.split_seed,
                "stratified": task.name == "classification",
                "ensemble_rule": self.rule(outputs),
                "oof_samples": len(self.train),
                "label_list": labels,
                "data_files": self.sources,
                # Whole fold processes (loading included), and their Trainer's training loops alone.
                "fold_train_seconds": [record["wall_seconds"] for record in records],
                "fold_train_runtime": [record["results"].get("train_runtime") for record in records],
                "train_runtime": float(sum(record["results"].get("train_runtime") or 0.0 for record in records)),
                "train_seconds": float(sum(record["wall_seconds"] for record in records)),
                "predict_seconds": predicted["elapsed"],
                "test_predict_seconds": predicted["seconds"]["test"],
            }
        )
        if pseudo_stats is not None:
            results["pseudo_labels"] = pseudo_stats
        return results

    def _main(self, scores: dict) -> dict:
        return {key: scores[key] for key in self.task.metrics}

    def rule(self, outputs: list[dict]) -> str:
        if self.task.name == "classification":
            return "mean of the folds' probabilities"
        if self.args.ensemble_vote is not None:
            return f"entity vote: kept by at least {self.args.ensemble_vote:g} of the folds"
        if is_span_task(self.task):
            decoding = "flat: the non-overlapping spans of highest total" if self.task.flat else "nested"
            return f"mean of the folds' span scores (word-level), decoded once ({decoding}, mean score > 0)"
        first = next(iter(outputs[0].values()))
        if first.potentials is not None:
            return "CRF: mean word emissions and mean start / transition / end scores, one Viterbi decoding"
        return "mean of the folds' word probabilities (first sub-tokens)"

    # ---- Pseudo-labels ----

    def pseudo_labels(self, r: int, predicted: dict) -> tuple[list[list[dict]], list[dict]]:
        """For round ``r + 1``: per fold k, F labelled by fold model k of round ``r`` (never a model that saw fold
        k's held-out part), as JSON-lines records, with a provenance file each; and the counts."""
        from nlp_tricks.ensemble import crf_with_scores
        from nlp_tricks.self_training import classification_pseudo_labels, ner_pseudo_labels

        task, threshold = self.task, self.args.confidence_threshold
        self_training_task = task.recipe.NER_TASK if task.name == "ner" else task.recipe.CLASSIFICATION_TASK
        per_fold, stats = [], []
        for fold in range(self.args.folds):
            output: MemberOutput = predicted["outputs"][fold]["unlabeled"]
            if is_span_task(task):
                records = self.span_pseudo_labels(output)
                per_fold.append(records)
                stats.append(self.pseudo_label_stat(r, fold, len(records)))
                continue
            if task.name == "ner":
                rows = [np.flatnonzero(~np.isnan(w).any(axis=-1)) for w in output.word_logits]
                crf = crf_with_scores(*output.potentials) if output.potentials is not None else None
                pseudo = ner_pseudo_labels(
                    [w[seen] for w, seen in zip(output.word_logits, rows)], [s.tolist() for s in rows], threshold, crf
                )
            else:
                pseudo = classification_pseudo_labels(list(output.logits), threshold)
            examples = self_training_task.pseudo_examples(self.unlabeled, pseudo, self.labels)
            records = [
                example_record(task, ex, self.data_args, f"unlabeled{i}") for i, ex in zip(pseudo.indices, examples)
            ]
            per_fold.append(records)
            stats.append(self.pseudo_label_stat(r, fold, len(records)))
        return per_fold, stats

    def pseudo_label_stat(self, r: int, fold: int, kept: int) -> dict:
        """The provenance file of fold ``fold``'s pseudo-labels for round ``r + 1`` (written), and its record."""
        from common import write_json_atomic

        teacher = self.round_dir(r) / f"fold{fold}"
        stat = {
            "fold": fold,
            "teacher": str(teacher.relative_to(self.out)),
            "teacher_round": r,
            "teacher_fold": fold,
            "unlabeled": len(self.unlabeled),
            "kept": kept,
            "confidence_threshold": self.args.confidence_threshold,
            "unlabeled_file": str(self.args.unlabeled_file),
        }
        write_json_atomic(self.data_dir / f"round{r + 1}_fold{fold}_pseudo_labels.json", stat)
        return stat

    def span_pseudo_labels(self, output: MemberOutput) -> list[dict]:
        """F labelled by one span model: each sentence with the entities it decodes alone (flat or nested, as it
        was trained), cut after the last word it saw (truncation cut the rest); a sentence it saw no word of is
        left out."""
        records = []
        spans = self.task.member_predictions(output, self.labels)
        for i, (ex, scores, found) in enumerate(zip(self.unlabeled, output.span_scores, spans)):
            seen = np.flatnonzero(~np.isnan(np.diagonal(scores, axis1=1, axis2=2)).any(axis=0))
            if not len(seen):
                continue
            n = int(seen[-1]) + 1
            example = {
                "tokens": ex["tokens"][:n],
                "entities": [{"type": t, "start": a, "end": b} for t, a, b in found],
            }
            records.append(example_record(self.task, example, self.data_args, f"unlabeled{i}"))
        return records

    # ---- The student ----

    def train_student(self, predicted: dict) -> dict:
        """One student on every training example (soft target: the out-of-fold one, from the fold model that did
        not see it) and F (soft target: the ensemble's; hard label: its prediction), distilled through
        ``teacher_logits``; its test predictions and ``all_results.json`` in ``DIR/student``."""
        from datasets import Dataset

        import self_training
        from common import prepare_output_dir, resolve_model_path, write_json_atomic

        task, labels, folder = self.task, self.labels, self.out / "student"
        outputs = predicted["outputs"]
        soft: list = [None] * len(self.train)
        for fold in range(self.args.folds):
            for i, target in zip(self.heldout[fold], task.soft_targets([outputs[fold]["heldout"]])):
                soft[i] = target
        examples = [dict(ex) for ex in self.train]
        if self.unlabeled is not None:
            unlabeled_outputs = [o["unlabeled"] for o in outputs]
            hard = task.combine(unlabeled_outputs, labels, self.args.ensemble_vote)
            for ex, prediction, target in zip(self.unlabeled, hard, task.soft_targets(unlabeled_outputs)):
                if task.name == "ner":
                    seen = np.flatnonzero(~np.isnan(target).any(axis=-1))
                    if not len(seen):
                        continue
                    n = int(seen[-1]) + 1  # words past the last one seen were cut: the student is not taught them
                    examples.append({"tokens": ex["tokens"][:n], "ner_tags": prediction[:n]})
                    soft.append(target[:n])
                else:
                    examples.append({"text": ex["text"], "label": prediction})
                    soft.append(target)
        teacher = [np.log(np.clip(np.asarray(t, dtype=np.float64), 1e-30, None)).astype(np.float32) for t in soft]
        fingerprint = hashlib.sha256(
            json.dumps([self.student_flags, [ex.get("tokens", ex.get("text")) for ex in examples]]).encode()
            + b"".join(np.nan_to_num(t, nan=-1.0).tobytes() for t in teacher)
        ).hexdigest()
        record_path = folder / "kfold_student.json"
        if (folder / "all_results.json").is_file() and record_path.is_file():
            if json.loads(record_path.read_text()).get("fingerprint") == fingerprint:
                return json.loads((folder / "all_results.json").read_text())
        data_args, model_args, training_args = self.task.parse(self.student_flags)
        prepare_output_dir(folder, True)
        self_training_task = task.recipe.NER_TASK if task.name == "ner" else task.recipe.CLASSIFICATION_TASK
        label2id = {label: i for i, label in enumerate(labels)}
        start = time.perf_counter()
        model, tokenizer = self_training.build_model(
            self_training_task,
            resolve_model_path(model_args.model_name_or_path),
            model_args,
            labels,
            training_args.seed,
        )
        dataset = self_training_task.tokenize(examples, tokenizer, label2id, data_args, train=True)
        column = self_training_task.teacher_logits(examples, teacher, dataset, tokenizer, label2id, data_args)
        dataset = Dataset.from_dict({**dataset.to_dict(), "teacher_logits": [c.tolist() for c in column]})
        model, _, metrics = self_training.train_and_evaluate(
            self_training_task, model, tokenizer, dataset, {}, training_args, folder
        )
        train_seconds = time.perf_counter() - start
        results = {
            "train_loss": metrics.get("train_loss"),
            "train_samples": len(dataset),
            "train_seconds": train_seconds,
            "train_runtime": train_runtime(folder),
            "distill_temperature": training_args.distill_temperature,
            "distill_alpha": training_args.distill_alpha,
            "soft_targets": "training examples: out-of-fold; unlabelled: the ensemble's",
            "label_list": labels,
        }
        if self.test is not None:
            start = time.perf_counter()
            output = task.predict(
                model, tokenizer, self.test, labels, data_args, prediction_args(training_args, folder)
            )
            results["test_predict_seconds"] = time.perf_counter() - start
            predictions = task.member_predictions(output, labels)
            task.write(folder / task.predictions_file, self.test, predictions, data_args)
            if task.name == "classification":
                np.save(folder / "test_probabilities.npy", task.probabilities([output]))
            results.update(
                {f"test_{k}": v for k, v in self._main(rescore(task, folder / task.predictions_file, labels)).items()}
            )
            results["test_samples"] = len(self.test)
        write_json_atomic(folder / "all_results.json", results)
        write_json_atomic(record_path, {"fingerprint": fingerprint})
        return results

    @property
    def student_flags(self) -> list[str]:
        flags = strip_flags(self.fold_flags, ("crf", "crf_bio_constraints", "crf_lr_scale", "max_time"))
        flags += ["--train_file", str(self.data_dir / "train.jsonl"), "--output_dir", str(self.out / "student")]
        flags += ["--eval_strategy", "no"]  # no validation data: the student is scored once, on test
        if self.test is not None:
            flags += ["--test_file", str(self.data_dir / "test.jsonl")]
        if self.task.name == "ner":
            # teacher_logits are per token; the CRF scores whole paths, so the student trains without it.
            flags += ["--tag_names", *self.labels, "--crf", "false"]
        return flags

    # ---- All of it ----

    def run_all(self) -> dict:
        """Every round, then the student; ``DIR/all_results.json`` last. Returns it."""
        from common import write_json_atomic

        self.prepare()
        # What an earlier run left that would look like this run's results (or a usable ensemble) goes first.
        for r in range(self.rounds + 1):
            for name in ("all_results.json", "kfold_ensemble.json"):
                (self.round_dir(r) / name).unlink(missing_ok=True)
        if self.args.distill:
            self.task.parse(self.student_flags)  # the student's flags are checked before any fold trains
        pseudo: list[list[dict]] = [[] for _ in range(self.args.folds)]
        pseudo_stats, earlier = None, []
        for r in range(self.rounds + 1):
            jobs = [self.fold_job(r, fold, pseudo[fold]) for fold in range(self.args.folds)]
            print(f"[kfold] round {r}: {len(jobs)} folds, {self.executor.describe()}", flush=True)
            metric = getattr(self.task.recipe, "MAIN_METRIC", None)
            outcomes = self.executor.run(jobs, self.round_dir(r), metric, label=f"kfold round {r}")
            if any(outcome.record is None for outcome in outcomes):  # the run's exit status and the end of its log
                raise FoldFailed(sweep.failure_report(outcomes, self.round_dir(r)))
            sweep.forget_failures(self.round_dir(r))
            records = [outcome.record for outcome in outcomes]
            last = r == self.rounds
            predicted = self.predict_round(r, self.unlabeled is not None and (not last or self.args.distill))
            results = self.write_round(r, records, predicted, pseudo_stats)
            if not last:
                write_json_atomic(self.round_dir(r) / "all_results.json", results)
                earlier.append({k: v for k, v in results.items() if isinstance(v, int | float | str)})
                pseudo, pseudo_stats = self.pseudo_labels(r, predicted)
        if earlier:
            results["rounds"] = earlier
        if self.args.distill:
            student = self.train_student(predicted)
            results.update(
                {f"student_{k}": v for k, v in student.items() if k.startswith("test_") or k.startswith("train_")}
            )
        write_json_atomic(self.out / "all_results.json", results)
        return results


def main(argv: list[str] | None = None, run=run_fold) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python recipes/kfold.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", required=True, choices=list(TASKS), help="the recipe each fold runs")
    parser.add_argument("--folds", type=int, required=True, help="K >= 2: how many folds (and fold models)")
    parser.add_argument("--output_dir", required=True, help="where fold{k}/, the ensemble's files and results go")
    parser.add_argument("--split_seed", type=int, default=42, help="seed of the shuffle that cuts the folds")
    parser.add_argument(
        "--ensemble_vote",
        type=float,
        default=None,
        help="NER: combine the folds by entity vote instead of averaging: an entity is kept when at least this "
        "share in (0, 1] of the folds predict it (0.5: half of them)",
    )
    parser.add_argument(
        "--unlabeled_file",
        default=None,
        help="unlabelled data for pseudo-labels (the self-training recipe's formats: NER .txt one sentence a line, "
        "JSON lines, or CoNLL words; classification CSV / JSON lines with --text_column)",
    )
    parser.add_argument(
        "--confidence_threshold",
        type=float,
        default=0.0,
        help="pseudo-labels below this confidence in [0, 1] are dropped (a text's largest softmax probability, a "
        "sentence's smallest over its words); 0 keeps all",
    )
    parser.add_argument(
        "--pseudo_label_rounds",
        type=int,
        default=1,
        help="with --unlabeled_file: rounds of fold-wise pseudo-labels after the first training (>= 1)",
    )
    parser.add_argument(
        "--distill",
        default="false",
        choices=["true", "false"],
        help="true: also train one student on all the training data (and --unlabeled_file) against the ensemble's "
        "soft targets, in DIR/student/",
    )
    sweep.add_arguments(parser, what="folds")
    args = parser.parse_args(argv)
    args.distill = args.distill == "true"
    if args.folds < 2:
        parser.error(f"--folds {args.folds}: it must be >= 2")
    problem = sweep.check_arguments(args)
    if problem:
        parser.error(problem)
    if args.ensemble_vote is not None and not 0.0 < args.ensemble_vote <= 1.0:
        parser.error(f"--ensemble_vote {args.ensemble_vote}: it must be in (0, 1]")
    if args.ensemble_vote is not None and args.recipe != "ner":
        parser.error("--ensemble_vote: entity voting is for --recipe ner")
    if not 0.0 <= args.confidence_threshold <= 1.0:
        parser.error(f"--confidence_threshold {args.confidence_threshold}: it must be in [0, 1]")
    if args.pseudo_label_rounds < 1:
        parser.error(f"--pseudo_label_rounds {args.pseudo_label_rounds}: it must be >= 1")
    if recipe_flags and recipe_flags[0].endswith((".yaml", ".yml", ".json")) and not recipe_flags[0].startswith("-"):
        parser.error(f"{recipe_flags[0]}: give the recipe's flags after --, not a config file")
    given = given_flags(recipe_flags)
    for name, why in REFUSED_FLAGS.items():
        if name in given:
            parser.error(f"--{name} after --: {why}")
    if args.recipe == "classification" and multi_label_requested(recipe_flags):
        parser.error("--multi_label: k-fold ensembles here are single-label (stratified folds, mean probabilities)")
    if args.unlabeled_file and "text_pair_column" in given:
        parser.error("--unlabeled_file: pseudo-labels are for one text per example (no --text_pair_column)")
    if args.distill and "class_weights" in given:
        parser.error(
            "--distill true: the student learns soft targets (teacher_logits), which --class_weights do not weigh"
        )

    try:
        with sweep.make_executor(args, default_threads=share_of_cores, run=run) as executor:
            kfold = KFold(args, TASKS[args.recipe], recipe_flags, executor=executor)
            if kfold.training_args.do_train is False:
                parser.error("--do_train false after --: every fold trains")
            span_head = kfold.training_args.span_head if args.recipe == "ner" else None
            if span_head is not None and args.distill:
                parser.error(
                    f"--distill true with --span_head {span_head}: a student distils per-token soft targets "
                    "(teacher_logits), which a span head does not take; drop --distill"
                )
            if span_head is not None and args.confidence_threshold > 0:
                parser.error(
                    f"--confidence_threshold {args.confidence_threshold} with --span_head {span_head}: span scores "
                    "are not probabilities, so a span model's pseudo-labels keep every sentence; leave it at 0"
                )
            results = kfold.run_all()
    except (DataError, FoldFailed, sweep.SweepError) as err:
        print(f"kfold: {err}", file=sys.stderr)
        return 1
    metric = getattr(TASKS[args.recipe].recipe, "MAIN_METRIC", "f1")
    summary = {
        k: v
        for k, v in results.items()
        if k in (f"oof_{metric}", f"test_{metric}", f"fold_test_{metric}_mean", f"student_test_{metric}")
    }
    print("[kfold] " + ", ".join(f"{k} {v:.4f}" for k, v in summary.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
