"""Decision rules of the k-fold runner (``--fit_rule``), fitted on the out-of-fold predictions only, stored with the
ensemble folder (``DIR/decision_rule.json``, beside its manifest) and applied when the folder predicts.

- ``temperature`` (classification): one T for the log loss, ``softmax(log p / T)``
  (:func:`nlp_tricks.functional.decision_rules.fit_temperature`).
- ``bias``: classification, a per-class bias on the (tempered) log-probabilities for macro-F-beta; NER tagging, a
  per-type bias added to the log-probabilities (with a CRF, to the emissions) of every tag of that type, for entity
  F-beta (``O`` stays 0: a positive bias lowers the bar for that type).
- ``threshold`` (NER span head): a per-type threshold on the span scores (a span is kept when its score is above its
  type's threshold instead of 0), for entity F-beta.

What they are fitted on (:func:`read_oof`) comes from the files of the folder alone: ``folds.json``, the training rows'
gold labels in ``data/train.jsonl``, and the out-of-fold scores (``oof_probabilities.npy``, ``oof_scores.npz``), each
row's scores from the fold model that did not see it; never a test label. ``rule_oof_<metric>`` is cross-fitted:
fold k's rows are scored by the rule fitted on the other folds' rows. With ``--fit_rule_runs``, the rule is fitted on
each run's out-of-fold rows and the parameters are averaged (T geometrically).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nlp_tricks.data import DataError
from nlp_tricks.data.schemes import split_tag, tags_to_spans
from nlp_tricks.ensemble import crf_with_scores, mean_crf, mean_span_scores, mean_word_probabilities
from nlp_tricks.functional.decision_rules import (
    BIAS_GRID,
    apply_class_bias,
    apply_temperature,
    coordinate_ascent,
    expected_calibration_error,
    fbeta_from_counts,
    fit_class_bias,
    fit_temperature,
    negative_log_likelihood,
)
from nlp_tricks.functional.spans import best_flat_spans

from kfold_data import is_span_task

if TYPE_CHECKING:
    from kfold import KFold

RULE_FILE = "decision_rule.json"
RULE_KIND = "nlp_tricks decision rule"
OOF_SCORES = "oof_scores.npz"


@dataclass
class RuleInputs:
    """Scores a rule turns into predictions, one row per example.

    ``kind``: ``classification`` (``rows`` ``(N, C)`` log-probabilities), ``tagger`` (per sentence ``(W, C)``
    log-probabilities, NaN rows unseen), ``crf`` (per sentence ``(W, C)`` emissions and ``group[i]``, the index in
    ``potentials`` of its CRF scores), ``span`` (per sentence ``(T, W, W)`` span scores)."""

    kind: str
    rows: list | np.ndarray
    potentials: list | None = None
    group: np.ndarray | None = None

    def subset(self, index) -> RuleInputs:
        rows = self.rows[index] if isinstance(self.rows, np.ndarray) else [self.rows[i] for i in index]
        group = None if self.group is None else self.group[index]
        return RuleInputs(self.kind, rows, self.potentials, group)


def kind_of(task, crf: bool) -> str:
    if task.name == "classification":
        return "classification"
    return "span" if is_span_task(task) else ("crf" if crf else "tagger")


# ---- Out-of-fold scores: saved, read back ----------------------------------------------------------------------


def save_oof_scores(run: KFold, folder: Path, heldout: list) -> dict:
    """Each training row's out-of-fold scores in training order: classification ``oof_probabilities.npy`` (and its
    ``oof_nll`` / ``oof_ece``, returned), NER ``oof_scores.npz`` (concatenated word logits or span scores, their
    lengths, each fold's CRF scores)."""
    task, n = run.task, len(run.train)
    if task.name == "classification":
        probabilities = np.zeros((n, len(run.labels)), dtype=np.float32)
        for fold, output in enumerate(heldout):
            probabilities[run.heldout[fold]] = task.probabilities([output])
        np.save(folder / "oof_probabilities.npy", probabilities)
        gold = np.asarray([run.labels.index(ex["label"]) for ex in run.train])
        return {"oof_nll": negative_log_likelihood(probabilities, gold),
                "oof_ece": expected_calibration_error(probabilities, gold)}  # fmt: skip
    per_row: list = [None] * n
    for fold, output in enumerate(heldout):
        values = output.span_scores if is_span_task(task) else output.word_logits
        for i, value in zip(run.heldout[fold], values):
            per_row[i] = np.asarray(value, dtype=np.float32)
    arrays = {"lengths": np.asarray([row.shape[-1] if is_span_task(task) else len(row) for row in per_row])}
    arrays["scores"] = np.concatenate([row.reshape(-1) for row in per_row]) if n else np.zeros(0, np.float32)
    if not is_span_task(task) and heldout and heldout[0].potentials is not None:
        for j, name in enumerate(("start", "transitions", "end")):
            arrays[f"crf_{name}"] = np.stack([np.asarray(o.potentials[j], dtype=np.float64) for o in heldout])
    np.savez(folder / OOF_SCORES, **arrays)
    return {}


def read_oof(folder: Path, task, labels: list[str], data_args) -> tuple[RuleInputs, list, np.ndarray]:
    """``(inputs, gold, fold_of)`` of a k-fold folder, from its files only (see the module docstring)."""
    fold_of = np.asarray(json.loads((folder / "folds.json").read_text())["fold_of_example"])
    records = [json.loads(line) for line in (folder / "data" / "train.jsonl").read_text().splitlines() if line]
    if task.name == "classification":
        probabilities = np.load(folder / "oof_probabilities.npy").astype(np.float64)
        gold = np.asarray([labels.index(r[data_args.label_column]) for r in records])
        return RuleInputs("classification", np.log(np.clip(probabilities, 1e-30, None))), gold, fold_of
    with np.load(folder / OOF_SCORES, allow_pickle=False) as saved:
        arrays = {key: saved[key] for key in saved.files}
    rows, offset = [], 0
    span = is_span_task(task)
    for length in arrays["lengths"].tolist():
        shape = (len(labels), length, length) if span else (length, len(labels))
        size = int(np.prod(shape))
        rows.append(arrays["scores"][offset : offset + size].reshape(shape).astype(np.float64))
        offset += size
    if span:
        gold = [{(e["type"], e["start"], e["end"]) for e in r["entities"]} for r in records]
        return RuleInputs("span", rows), gold, fold_of
    gold = [set(tags_to_spans(r[data_args.tags_column])) for r in records]
    if "crf_start" in arrays:
        potentials = list(zip(arrays["crf_start"], arrays["crf_transitions"], arrays["crf_end"]))
        return RuleInputs("crf", rows, potentials, fold_of.copy()), gold, fold_of
    return RuleInputs("tagger", [_log_softmax_rows(r) for r in rows]), gold, fold_of


def _log_softmax_rows(rows: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax; a NaN row (an unseen word) stays NaN."""
    rows = np.asarray(rows, dtype=np.float64)
    shifted = rows - np.max(np.nan_to_num(rows, nan=0.0), axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# ---- Predictions under a rule ------------------------------------------------------------------------------------


def type_index(labels: list[str]) -> tuple[list[str], np.ndarray]:
    """The entity types of IOB2 tags and, per tag, the index of its type (-1 for ``O``)."""
    kinds = [split_tag(label)[1] for label in labels]
    types = sorted({k for k in kinds if k})
    return types, np.asarray([types.index(k) if k else -1 for k in kinds])


def tag_bias(labels: list[str], bias: np.ndarray) -> np.ndarray:
    """Per tag, its type's bias (0 for ``O``)."""
    _, index = type_index(labels)
    return np.where(index >= 0, np.asarray(bias, dtype=np.float64)[np.maximum(index, 0)], 0.0)


def predict_ids(inputs: RuleInputs, params: dict, labels: list[str]) -> list:
    """The predictions of ``inputs`` under ``params`` (the rule's fitted values; ``{}``: none): class ids, tag ids
    per sentence (None: an unseen word), or ``(type, start, end)`` spans per sentence."""
    if inputs.kind == "classification":
        rows = inputs.rows
        if "temperature" in params:
            rows = np.log(apply_temperature(rows, params["temperature"]))
        return apply_class_bias(rows, params.get("bias", np.zeros(len(labels))))
    if inputs.kind == "span":
        return _span_predictions(inputs, params.get("thresholds", np.zeros(len(labels))), params.get("flat", False))
    shift = tag_bias(labels, params.get("type_bias", np.zeros(len(type_index(labels)[0]))))
    if inputs.kind == "tagger":
        return [[int(np.argmax(r + shift)) if not np.isnan(r).any() else None for r in rows] for rows in inputs.rows]
    return _crf_predictions(inputs, shift)


def _crf_predictions(inputs: RuleInputs, shift: np.ndarray) -> list:
    """Each sentence's Viterbi path under its own CRF scores, with ``shift`` added to its emissions; the sentences of
    one CRF decoded as one batch (the seen words only, as :func:`nlp_tricks.ensemble.viterbi` decodes)."""
    import torch

    out: list = [None] * len(inputs.rows)
    for g in np.unique(inputs.group):
        members = np.flatnonzero(inputs.group == g)
        seen = [np.flatnonzero(~np.isnan(inputs.rows[i]).any(axis=-1)) for i in members]
        longest = max([len(s) for s in seen] + [1])
        batch = np.zeros((len(members), longest, len(shift)), dtype=np.float32)
        for b, (i, words) in enumerate(zip(members, seen)):
            batch[b, : len(words)] = inputs.rows[i][words] + shift
        paths = crf_with_scores(*inputs.potentials[g]).viterbi_lengths(
            torch.from_numpy(batch), torch.tensor([max(len(s), 1) for s in seen])
        )
        for b, (i, words) in enumerate(zip(members, seen)):
            tags: list = [None] * len(inputs.rows[i])
            for position, word in enumerate(words.tolist()):
                tags[word] = int(paths[b, position])
            out[i] = tags
    return out


def _span_predictions(inputs: RuleInputs, thresholds: np.ndarray, flat: bool) -> list:
    out = []
    for scores in inputs.rows:
        shifted = np.nan_to_num(scores, nan=-np.inf) - np.asarray(thresholds, dtype=np.float64)[:, None, None]
        t, i, j = np.nonzero(shifted > 0)
        candidates = [(int(a), int(b), int(c) + 1, float(shifted[a, b, c])) for a, b, c in zip(t, i, j)]
        kept = best_flat_spans(candidates) if flat else [span[:3] for span in candidates]
        out.append(sorted(kept, key=lambda span: (span[1], span[2], span[0])))
    return out


def as_labels(inputs: RuleInputs, ids: list, labels: list[str]) -> list:
    """Predictions as the task writes them: label names, tag names per word (unseen: ``O``), typed spans."""
    if inputs.kind == "classification":
        return [labels[int(i)] for i in ids]
    if inputs.kind == "span":
        return [[(labels[t], a, b) for t, a, b in spans] for spans in ids]
    return [["O" if y is None else labels[y] for y in sentence] for sentence in ids]


def entity_fbeta(predicted: list, gold: list, beta: float) -> float:
    """Micro F-beta of predicted entity sets against gold ones (per sentence)."""
    tp = sum(len(p & g) for p, g in zip(predicted, gold))
    return fbeta_from_counts(tp, sum(map(len, predicted)) - tp, sum(map(len, gold)) - tp, beta)


# ---- Fitting -----------------------------------------------------------------------------------------------------


def fit_params(inputs: RuleInputs, gold: list, labels: list[str], names: list[str], beta: float, flat: bool) -> dict:
    """The rule's fitted values on these rows (``names``: the rules asked for)."""
    if inputs.kind == "classification":
        params, rows = {}, inputs.rows
        if "temperature" in names:
            params["temperature"] = fit_temperature(rows, gold)
            rows = np.log(apply_temperature(rows, params["temperature"]))
        if "bias" in names:
            params["bias"] = fit_class_bias(rows, gold, beta)
        return params
    if inputs.kind == "span":

        def score(thresholds):
            spans = _span_predictions(inputs, thresholds, flat)
            return entity_fbeta([set(s) for s in as_labels(inputs, spans, labels)], gold, beta)

        return {"thresholds": coordinate_ascent(score, len(labels), BIAS_GRID)[0], "flat": flat}
    types = type_index(labels)[0]

    def score(bias):
        tags = as_labels(inputs, predict_ids(inputs, {"type_bias": bias}, labels), labels)
        return entity_fbeta([set(tags_to_spans(t)) for t in tags], gold, beta)

    return {"type_bias": coordinate_ascent(score, len(types), BIAS_GRID)[0]}


def fit_rule(folders: list[Path], task, labels: list[str], names: list[str], beta: float, data_args) -> dict:
    """The rule (its JSON record) fitted on each folder's out-of-fold rows, the parameters averaged over folders."""
    fitted = []
    flat = bool(getattr(task, "flat", False))
    for folder in folders:
        inputs, gold, _ = read_oof(folder, task, labels, data_args)
        fitted.append(fit_params(inputs, gold, labels, names, beta, flat))
    rule = {"kind": RULE_KIND, "recipe": task.name, "labels": list(labels), "rules": sorted(names, reverse=True),
            "beta": beta, "fitted_on": "out-of-fold predictions", "runs": [str(f) for f in folders]}  # fmt: skip
    rule.update(_average(fitted))
    return rule


def _average(fitted: list[dict]) -> dict:
    out = {}
    for key, value in fitted[0].items():
        if key == "temperature":
            out[key] = float(np.exp(np.mean([np.log(f[key]) for f in fitted])))
        elif key == "flat":
            out[key] = value
        else:
            out[key] = np.mean([np.asarray(f[key], dtype=np.float64) for f in fitted], axis=0).tolist()
    return out


def params_of(rule: dict) -> dict:
    return {key: (np.asarray(v) if isinstance(v, list) else v) for key, v in rule.items()
            if key in ("temperature", "bias", "type_bias", "thresholds", "flat")}  # fmt: skip


def cross_fitted(inputs: RuleInputs, gold: list, fold_of: np.ndarray, rule: dict, labels: list[str]) -> list:
    """Each row's prediction under the rule fitted on the other folds' rows (``rule``'s settings)."""
    out: list = [None] * len(fold_of)
    names, beta, flat = rule["rules"], rule["beta"], bool(rule.get("flat", False))
    for fold in np.unique(fold_of):
        others, own = np.flatnonzero(fold_of != fold), np.flatnonzero(fold_of == fold)
        subset_gold = gold[others] if isinstance(gold, np.ndarray) else [gold[i] for i in others]
        params = fit_params(inputs.subset(others), subset_gold, labels, names, beta, flat)
        for i, prediction in zip(own, predict_ids(inputs.subset(own), params, labels)):
            out[i] = prediction
    return out


# ---- Applying ----------------------------------------------------------------------------------------------------


def member_inputs(task, outputs: list, labels: list[str]) -> RuleInputs:
    """The ensemble's scores of its members' outputs, as its rule reads them: the mean probabilities' logs, the
    mean word probabilities' logs, the mean CRF (emissions and scores), or the mean span scores."""
    if task.name == "classification":
        return RuleInputs("classification", np.log(np.clip(task.probabilities(outputs), 1e-30, None)))
    sentences = range(len(outputs[0].span_scores if is_span_task(task) else outputs[0].word_logits))
    if is_span_task(task):
        return RuleInputs("span", [mean_span_scores([o.span_scores[i] for o in outputs]) for i in sentences])
    if outputs[0].potentials is not None:
        rows, scores = [], None
        for i in sentences:
            emissions, *scores = mean_crf([o.word_logits[i] for o in outputs], [o.potentials for o in outputs])
            rows.append(emissions)
        scores = scores or [np.mean([o.potentials[j] for o in outputs], axis=0) for j in range(3)]
        return RuleInputs("crf", rows, [tuple(scores)], np.zeros(len(rows), dtype=np.int64))
    with np.errstate(divide="ignore"):
        return RuleInputs("tagger", [np.log(mean_word_probabilities([o.word_logits[i] for o in outputs]))
                                     for i in sentences])  # fmt: skip


def apply_rule(task, rule: dict, outputs: list, labels: list[str]) -> tuple[list, np.ndarray | None]:
    """The ensemble's predictions under ``rule`` and (classification) its probabilities (tempered by the rule's
    temperature, if it has one)."""
    if rule["labels"] != list(labels):
        raise DataError(None, None, f"the decision rule's labels {rule['labels']} are not the ensemble's {labels}")
    inputs = member_inputs(task, outputs, labels)
    params = params_of(rule)
    predictions = as_labels(inputs, predict_ids(inputs, params, labels), labels)
    if task.name != "classification":
        return predictions, None
    probabilities = apply_temperature(inputs.rows, params.get("temperature", 1.0))
    return predictions, probabilities.astype(np.float32)


def read_rule(folder: str | Path) -> dict | None:
    """The decision rule stored with an ensemble folder, or None."""
    path = Path(folder) / RULE_FILE
    if not path.is_file():
        return None
    try:
        rule = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(path, None, f"cannot read the decision rule ({err})") from None
    if not isinstance(rule, dict) or rule.get("kind") != RULE_KIND:
        raise DataError(path, None, f'not a decision rule (no "kind": {RULE_KIND!r})')
    return rule


def run_rules(run: KFold, predicted: dict) -> dict:
    """Fit the rule on the out-of-fold rows (this run's and ``--fit_rule_runs``'), store it beside the manifest,
    write ``DIR/rule/`` (the cross-fitted out-of-fold and the test predictions after it); ``rule_`` results."""
    from common import write_json_atomic
    from kfold_outputs import main_scores

    task, labels, args = run.task, run.labels, run.args
    folders = [run.out, *map(Path, args.fit_rule_runs)]
    for other in folders[1:]:
        if not (other / "folds.json").is_file():
            raise DataError(other, None, "--fit_rule_runs: not a k-fold run folder (no folds.json)")
        if (other / "data" / "train.jsonl").read_bytes() != (run.out / "data" / "train.jsonl").read_bytes():
            raise DataError(other, None, "--fit_rule_runs: its training rows are not this run's")
    rule = fit_rule(folders, task, labels, args.fit_rule, args.fit_beta, run.data_args)
    write_json_atomic(run.out / RULE_FILE, rule)
    folder = run.out / "rule"
    folder.mkdir(exist_ok=True)
    (folder / "all_results.json").unlink(missing_ok=True)
    inputs, gold, fold_of = read_oof(run.out, task, labels, run.data_args)
    suffix = Path(task.predictions_file).suffix
    oof = as_labels(inputs, cross_fitted(inputs, gold, fold_of, rule, labels), labels)
    task.write(folder / f"oof_predictions{suffix}", run.train, oof, run.data_args)
    results = {f"oof_{k}": v for k, v in main_scores(task, rescore_file(task, folder, f"oof_predictions{suffix}",
                                                                        labels)).items()}  # fmt: skip
    if "temperature" in rule["rules"]:
        results.update(_cross_fitted_calibration(inputs, gold, fold_of))
    if run.test is not None:
        predictions, probabilities = apply_rule(task, rule, [o["test"] for o in predicted["outputs"]], labels)
        task.write(folder / task.predictions_file, run.test, predictions, run.data_args)
        scores = main_scores(task, rescore_file(task, folder, task.predictions_file, labels))
        results.update({f"test_{key}": value for key, value in scores.items()})
        if probabilities is not None:
            np.save(folder / "test_probabilities.npy", probabilities)
            test_gold = np.asarray([labels.index(g) for g in task.gold(run.test)])
            results["test_nll"] = negative_log_likelihood(probabilities, test_gold)
            results["test_ece"] = expected_calibration_error(probabilities, test_gold)
    write_json_atomic(folder / "all_results.json", {**results, "decision_rule": rule, "label_list": labels})
    return {**{f"rule_{key}": value for key, value in results.items()}, "decision_rule": rule}


def rescore_file(task, folder: Path, name: str, labels: list[str]) -> dict:
    from ensemble_folder import rescore

    return rescore(task, folder / name, labels)


def _cross_fitted_calibration(inputs: RuleInputs, gold: np.ndarray, fold_of: np.ndarray) -> dict:
    """``oof_nll`` / ``oof_ece`` of the rows tempered by the temperature fitted on the other folds' rows."""
    probabilities = np.zeros_like(inputs.rows)
    for fold in np.unique(fold_of):
        others, own = fold_of != fold, fold_of == fold
        probabilities[own] = apply_temperature(inputs.rows[own], fit_temperature(inputs.rows[others], gold[others]))
    return {"oof_nll": negative_log_likelihood(probabilities, gold),
            "oof_ece": expected_calibration_error(probabilities, gold)}  # fmt: skip
