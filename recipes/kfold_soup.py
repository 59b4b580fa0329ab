"""Soups of the k-fold runner (``--soup {uniform,greedy}``): the fold models' weights averaged into one model in
``DIR/soup/`` (with ``--folds 0``, the full-fit seeds' in ``DIR/full_fit/soup/``), which predicts at one model's cost
(:mod:`nlp_tricks.soup`).

The greedy soup selects on ``--validation_file`` given after ``--`` when there is one (no member saw it). Without
it, fold models select on the training rows, each scored in its held-out fold's place (the pooled held-out parts):
a soup of two or more fold models has seen every one of those rows in some member, so that score is optimistic,
and it favours keeping members; full-fit seeds, which saw every row, need the validation file (refused otherwise).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nlp_tricks.runtime.checkpoint import load_state_dict_portable
from nlp_tricks.soup import check_soup_members, greedy_soup, read_member_state, uniform_soup, write_soup

from ensemble_folder import prediction_args, rescore
from kfold_outputs import calibration, main_scores

if TYPE_CHECKING:
    from kfold import KFold


def run_soups(run: KFold) -> dict:
    """The soup of the fold models (``soup_`` results), or with ``--folds 0`` of the full-fit seeds
    (``full_fit_soup_``)."""
    if run.args.folds:
        members = [run.out / f"fold{k}" for k in range(run.args.folds)]
        return make_soup(run, members, run.out / "soup", "soup_")
    members = [run.out / "full_fit" / f"seed{k}" for k in range(run.args.full_fit_seeds)]
    return make_soup(run, members, run.out / "full_fit" / "soup", "full_fit_soup_")


def selection_set(run: KFold) -> tuple[str, list[dict]]:
    """What a greedy soup is selected on: the validation split given after ``--``, else the training rows."""
    if run.data_args.validation_file is not None:
        splits, _ = run.task.read_eval_splits(run.data_args, run.labels)
        return f"validation: {run.data_args.validation_file}", splits["validation"]
    return "the training rows, pooled over the held-out folds (optimistic: every row trained some member)", run.train


def make_soup(run: KFold, members: list[Path], folder: Path, prefix: str) -> dict:
    """The soup of ``members`` (``run.args.soup``) written to ``folder`` with its test predictions and
    ``all_results.json``; its results under ``prefix``."""
    from common import write_json_atomic

    task, labels, metric = run.task, run.labels, getattr(run.task.recipe, "MAIN_METRIC", "f1")
    kind = check_soup_members(members)
    (folder / "all_results.json").unlink(missing_ok=True)
    states = [read_member_state(m) for m in members]
    if kind == "adapter":
        return adapter_soup(run, members, states, folder, prefix)
    model, tokenizer = task.load_member(members[0], run.model_args, labels)
    args = prediction_args(run.training_args, folder)
    info = {"soup": run.args.soup, "members": [m.name for m in members]}
    if run.args.soup == "greedy":
        info["selection"], examples = selection_set(run)
        gold = task.gold(examples)

        def score(indices: list[int]) -> float:
            load_state_dict_portable(model, uniform_soup([states[i] for i in indices]))
            output = task.predict(model, tokenizer, examples, labels, run.data_args, args)
            return float(task.score(gold, task.combine([output], labels), labels, run.data_args)[metric])

        chosen = greedy_soup(len(members), score)
        info.update(
            kept=[members[i].name for i in chosen.members],
            selection_score=chosen.score,
            member_scores=chosen.member_scores,
            trials=chosen.trials,
        )
        states = [states[i] for i in chosen.members]
    state = uniform_soup(states)
    load_state_dict_portable(model, state)
    write_soup(state, members[0], folder, info)
    results = {"members": info.get("kept", info["members"]), "selection": info.get("selection")}
    if run.test is not None:
        start = time.perf_counter()
        output = task.predict(model, tokenizer, run.test, labels, run.data_args, args)
        results["test_predict_seconds"] = time.perf_counter() - start
        task.write(folder / task.predictions_file, run.test, task.combine([output], labels), run.data_args)
        if task.name == "classification":
            probabilities = task.probabilities([output])
            np.save(folder / "test_probabilities.npy", probabilities)
            results.update(calibration(task, probabilities, run.test, labels))
        scores = main_scores(task, rescore(task, folder / task.predictions_file, labels))
        results.update({f"test_{key}": value for key, value in scores.items()})
    if "selection_score" in info:
        results[f"selection_{metric}"] = info["selection_score"]
    write_json_atomic(folder / "all_results.json", {**results, "label_list": labels})
    return {f"{prefix}{key}": value for key, value in results.items()}


def adapter_soup(run: KFold, members: list[Path], states: list[dict], folder: Path, prefix: str) -> dict:
    """LoRA adapter members: their tensors averaged one by one into one adapter in ``folder`` (uniform only: the
    greedy soup scores candidate models, and an adapter predicts through the recipe that loads it)."""
    from nlp_tricks.data import DataError

    from common import write_json_atomic

    if run.args.soup == "greedy":
        raise DataError(
            members[0],
            None,
            "--soup greedy: the members are LoRA adapters, averaged tensor by tensor "
            "without scoring candidates here; use --soup uniform",
        )
    info = {"soup": "uniform", "kind": "adapter", "members": [m.name for m in members]}
    write_soup(uniform_soup(states), members[0], folder, info)
    results = {"members": info["members"], "kind": "adapter (tensor by tensor; no test predictions here)"}
    write_json_atomic(folder / "all_results.json", {**results, "label_list": run.labels})
    return {f"{prefix}{key}": value for key, value in results.items()}
