"""Full-fit seed ensembles of the k-fold runner (``--full_fit_seeds N``): N models on all the training data, each
with its own seed and the single model's number of steps, in ``DIR/full_fit/seed{k}/``; ``DIR/full_fit/`` is an
ensemble folder of them (combined as the folds are) that the recipes predict with."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ensemble_folder import predict_members, prediction_args
from kfold_outputs import write_test_ensemble
from kfold_plan import FoldJob, member_flags, member_seed, training_steps

if TYPE_CHECKING:
    from kfold import KFold


def full_fit_dir(run: KFold):
    return run.out / "full_fit"


def full_fit_jobs(run: KFold) -> list[FoldJob]:
    """One job per seed: the recipe on ``data/train.jsonl`` (all the training data) with ``--seed`` its member seed
    and, with ``--fold_steps match``, ``--max_steps`` the single model's steps (the same as its epochs give); no
    validation data (every example trains), the test split predicted."""
    steps = training_steps(run.training_args, len(run.train)) if run.args.fold_steps == "match" else None
    recipe_file = str(run.recipe_file)
    jobs = []
    for k in range(run.args.full_fit_seeds):
        run_dir = full_fit_dir(run) / f"seed{k}"
        if run.train_changed or run.test_changed:
            from kfold import invalidate

            invalidate(run_dir)
        seed = member_seed(run.base_seed, "full_fit", k)
        flags = member_flags(run.fold_flags, seed, steps) + run.data_flags(run.data_dir / "train.jsonl", None)
        jobs.append(FoldJob(-1, k, recipe_file, run_dir, flags))
    return jobs


def run_full_fit(run: KFold) -> dict:
    """Train the seeds (resumable, as the folds), ensemble them on the test split, write ``DIR/full_fit/`` (its
    files, manifest and ``all_results.json``); the ``full_fit_`` results for ``DIR/all_results.json``."""
    from common import write_json_atomic

    folder = full_fit_dir(run)
    (folder / "all_results.json").unlink(missing_ok=True)
    jobs = full_fit_jobs(run)
    steps = training_steps(run.training_args, len(run.train)) if run.args.fold_steps == "match" else None
    print(f"[kfold] full fit: {len(jobs)} seeds, {run.executor.describe()}", flush=True)
    records = run.run_jobs(jobs, folder, "kfold full fit")
    names = [f"seed{k}" for k in range(len(jobs))]
    start = time.perf_counter()
    seconds = {"test": 0.0}
    args = prediction_args(run.training_args, folder)
    outputs = predict_members(
        run.task, [folder / n for n in names], {"test": run.test}, run.labels, run.data_args, run.model_args, args,
        seconds=seconds,
    )["test"]  # fmt: skip
    results = write_test_ensemble(run.task, folder, names, run.test, outputs, run.labels, run.data_args)
    results = {key.replace("member_", "seed_"): value for key, value in results.items()}
    results.update(
        {
            "seeds": [member_seed(run.base_seed, "full_fit", k) for k in range(len(jobs))],
            "max_steps": steps,
            "train_runtime": float(sum(r["results"].get("train_runtime") or 0.0 for r in records)),
            "train_seconds": float(sum(r["wall_seconds"] for r in records)),
            "predict_seconds": time.perf_counter() - start,
            "test_predict_seconds": seconds["test"],
            "label_list": run.labels,
        }
    )
    write_json_atomic(folder / "all_results.json", results)
    return {f"full_fit_{key}": value for key, value in results.items() if key != "label_list"}
