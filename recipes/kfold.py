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

Fair members: every fold model trains for the single model's number of optimizer steps (``--fold_steps match``, the
default; ``epochs``: the recipe's epochs over the fold's data) with its own seed (``kfold_plan.member_seed``), and
with ``--fold_select best`` keeps its checkpoint that scores best on its held-out fold. ``--full_fit_seeds N`` also
trains N models on all the training data (``DIR/full_fit/seed{k}/``; ``DIR/full_fit/`` is their ensemble folder);
``--folds 0`` trains only those. ``--soup {uniform,greedy}`` averages the fold models' weights into one model
(``DIR/soup/``; with ``--folds 0`` the seeds', ``DIR/full_fit/soup/``). ``--fit_rule`` fits decision rules
(per-class bias, per-type thresholds, temperature) on the out-of-fold predictions, stored in
``DIR/decision_rule.json`` and applied when ``DIR`` predicts (``DIR/rule/``: the test split after them).
``--teacher DIR2`` gives the student another teacher.

Runs (``recipes/sweep.py``, the ablation's executor): ``--jobs N`` folds at a time, each in its own process with its
share of the cores (``OMP_NUM_THREADS``) and, with GPUs visible, its own GPU (``CUDA_VISIBLE_DEVICES``,
``--gpus_per_run``); ``--backend ray`` trains each fold as a Ray task on a cluster (``--ray_address``; the output
folder on storage every node sees), while this process cuts the folds, predicts and trains the student. A fold that
finished with the same flags and data is not rerun, so an interrupted run resumes where it stopped. See
docs/recipes.md, "K-fold ensembles", and docs/evidence.md, "Sweeps on a cluster".
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from nlp_tricks.data import DataError

import kfold_args
import sweep
from ensemble_folder import TASKS, EnsembleTask, NerSpanEnsembleTask, predict_members, prediction_args, rescore
from kfold_data import (
    REFUSED_FLAGS,
    RUNNER_FLAGS,
    cut_folds,
    example_record,
    is_span_task,
    jsonl_text,
    read_training_data,
    strip_flags,
    write_if_changed,
)
from kfold_full_fit import run_full_fit
from kfold_outputs import main_scores, write_test_ensemble
from kfold_plan import FoldFailed, FoldJob, best_checkpoint_flags, member_flags, member_seed, training_steps
from kfold_rules import run_rules
from kfold_soup import run_soups
from kfold_student import pseudo_labels, student_flags, train_student

# Names the tests and other runners read here.
__all__ = ["REFUSED_FLAGS", "RUNNER_FLAGS", "FoldFailed", "FoldJob", "KFold", "main", "run_fold", "share_of_cores",
           "strip_flags"]  # fmt: skip

# ---- Jobs ---------------------------------------------------------------------------------------------------------


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
        self.base_seed = self.training_args.seed  # each member's seed derives from it (kfold_plan.member_seed)
        self.recipe_file = Path(self.task.recipe.__file__).resolve()

    def round_dir(self, r: int) -> Path:
        return self.out if r == self.rounds else self.out / f"round{r}"

    # ---- Setup ----

    def prepare(self) -> None:
        """Read the data, cut the folds, write the files every fold reads; refuse bad input in one line."""
        task, data_args, k = self.task, self.data_args, self.args.folds
        data = read_training_data(task, data_args, self.model_args)
        self.train, self.test, self.labels, self.sources = data["train"], data["test"], data["labels"], data["sources"]
        if self.test is None and self.args.full_fit_seeds:
            raise DataError(self.sources["train"], None, "--full_fit_seeds: the seed models are scored on a test "
                            "split; give --test_file after -- (or use the demo's)")  # fmt: skip
        self.fold_of = cut_folds(task, self.train, k, self.args.split_seed, self.sources["train"]) if k else []
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
        self.train_changed = write_if_changed(self.data_dir / "train.jsonl", jsonl_text(records))
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
                # The fields of data/train.jsonl's records that hold an example's text (a teacher matches rows by it).
                "record_keys": {
                    "tokens": getattr(data_args, "tokens_column", None),
                    "text": getattr(data_args, "text_column", None),
                    "text_pair": getattr(data_args, "text_pair_column", None),
                },  # fmt: skip
            },
        )

    def data_flags(self, train_file: Path, fold: int | None) -> list[str]:
        """The data flags of a run on ``train_file``, validated on fold ``fold``'s held-out part (None: nothing)."""
        flags = ["--train_file", str(train_file)]
        if fold is not None:
            flags += ["--validation_file", str(self.data_dir / f"fold{fold}_heldout.jsonl")]
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
        flags = self.member_flags(fold, len(self.train) + len(pseudo)) + self.data_flags(train_file, fold)
        return FoldJob(r, fold, str(self.recipe_file), run_dir, flags)

    def fold_steps(self, examples: int) -> int | None:
        """``--fold_steps match``: the steps the recipe takes on ``examples`` examples (the whole training split,
        plus a round's pseudo-labels), as the single model does; ``epochs``: None (the recipe's own)."""
        return training_steps(self.training_args, examples) if self.args.fold_steps == "match" else None

    def member_flags(self, fold: int, examples: int) -> list[str]:
        """Fold ``fold``'s recipe flags but its data: its seed, its steps, its checkpoint selection."""
        flags = member_flags(self.fold_flags, member_seed(self.base_seed, "fold", fold), self.fold_steps(examples))
        if self.args.fold_select == "best":
            flags += best_checkpoint_flags(self.training_args, getattr(self.task.recipe, "MAIN_METRIC", "f1"))
        return flags

    def run_jobs(self, jobs: list[FoldJob], folder: Path, label: str) -> list[dict]:
        """Run ``jobs`` with the executor (finished ones are skipped); their records, or :class:`FoldFailed` naming
        the failed ones with the end of their logs."""
        metric = getattr(self.task.recipe, "MAIN_METRIC", None)
        outcomes = self.executor.run(jobs, folder, metric, label=label)
        if any(outcome.record is None for outcome in outcomes):  # the run's exit status and the end of its log
            raise FoldFailed(sweep.failure_report(outcomes, folder))
        sweep.forget_failures(folder)
        return [outcome.record for outcome in outcomes]

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

    def write_round(
        self, r: int, records: list[dict], predicted: dict, pseudo: list[list[dict]], pseudo_stats
    ) -> dict:
        """The round's OOF and ensemble files and its manifest; its results (``all_results.json`` is written by
        the caller, last). ``pseudo``: each fold's pseudo-labelled examples of this round."""
        task, labels, folder, k = self.task, self.labels, self.round_dir(r), self.args.folds
        outputs = predicted["outputs"]
        results = self.write_oof(folder, [o["heldout"] for o in outputs])
        if self.test is not None:
            members = [f"fold{f}" for f in range(k)]
            test = write_test_ensemble(task, folder, members, self.test, [o["test"] for o in outputs], labels,
                                       self.data_args, self.args.ensemble_vote)  # fmt: skip
            results.update({key.replace("member_", "fold_"): value for key, value in test.items()})
        else:
            from ensemble_folder import write_manifest

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
                "fold_steps": self.args.fold_steps,
                "fold_max_steps": [self.fold_steps(len(self.train) + len(extra)) for extra in pseudo],
                "fold_seeds": [member_seed(self.base_seed, "fold", f) for f in range(k)],
                "fold_select": self.args.fold_select,
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

    def write_oof(self, folder: Path, heldout: list) -> dict:
        """``oof_predictions.*`` (each training example by the fold model that did not see it), the scores the
        decision rules are fitted on (classification ``oof_probabilities.npy``, NER ``oof_scores.npz``); the
        ``oof_`` metrics (classification also ``oof_nll``)."""
        from kfold_rules import save_oof_scores

        task, labels = self.task, self.labels
        suffix = Path(task.predictions_file).suffix
        oof = [None] * len(self.train)
        for fold, output in enumerate(heldout):
            for i, prediction in zip(self.heldout[fold], task.member_predictions(output, labels)):
                oof[i] = prediction
        task.write(folder / f"oof_predictions{suffix}", self.train, oof, self.data_args)
        scores = main_scores(task, rescore(task, folder / f"oof_predictions{suffix}", labels))
        results = {f"oof_{key}": value for key, value in scores.items()}
        results.update(save_oof_scores(self, folder, heldout))
        return results

    def _main(self, scores: dict) -> dict:
        return main_scores(self.task, scores)

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
        """Every round, the full-fit seeds, the soups, the decision rules, then the student; ``DIR/all_results.json``
        last. Returns it."""
        from common import write_json_atomic

        self.prepare()
        # What an earlier run left that would look like this run's results (or a usable ensemble) goes first.
        for r in range(self.rounds + 1):
            for name in ("all_results.json", "kfold_ensemble.json", "decision_rule.json"):
                (self.round_dir(r) / name).unlink(missing_ok=True)
        if self.args.distill:
            self.task.parse(student_flags(self))  # the student's flags are checked before any fold trains
        results, predicted = self.run_rounds() if self.args.folds else ({}, None)
        if self.args.full_fit_seeds:
            results.update(run_full_fit(self))
        if self.args.soup:
            results.update(run_soups(self))
        if self.args.fit_rule:
            results.update(run_rules(self, predicted))
        if self.args.distill:
            student = train_student(self, predicted)
            results.update(
                {f"student_{k}": v for k, v in student.items() if k.startswith("test_") or k.startswith("train_")}
            )
        write_json_atomic(self.out / "all_results.json", results)
        return results

    def run_rounds(self) -> tuple[dict, dict]:
        """Round 0 and the pseudo-label rounds: the last round's results and predictions."""
        from common import write_json_atomic

        pseudo: list[list[dict]] = [[] for _ in range(self.args.folds)]
        pseudo_stats, earlier = None, []
        for r in range(self.rounds + 1):
            jobs = [self.fold_job(r, fold, pseudo[fold]) for fold in range(self.args.folds)]
            print(f"[kfold] round {r}: {len(jobs)} folds, {self.executor.describe()}", flush=True)
            records = self.run_jobs(jobs, self.round_dir(r), f"kfold round {r}")
            last = r == self.rounds
            predicted = self.predict_round(r, self.unlabeled is not None and (not last or self.args.distill))
            results = self.write_round(r, records, predicted, pseudo, pseudo_stats)
            if not last:
                write_json_atomic(self.round_dir(r) / "all_results.json", results)
                earlier.append({k: v for k, v in results.items() if isinstance(v, int | float | str)})
                pseudo, pseudo_stats = pseudo_labels(self, r, predicted)
        if earlier:
            results["rounds"] = earlier
        return results, predicted


def main(argv: list[str] | None = None, run=run_fold) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = kfold_args.parser(__doc__)
    args = parser.parse_args(argv)
    kfold_args.check(parser, args, recipe_flags)
    try:
        with sweep.make_executor(args, default_threads=share_of_cores, run=run) as executor:
            kfold = KFold(args, TASKS[args.recipe], recipe_flags, executor=executor)
            kfold_args.check_parsed(parser, args, kfold)
            results = kfold.run_all()
    except (DataError, FoldFailed, sweep.SweepError) as err:
        print(f"kfold: {err}", file=sys.stderr)
        return 1
    metric = getattr(TASKS[args.recipe].recipe, "MAIN_METRIC", "f1")
    shown = [f"{prefix}{metric}" for prefix in ("oof_", "test_", "full_fit_test_", "soup_test_", "full_fit_soup_test_",
                                                 "rule_test_", "student_test_")]  # fmt: skip
    shown.insert(2, f"fold_test_{metric}_mean")
    summary = {key: results[key] for key in shown if isinstance(results.get(key), float)}
    print("[kfold] " + ", ".join(f"{k} {v:.4f}" for k, v in summary.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
