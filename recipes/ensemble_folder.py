"""A k-fold ensemble folder (written by ``recipes/kfold.py``) that predicts like one model through the recipes.

    python recipes/ner.py --model_name_or_path outputs/kfold_ner --do_train false --test_file new.conll
    python recipes/classification.py --model_name_or_path outputs/kfold_cls --do_train false \\
        --train_file train.csv --test_file new.csv --output_dir outputs/predicted

The folder holds its fold models (``fold0/`` ...) and a small manifest, ``kfold_ensemble.json``, naming them, the
label list and the rule that combines them (``nlp_tricks.ensemble``):

- classification: the mean of the members' class probabilities; the prediction is its argmax
  (``test_probabilities.npy`` holds the mean, float32, columns in the label order);
- NER: per word (its first sub-token's logits, so members with different tokenizers agree on the words), the mean
  of the members' softmax probabilities; members with a CRF: their mean word emissions and mean start / transition /
  end scores, decoded once by Viterbi; with ``--ensemble_vote T`` at k-fold time: the entities at least a share T of
  the members predict.
- NER with a span head (``--span_head``): per span of words and type, the mean of the members' raw span scores
  (word-level, first sub-tokens), decoded once as the members were trained (every span with mean score > 0, or with
  ``span_flat`` the non-overlapping set with the highest total); ``--ensemble_vote T`` votes on their spans.

Each member is loaded with its own tokenizer and predicts each split in turn (one model in memory at a time), with
the recipe's collator and ``--per_device_eval_batch_size``, so a member predicts exactly what it predicts alone. The
output folder gets ``test_predictions.*`` in the recipe's format and ``all_results.json`` with the ``eval_`` /
``test_`` metrics of the ensemble (recomputed from those predictions).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import numpy as np

from nlp_tricks.data import DataError

from common.peft import ADAPTER_CONFIG
from ensemble_ner import NerEnsembleTask, NerSpanEnsembleTask
from ensemble_tasks import ClassificationEnsembleTask, EnsembleTask, MemberOutput, check_member_labels

# The recipes, the k-fold runner and the tests read these here; the tasks live in ensemble_tasks.py (the protocol,
# classification) and ensemble_ner.py (NER: words, CRFs, spans).
__all__ = [
    "MANIFEST",
    "TASKS",
    "ClassificationEnsembleTask",
    "EnsembleTask",
    "MemberOutput",
    "NerEnsembleTask",
    "NerSpanEnsembleTask",
    "is_ensemble_folder",
    "predict_members",
    "predict_with_ensemble",
    "prediction_args",
    "read_manifest",
    "rescore",
    "task_of_members",
    "write_manifest",
]


MANIFEST = "kfold_ensemble.json"
MANIFEST_KIND = "nlp_tricks k-fold ensemble"


# ---- The manifest -------------------------------------------------------------------------------------------------


def is_ensemble_folder(path: str | Path | None) -> bool:
    """Whether ``path`` is a folder holding a k-fold ensemble manifest (``kfold_ensemble.json``)."""
    return bool(path) and (Path(path) / MANIFEST).is_file()


def write_manifest(folder: Path, recipe: str, members: list[str], labels: list[str], vote: float | None) -> None:
    """The manifest of an ensemble folder: its recipe, its members (folders relative to it), labels and rule."""
    from common import write_json_atomic

    write_json_atomic(
        folder / MANIFEST,
        {
            "kind": MANIFEST_KIND,
            "recipe": recipe,
            "members": members,
            "labels": list(labels),
            "ensemble_vote": vote,
        },
    )


def read_manifest(folder: str | Path, recipe: str) -> dict:
    """The manifest of ``folder``, checked: the recipe it was trained with, every member folder present."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(path, None, f"cannot read the ensemble manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise DataError(path, None, f'not a k-fold ensemble manifest (no "kind": {MANIFEST_KIND!r})')
    for key in ("recipe", "members", "labels"):
        if key not in manifest:
            raise DataError(path, None, f"the manifest has no {key!r}")
    if manifest["recipe"] != recipe:
        raise DataError(
            path, None, f"an ensemble of the {manifest['recipe']} recipe; predict with recipes/{manifest['recipe']}.py"
        )
    if not manifest["members"]:
        raise DataError(path, None, "the manifest names no members")
    for member in manifest["members"]:
        # A model folder, or one holding an adapter saved alone (--peft lora --merge_lora false) with its base's path.
        if not any((Path(folder) / member / name).is_file() for name in ("config.json", ADAPTER_CONFIG)):
            raise DataError(path, None, f"member {member!r}: no model in {Path(folder) / member}")
    return manifest


# ---- The members ---------------------------------------------------------------------------------------------------


def prediction_args(training_args, output_dir: str | Path):
    """A copy of the recipe's arguments for prediction only: no signal handlers, nothing saved."""
    from transformers import IntervalStrategy

    args = copy.deepcopy(training_args)
    args.output_dir = str(output_dir)
    args.enable_jit_checkpoint = False
    args.eval_strategy = IntervalStrategy.NO
    args.load_best_model_at_end = False
    return args


TASKS: dict[str, EnsembleTask] = {"ner": NerEnsembleTask(), "classification": ClassificationEnsembleTask()}


def task_of_members(recipe: str, folder: str | Path, members: list[str]) -> EnsembleTask:
    """The task that combines an ensemble folder's members: the recipe's, or for NER members saved with a span head
    :class:`NerSpanEnsembleTask` decoding as they do; members of both kinds, or flat and nested, are refused."""
    task = TASKS[recipe]
    if recipe != "ner":
        return task
    saved = [task.recipe.saved_span_head(str(Path(folder) / member)) for member in members]
    if all(settings is None for settings in saved):
        return task
    manifest = Path(folder) / MANIFEST
    if any(settings is None for settings in saved):
        raise DataError(manifest, None, "the ensemble mixes members with and without a span head; train them alike")
    flats = {bool(settings.get("span_flat", False)) for settings in saved}
    if len(flats) != 1:
        raise DataError(
            manifest, None, "the ensemble mixes span members that decode flat (span_flat) and nested; train them alike"
        )
    return NerSpanEnsembleTask(flats.pop())


def predict_members(
    task: EnsembleTask,
    folders: list[Path],
    splits: dict[str, list[dict]],
    labels: list[str],
    data_args,
    model_args,
    args,
    seconds: dict[str, float] | None = None,
) -> dict[str, list[MemberOutput]]:
    """``{split: [one MemberOutput per member]}``: each member loaded in turn (one in memory at a time) and run on
    every split; ``seconds[split]`` (when given) adds up the time spent predicting each split."""
    import gc

    out: dict[str, list[MemberOutput]] = {split: [] for split in splits}
    for folder in folders:
        model, tokenizer = task.load_member(folder, model_args, labels)
        for split, examples in splits.items():
            start = time.perf_counter()
            out[split].append(task.predict(model, tokenizer, examples, labels, data_args, args))
            if seconds is not None:
                seconds[split] = seconds.get(split, 0.0) + time.perf_counter() - start
        del model
        gc.collect()
    return out


def rescore(task: EnsembleTask, path: Path, labels: list[str]) -> dict[str, float]:
    """The task's metrics of a predictions file, read back: gold and predicted as written."""
    gold, predicted = task.read(path)
    return task.score(gold, predicted, labels)


# ---- The recipes' entry point -------------------------------------------------------------------------------------


def _model_flag(argv: list[str]) -> str | None:
    """The value of ``--model_name_or_path`` on a command line (the last one wins, as argparse reads it), or in the
    YAML / JSON config file given first."""
    value = None
    if argv and argv[0].endswith((".yaml", ".yml", ".json")) and Path(argv[0]).is_file():
        try:
            import yaml

            config = yaml.safe_load(Path(argv[0]).read_text(encoding="utf-8"))
            if isinstance(config, dict) and isinstance(config.get("model_name_or_path"), str):
                value = config["model_name_or_path"]
        except Exception:  # the recipe's own parser reports an unreadable config file
            pass
    for i, arg in enumerate(argv):
        if arg == "--model_name_or_path" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--model_name_or_path="):
            value = arg.split("=", 1)[1]
    return value


def predict_with_ensemble(recipe: str, argv: list[str] | None = None) -> bool:
    """Run the recipe's prediction with the ensemble when ``--model_name_or_path`` names an ensemble folder; return
    whether it did (False: a plain model, the recipe goes on as usual).

    Writes ``test_predictions.*`` (the ensemble's), classification ``test_probabilities.npy`` (the mean of the
    members' probabilities), and ``all_results.json`` with the ensemble's ``eval_`` / ``test_`` metrics recomputed
    from its predictions, into ``--output_dir``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    folder = _model_flag(argv)
    if not is_ensemble_folder(folder):
        return False
    from common import is_main_process, prepare_output_dir, write_json_atomic

    task = TASKS[recipe]
    data_args, model_args, training_args = task.parse(argv, predict_only=True)
    if training_args.do_train:
        raise DataError(
            None, None, f"--model_name_or_path {folder} is a k-fold ensemble: it predicts; add --do_train false"
        )
    if getattr(data_args, "multi_label", False):
        raise DataError(
            None, None, f"--model_name_or_path {folder}: a single-label k-fold ensemble; drop --multi_label"
        )
    manifest = read_manifest(folder, recipe)
    task = task_of_members(recipe, folder, manifest["members"])
    labels = manifest["labels"]
    for member in manifest["members"]:  # every member's labels checked before any member predicts
        check_member_labels(Path(folder) / member, labels)
    out = Path(training_args.output_dir)
    prepare_output_dir(out, data_args.overwrite_output_dir, reads=(folder,))
    splits, sources = task.read_eval_splits(data_args, labels)
    if not splits:
        raise DataError(None, None, "nothing to predict: give --test_file (or --validation_file)")
    folders = [Path(folder) / member for member in manifest["members"]]
    outputs = predict_members(
        task, folders, splits, labels, data_args, model_args, prediction_args(training_args, out)
    )
    if not is_main_process():
        return True
    out.mkdir(parents=True, exist_ok=True)
    from kfold_rules import apply_rule, read_rule

    results, rule = {}, read_rule(folder)  # a decision rule stored with the folder (recipes/kfold.py --fit_rule)
    for split, examples in splits.items():
        if rule is None:
            predictions = task.combine(outputs[split], labels, manifest.get("ensemble_vote"))
            probabilities = task.probabilities(outputs[split]) if recipe == "classification" else None
        else:
            predictions, probabilities = apply_rule(task, rule, outputs[split], labels)
        prefix = "eval" if split == "validation" else "test"
        if split == "test":
            task.write(out / task.predictions_file, examples, predictions, data_args)
            if probabilities is not None:
                np.save(out / "test_probabilities.npy", probabilities)
        scores = task.score(task.gold(examples), predictions, labels, data_args)
        results.update({f"{prefix}_{key}": value for key, value in scores.items()})
        results[f"{prefix}_samples"] = len(examples)
    results.update(
        {
            "data_files": sources,
            "label_list": labels,
            "ensemble": {
                "folder": str(folder),
                "members": manifest["members"],
                "ensemble_vote": manifest.get("ensemble_vote"),
                "decision_rule": None if rule is None else {k: rule[k] for k in ("rules", "beta", "fitted_on")},
            },
        }
    )
    write_json_atomic(out / "all_results.json", results)
    shown = [f"{prefix}_{key}" for prefix in ("eval", "test") for key in task.metrics]
    print(f"[ensemble] {len(folders)} members: " + ", ".join(f"{k} {results[k]:.4f}" for k in shown if k in results))
    return True
