"""The k-fold runner's pseudo-labels and student (recipes/kfold.py ``--unlabeled_file``, ``--distill``): F labelled
fold by fold for the next round, and one student distilled from the ensemble's soft targets."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nlp_tricks.data.schemes import convert_tags

from ensemble_folder import MemberOutput, prediction_args, rescore
from kfold_data import example_record, is_span_task, strip_flags

if TYPE_CHECKING:
    from kfold import KFold


def pseudo_labels(run: KFold, r: int, predicted: dict) -> tuple[list[list[dict]], list[dict]]:
    """For round ``r + 1``: per fold k, F labelled by fold model k of round ``r`` (never a model that saw fold
    k's held-out part), as JSON-lines records, with a provenance file each; and the counts."""
    from nlp_tricks.ensemble import crf_with_scores
    from nlp_tricks.self_training import classification_pseudo_labels, ner_pseudo_labels

    task, threshold, scheme = run.task, run.args.confidence_threshold, run.data_args.tag_scheme
    self_training_task = task.recipe.NER_TASK if task.name == "ner" else task.recipe.CLASSIFICATION_TASK
    per_fold, stats = [], []
    for fold in range(run.args.folds):
        output: MemberOutput = predicted["outputs"][fold]["unlabeled"]
        if is_span_task(task):
            records = span_pseudo_labels(run, output)
            per_fold.append(records)
            stats.append(pseudo_label_stat(run, r, fold, len(records)))
            continue
        if task.name == "ner":
            rows = [np.flatnonzero(~np.isnan(w).any(axis=-1)) for w in output.word_logits]
            crf = crf_with_scores(*output.potentials) if output.potentials is not None else None
            pseudo = ner_pseudo_labels(
                [w[seen] for w, seen in zip(output.word_logits, rows)], [s.tolist() for s in rows], threshold, crf
            )
        else:
            pseudo = classification_pseudo_labels(list(output.logits), threshold)
        examples = self_training_task.pseudo_examples(run.unlabeled, pseudo, run.labels)
        if task.name == "ner":  # the model's IOB2 tags written in the scheme of the files they join
            examples = [{**ex, "ner_tags": convert_tags(ex["ner_tags"], scheme)} for ex in examples]
        records = [example_record(task, ex, run.data_args, f"unlabeled{i}") for i, ex in zip(pseudo.indices, examples)]
        per_fold.append(records)
        stats.append(pseudo_label_stat(run, r, fold, len(records)))
    return per_fold, stats


def pseudo_label_stat(run: KFold, r: int, fold: int, kept: int) -> dict:
    """The provenance file of fold ``fold``'s pseudo-labels for round ``r + 1`` (written), and its record."""
    from common import write_json_atomic

    teacher = run.round_dir(r) / f"fold{fold}"
    stat = {
        "fold": fold,
        "teacher": str(teacher.relative_to(run.out)),
        "teacher_round": r,
        "teacher_fold": fold,
        "unlabeled": len(run.unlabeled),
        "kept": kept,
        "confidence_threshold": run.args.confidence_threshold,
        "unlabeled_file": str(run.args.unlabeled_file),
    }
    write_json_atomic(run.data_dir / f"round{r + 1}_fold{fold}_pseudo_labels.json", stat)
    return stat


def span_pseudo_labels(run: KFold, output: MemberOutput) -> list[dict]:
    """F labelled by one span model: each sentence with the entities it decodes alone (flat or nested, as it
    was trained), cut after the last word it saw (truncation cut the rest); a sentence it saw no word of is
    left out."""
    records = []
    spans = run.task.member_predictions(output, run.labels)
    for i, (ex, scores, found) in enumerate(zip(run.unlabeled, output.span_scores, spans)):
        seen = np.flatnonzero(~np.isnan(np.diagonal(scores, axis1=1, axis2=2)).any(axis=0))
        if not len(seen):
            continue
        n = int(seen[-1]) + 1
        example = {
            "tokens": ex["tokens"][:n],
            "entities": [{"type": t, "start": a, "end": b} for t, a, b in found],
        }
        records.append(example_record(run.task, example, run.data_args, f"unlabeled{i}"))
    return records


def student_targets(run: KFold, predicted: dict | None) -> tuple[list[dict], list, dict]:
    """``(examples, soft targets, provenance)`` of the student: every training example (soft target: the
    out-of-fold one, from the fold model that did not see it; or ``--teacher``'s) and F (soft target: the ensemble's,
    or the teacher's; hard label: its prediction)."""
    task, labels = run.task, run.labels
    unlabeled = list(run.unlabeled) if run.unlabeled is not None else []
    if run.args.teacher is not None:
        from teacher import soft_targets

        rows = [dict(ex) for ex in run.train] + unlabeled
        args = (run.data_args, run.model_args, run.training_args)
        soft, info = soft_targets(run.args.teacher, task.name, rows, labels, *args)
        soft, extra = soft[: len(run.train)], soft[len(run.train) :]
        hard = [_argmax_labels(target, labels, task.name) for target in extra]
    else:
        outputs = predicted["outputs"]
        soft = [None] * len(run.train)
        for fold in range(run.args.folds):
            for i, target in zip(run.heldout[fold], task.soft_targets([outputs[fold]["heldout"]])):
                soft[i] = target
        info = {"teacher": "this run's folds", "kind": "kfold"}
        extra, hard = [], []
        if unlabeled:
            unlabeled_outputs = [o["unlabeled"] for o in outputs]
            hard = task.combine(unlabeled_outputs, labels, run.args.ensemble_vote)
            extra = task.soft_targets(unlabeled_outputs)
    examples = [dict(ex) for ex in run.train]
    for ex, prediction, target in zip(unlabeled, hard, extra):
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
    return examples, soft, info


def _argmax_labels(target: np.ndarray, labels: list[str], task: str):
    """A teacher's hard label of an unlabelled row: its most probable class, or each seen word's most probable tag
    (an unseen word: ``O``)."""
    if task != "ner":
        return labels[int(np.argmax(target))]
    return ["O" if np.isnan(row).any() else labels[int(np.argmax(row))] for row in target]


def train_student(run: KFold, predicted: dict | None) -> dict:
    """One student on every training example and F, distilled through ``teacher_logits``
    (:func:`student_targets`); its test predictions and ``all_results.json`` in ``DIR/student``."""
    from datasets import Dataset

    import self_training
    from common import prepare_output_dir, resolve_model_path, write_json_atomic

    task, labels, folder = run.task, run.labels, run.out / "student"
    examples, soft, provenance = student_targets(run, predicted)
    teacher = [np.log(np.clip(np.asarray(t, dtype=np.float64), 1e-30, None)).astype(np.float32) for t in soft]
    fingerprint = hashlib.sha256(
        json.dumps([student_flags(run), [ex.get("tokens", ex.get("text")) for ex in examples]]).encode()
        + b"".join(np.nan_to_num(t, nan=-1.0).tobytes() for t in teacher)
    ).hexdigest()
    record_path = folder / "kfold_student.json"
    if (folder / "all_results.json").is_file() and record_path.is_file():
        if json.loads(record_path.read_text()).get("fingerprint") == fingerprint:
            return json.loads((folder / "all_results.json").read_text())
    data_args, model_args, training_args = run.task.parse(student_flags(run))
    prepare_output_dir(folder, True)
    self_training_task = task.recipe.NER_TASK if task.name == "ner" else task.recipe.CLASSIFICATION_TASK
    label2id = {label: i for i, label in enumerate(labels)}
    start = time.perf_counter()
    model, tokenizer = self_training.build_model(
        self_training_task,
        resolve_model_path(model_args.model_name_or_path),
        model_args,
        labels,
        training_args,
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
        "soft_targets": "training examples: out-of-fold; unlabelled: the ensemble's"
        if run.args.teacher is None
        else f"--teacher {run.args.teacher}",
        "teacher": provenance,
        "label_list": labels,
    }
    if run.test is not None:
        start = time.perf_counter()
        output = task.predict(model, tokenizer, run.test, labels, data_args, prediction_args(training_args, folder))
        results["test_predict_seconds"] = time.perf_counter() - start
        predictions = task.member_predictions(output, labels)
        task.write(folder / task.predictions_file, run.test, predictions, data_args)
        if task.name == "classification":
            np.save(folder / "test_probabilities.npy", task.probabilities([output]))
        results.update(
            {f"test_{k}": v for k, v in run._main(rescore(task, folder / task.predictions_file, labels)).items()}
        )
        results["test_samples"] = len(run.test)
    write_json_atomic(folder / "all_results.json", results)
    write_json_atomic(record_path, {"fingerprint": fingerprint})
    return results


def student_flags(run: KFold) -> list[str]:
    flags = strip_flags(run.fold_flags, ("crf", "crf_bio_constraints", "crf_lr_scale", "max_time"))
    flags += ["--train_file", str(run.data_dir / "train.jsonl"), "--output_dir", str(run.out / "student")]
    flags += ["--eval_strategy", "no"]  # no validation data: the student is scored once, on test
    if run.test is not None:
        flags += ["--test_file", str(run.data_dir / "test.jsonl")]
    if run.task.name == "ner":
        # teacher_logits are per token; the CRF scores whole paths, so the student trains without it.
        flags += ["--tag_names", *run.labels, "--tag_scheme", run.data_args.tag_scheme, "--crf", "false"]
    return flags


def train_runtime(folder: Path) -> float | None:
    """The Trainer's own training time (``train_runtime``, its last log entry) of the run saved in ``folder``."""
    state = folder / "trainer_state.json"
    if not state.is_file():
        return None
    logged = [e["train_runtime"] for e in json.loads(state.read_text()).get("log_history", []) if "train_runtime" in e]
    return logged[-1] if logged else None
