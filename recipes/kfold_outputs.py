"""The test files of an ensemble of a k-fold run (its folds, its full-fit seeds): the combined predictions, the
probabilities (classification: the ensemble's and each member's), the manifest, and the metrics read back from the
files written."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ensemble_folder import EnsembleTask, MemberOutput, rescore, write_manifest


def main_scores(task: EnsembleTask, scores: dict) -> dict:
    """The task's reported metrics of a scores dict."""
    return {key: scores[key] for key in task.metrics}


def calibration(task: EnsembleTask, probabilities: np.ndarray, examples: list[dict], labels: list[str]) -> dict:
    """``test_nll`` (the log loss) and ``test_ece`` (15 bins) of classification probabilities of ``examples``."""
    from nlp_tricks.functional.decision_rules import expected_calibration_error, negative_log_likelihood

    gold = np.asarray([labels.index(g) for g in task.gold(examples)])
    return {"test_nll": negative_log_likelihood(probabilities, gold),
            "test_ece": expected_calibration_error(probabilities, gold)}  # fmt: skip


def write_test_ensemble(
    task: EnsembleTask,
    folder: Path,
    members: list[str],
    test: list[dict],
    outputs: list[MemberOutput],
    labels: list[str],
    data_args,
    vote: float | None = None,
) -> dict:
    """Write the ensemble of ``members`` (folders under ``folder``) on ``test``: ``test_predictions.*`` (combined
    by the task's rule, or ``vote``), classification ``test_probabilities.npy`` here and in each member's folder;
    its manifest. Returns ``test_<metric>``, ``member_test_<metric>`` (one per member, from its own folder's
    predictions file) and ``member_test_<metric>_mean``, and classification ``test_nll`` / ``test_ece``
    (:func:`calibration`)."""
    predictions = task.combine(outputs, labels, vote)
    task.write(folder / task.predictions_file, test, predictions, data_args)
    scores = main_scores(task, rescore(task, folder / task.predictions_file, labels))
    results = {f"test_{key}": value for key, value in scores.items()}
    if task.name == "classification":
        probabilities = task.probabilities(outputs)
        np.save(folder / "test_probabilities.npy", probabilities)
        results.update(calibration(task, probabilities, test, labels))
        for name, output in zip(members, outputs):
            np.save(folder / name / "test_probabilities.npy", task.probabilities([output]))
    per_member = []
    for name, output in zip(members, outputs):
        path = folder / name / task.predictions_file
        if not path.is_file():  # a member's run writes its own; one without it gets it from its outputs here
            task.write(path, test, task.member_predictions(output, labels), data_args)
        per_member.append(main_scores(task, rescore(task, path, labels)))
    for key in task.metrics:
        values = [scores[key] for scores in per_member]
        results[f"member_test_{key}"] = values
        results[f"member_test_{key}_mean"] = float(np.mean(values))
    results["test_samples"] = len(test)
    write_manifest(folder, task.name, members, labels, vote)
    return results
