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
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from nlp_tricks.data import DataError

import sweep
from ablation import multi_label_requested
from ensemble_folder import (
    TASKS,
    EnsembleTask,
    NerSpanEnsembleTask,
    predict_members,
    prediction_args,
    rescore,
    write_manifest,
)
from kfold_data import (
    REFUSED_FLAGS,
    RUNNER_FLAGS,
    cut_folds,
    example_record,
    given_flags,
    is_span_task,
    jsonl_text,
    read_training_data,
    strip_flags,
    write_if_changed,
)
from kfold_student import pseudo_labels, student_flags, train_student

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
        if self.task.name == "ner":  # every fold writes its predictions in the training file's tag scheme
            flags += ["--tag_scheme", self.data_args.tag_scheme]
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
            self.task.parse(student_flags(self))  # the student's flags are checked before any fold trains
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
                pseudo, pseudo_stats = pseudo_labels(self, r, predicted)
        if earlier:
            results["rounds"] = earlier
        if self.args.distill:
            student = train_student(self, predicted)
            results.update(
                {f"student_{k}": v for k, v in student.items() if k.startswith("test_") or k.startswith("train_")}
            )
        write_json_atomic(self.out / "all_results.json", results)
        return results


def main(argv: list[str] | None = None, run=run_fold) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = _parser()
    args = parser.parse_args(argv)
    _check_arguments(parser, args, recipe_flags)
    try:
        with sweep.make_executor(args, default_threads=share_of_cores, run=run) as executor:
            kfold = KFold(args, TASKS[args.recipe], recipe_flags, executor=executor)
            _check_recipe_arguments(parser, args, kfold)
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


def _parser() -> argparse.ArgumentParser:
    """The runner's own flags (the recipe's go after ``--``)."""
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
    return parser


def _check_arguments(parser: argparse.ArgumentParser, args, recipe_flags: list[str]) -> None:
    """The runner's flags and the recipe flags it refuses, before anything runs: one line each (exit 2)."""
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


def _check_recipe_arguments(parser: argparse.ArgumentParser, args, kfold: KFold) -> None:
    """What the parsed recipe flags do not combine with (every fold trains; a span head's scores are no
    probabilities and cannot be distilled)."""
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


if __name__ == "__main__":
    sys.exit(main())
