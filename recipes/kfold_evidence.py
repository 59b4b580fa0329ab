"""K-fold evidence: what the competition systems built on one recipe give over the single model, per seed, on the
same examples, with their costs; with several seeds, each system's difference from the single model with its
interval over seeds and examples.

    python recipes/kfold_evidence.py --recipe classification --seeds 3 --folds 5 --full_fit_seeds 3 \\
        --output_dir evidence/kfold_cls -- --max_train_samples 200 --num_train_epochs 10 --max_seq_length 128
    python recipes/kfold_evidence.py --recipe ner --seeds 3 --folds 5 --unlabeled_fraction 0.5 \\
        --teacher outputs/llm_ner_teacher --output_dir evidence/kfold_ner
    python recipes/kfold_evidence.py --recipe ner --seeds 1 --folds 2 --full_fit_seeds 2 --output_dir /tmp/kev -- \\
        --max_steps 2

The recipe's training split (flags after ``--`` are the recipe's: the demo by default) is cut once as the
self-training recipe cuts it (``--unlabeled_fraction`` left out, with the recipe's ``--split_seed``; 0 keeps all of
it): every system trains on the rest and is scored on the recipe's test split. Per seed s (``--seed s`` for every
run; each member's own seed derives from it):

- single: ``recipes/<recipe>.py`` on all the training data (``seed{s}/single/``);
- ensemble: ``recipes/kfold.py --folds K``, every fold model trained for the single model's optimizer steps
  (``--fold_steps match``), the mean of their probabilities (``seed{s}/kfold/``);
- full-fit seeds: ``--full_fit_seeds N`` models on all the training data, the single model's steps, ensembled
  (``seed{s}/kfold/full_fit/``);
- soup: the fold models' weights averaged into one model (``--soup``; ``seed{s}/kfold/soup/``);
- ensemble + rules: the ensemble with decision rules fitted on its out-of-fold predictions (classification:
  temperature and per-class bias; NER: per-type bias, or thresholds with a span head; ``seed{s}/kfold/rule/``);
- student: one model distilled from the ensemble's out-of-fold soft targets (``seed{s}/kfold/student/``), at one
  model's inference cost;
- teacher's student (``--teacher DIR``): the recipe with ``--teacher DIR``, distilling an external teacher (e.g. an
  LLM classifier) on the same data (``seed{s}/teacher_student/``);
- the trivial baseline (``recipes/baselines.py``: TF-IDF + logistic regression, the gazetteer), once.

Columns: the metric (mean ± std over seeds), its difference from the single model (seed s paired with seed s) with
the ablation's 95% interval, the ensemble minus the mean of its own members (what averaging adds), the test log
loss (classification, from each system's ``test_probabilities.npy``), and the costs: training seconds (the Trainer's
``train_runtime``, a system's training loops one after the other: the ensemble's K folds summed, the soup and the
rules adding nothing, the student adding its own) and test prediction seconds, each also relative to the single
model's. Folds trained at the same time (``--jobs`` > 1) share the machine and slow each other's loops: time with
``--jobs 1`` (or one GPU per job). Finished runs are not rerun (each runner's own resume, and a k-fold run that
finished with the same command is read back), so an interrupted evidence run resumes.

Writes ``kfold_evidence.md`` (the table) and ``kfold_evidence.json`` (every number, every run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import evidence
import numpy as np

from nlp_tricks.data import DataError, split_examples

from ensemble_folder import TASKS
from kfold_data import (
    RUNNER_FLAGS,
    cut_folds,
    example_record,
    jsonl_text,
    read_training_data,
    strip_flags,
    write_if_changed,
)
from sweep import run_one

HERE = Path(__file__).resolve().parent
BASELINES = {"ner": "gazetteer", "classification": "tfidf_lr"}
# The flags this script sets for every run: after --, they only choose the data it reads (the k-fold runner's own,
# but the tag scheme and span types, which the single model keeps as given).
DATA_FLAGS = tuple(name for name in RUNNER_FLAGS if name not in ("tag_scheme", "entity_types")) + (
    "seed",
    "num_folds",
    "fold",
    "teacher",
)
# system -> (its folder under seed{s}/, the k-fold results' key prefix of its costs, members' mean key prefix)
SYSTEMS = {
    "single": ("single", None, None),
    "ensemble": ("kfold", "", "fold_"),
    "full-fit seeds": ("kfold/full_fit", "full_fit_", "full_fit_seed_"),
    "soup": ("kfold/soup", "soup_", None),
    "ensemble + rules": ("kfold/rule", "rule_", None),
    "student": ("kfold/student", "student_", None),
    "teacher's student": ("teacher_student", None, None),
}


def prepare_data(task, recipe_flags: list[str], fraction: float, out: Path, folds: int) -> dict:
    """The training and test files every run reads, cut once (self-training's cut, the left-out share unused) and
    kept; a training share the k-fold run would refuse (a class with fewer examples than folds) is refused here,
    before anything trains."""
    data_args, _, _ = task.parse(strip_flags(recipe_flags, ("output_dir",)) + ["--output_dir", str(out)])
    data = read_training_data(task, data_args)
    if not data["test"]:
        raise DataError(None, None, "the evidence needs a test split: the demo's, or --test_file after --")
    train = data["train"]
    if fraction > 0:
        train, _ = split_examples(train, (1.0 - fraction, fraction), seed=data_args.split_seed)
    if len(train) < 2:
        raise DataError(data["sources"]["train"], None, f"--unlabeled_fraction {fraction} leaves nothing to train on")
    cut_folds(
        task,
        train,
        folds,
        data_args.split_seed,
        data["sources"]["train"],
        f"the training share of --unlabeled_fraction {fraction}: ",
    )
    files = {"train": out / "data" / "train.jsonl", "test": out / "data" / "test.jsonl"}
    write_if_changed(
        files["train"], jsonl_text([example_record(task, ex, data_args, i) for i, ex in enumerate(train)])
    )
    write_if_changed(
        files["test"],
        jsonl_text([example_record(task, ex, data_args, f"test{i}") for i, ex in enumerate(data["test"])]),
    )
    return {
        "files": files,
        "labels": data["labels"],
        "train": len(train),
        "test": len(data["test"]),
        "sources": data["sources"],
    }


def recipe_run_flags(task, recipe_flags: list[str], data: dict, seed: int) -> list[str]:
    flags = strip_flags(recipe_flags, DATA_FLAGS)
    flags += ["--train_file", str(data["files"]["train"]), "--test_file", str(data["files"]["test"])]
    flags += ["--seed", str(seed)]
    if task.name == "ner":
        flags += ["--tag_names", *data["labels"]]
    return flags


def kfold_command(args, task, flags: list[str], out: Path) -> list[str]:
    rules = ["temperature", "bias"] if task.name == "classification" else ["bias"]
    if task.name == "ner" and "--span_head" in flags:
        rules = ["threshold"]
    return [
        sys.executable,
        str(HERE / "kfold.py"),
        "--recipe",
        task.name,
        "--folds",
        str(args.folds),
        "--jobs",
        str(args.jobs),
        "--output_dir",
        str(out),
        "--full_fit_seeds",
        str(args.full_fit_seeds),
        "--soup",
        args.soup,
        "--fit_rule",
        *rules,
        "--distill",
        "true",
        "--",
        *flags,
    ]


def run_kfold(command: list[str], out: Path) -> dict:
    """The k-fold run of ``command`` in ``out`` (unless one finished with the same command: read back); its
    results."""
    record = out.parent / "kfold_command.json"
    results = out / "all_results.json"
    if results.is_file() and record.is_file() and json.loads(record.read_text()) == command[1:]:
        return json.loads(results.read_text())
    record.unlink(missing_ok=True)
    print(f"[kfold_evidence] {' '.join(command)}", flush=True)
    with open(out.parent / "kfold_log.txt", "w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (out.parent / "kfold_log.txt").read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"{out}: the k-fold run failed (exit {proc.returncode}):\n" + "\n".join(tail))
    record.write_text(json.dumps(command[1:]))
    return json.loads(results.read_text())


def run_seed(args, task, recipe_flags: list[str], data: dict, seed: int) -> dict:
    """One seed's systems: their folders, costs and member means."""
    out = Path(args.output_dir) / f"seed{seed}"
    flags = recipe_run_flags(task, recipe_flags, data, seed)
    recipe = str(Path(task.recipe.__file__).resolve())
    single = run_one(recipe, out / "single", flags, label="kfold_evidence")["results"]
    start = time.perf_counter()
    kfold = run_kfold(kfold_command(args, task, flags, out / "kfold"), out / "kfold")
    wall = time.perf_counter() - start
    results = {"single": single, "kfold": kfold}
    if args.teacher:
        results["teacher's student"] = run_one(
            recipe, out / "teacher_student", [*flags, "--teacher", args.teacher], label="kfold_evidence"
        )["results"]
    return {
        "seed": seed,
        "folders": {name: str(out / folder) for name, (folder, _, _) in systems(args).items()},
        **costs(results, args),
        "kfold_wall_seconds": wall,
    }


def systems(args) -> dict:
    return {name: spec for name, spec in SYSTEMS.items() if name != "teacher's student" or args.teacher}


def costs(results: dict, args) -> dict:
    """Per system: training seconds (its training loops, one after the other), test prediction seconds, and the
    test metric of the mean member (ensembles)."""
    single, kfold = results["single"], results["kfold"]
    folds_train = kfold["train_runtime"]
    train = {
        "single": single.get("train_runtime"),
        "ensemble": folds_train,
        "soup": folds_train,
        "ensemble + rules": folds_train,
        "full-fit seeds": kfold.get("full_fit_train_runtime"),
        "student": folds_train + (kfold.get("student_train_runtime") or 0.0),
    }
    predict = {
        "single": single.get("test_runtime"),
        "ensemble": kfold.get("test_predict_seconds"),
        "ensemble + rules": kfold.get("test_predict_seconds"),
        "full-fit seeds": kfold.get("full_fit_test_predict_seconds"),
        "soup": kfold.get("soup_test_predict_seconds"),
        "student": kfold.get("student_test_predict_seconds"),
    }
    if args.teacher:
        train["teacher's student"] = results["teacher's student"].get("train_runtime")
        predict["teacher's student"] = results["teacher's student"].get("test_runtime")
    members = {
        name: {
            k[len(prefix + "test_") : -len("_mean")]: v
            for k, v in kfold.items()
            if k.startswith(prefix + "test_") and k.endswith("_mean")
        }
        for name, (_, _, prefix) in SYSTEMS.items()
        if prefix
    }
    return {"train_seconds": train, "test_predict_seconds": predict, "member_means": members}


def test_nll(folder: str, labels: list[str]) -> float | None:
    """The log loss of a system's ``test_probabilities.npy`` against the gold labels of its predictions file (None
    without the file)."""
    path = Path(folder) / "test_probabilities.npy"
    if not path.is_file():
        return None
    from nlp_tricks.functional.decision_rules import negative_log_likelihood

    gold, _ = TASKS["classification"].read(Path(folder) / TASKS["classification"].predictions_file)
    return negative_log_likelihood(np.load(path), np.asarray([labels.index(g) for g in gold]))


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(task: str, metric: str, seeds: list[dict], args, labels: list[str] | None, resamples: int) -> list:
    """One row per system: its metric over the seeds, its difference from the single model (seed s paired with
    seed s) with the interval ``ablation`` uses, the ensemble minus its mean member, the test log loss, its costs
    relative to the single model."""
    names = list(systems(args))
    rows = {name: [evidence.example_rows(task, s["folders"][name], labels) for s in seeds] for name in names}
    method = "seeds and examples" if len(seeds) > 1 else "examples only"
    table = []
    for name in names:
        scores = [evidence.corpus_metric(task, metric, r) for r in rows[name]]
        if method == "seeds and examples":
            diff, low, high = evidence.seed_example_interval(task, metric, rows["single"], rows[name], resamples)
        else:
            diff, low, high = evidence.paired_bootstrap(task, metric, rows["single"][0], rows[name][0], resamples)
        member = _mean([s["member_means"].get(name, {}).get(metric) for s in seeds])
        table.append(
            {
                "system": name,
                "metric": statistics.fmean(scores),
                "per_seed": scores,
                "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                "difference": {
                    "value": diff,
                    "low": low,
                    "high": high,
                    "interval": method,
                    "significant": not (low <= 0.0 <= high),
                },
                "minus_mean_member": None if member is None else statistics.fmean(scores) - member,
                "test_nll": _mean([test_nll(s["folders"][name], labels) for s in seeds])
                if task == "classification"
                else None,
                "train_seconds": _mean([s["train_seconds"].get(name) for s in seeds]),
                "test_predict_seconds": _mean([s["test_predict_seconds"].get(name) for s in seeds]),
                "examples": int(rows[name][0].shape[0]),
            }
        )
    base = table[0]
    for row in table:
        for key in ("train_seconds", "test_predict_seconds"):
            ratio = row[key] / base[key] if row[key] and base[key] else None
            row[key.replace("seconds", "vs_single")] = ratio
    return table


def run_baseline(task, data: dict, out: Path, metric: str, labels: list[str] | None) -> dict:
    """The task's trivial baseline on the same training and test files (deterministic: one run)."""
    flags = [
        "--baseline",
        BASELINES[task.name],
        "--train_file",
        str(data["files"]["train"]),
        "--test_file",
        str(data["files"]["test"]),
    ]
    record = run_one(str(HERE / "baselines.py"), out / "baseline", flags, label="kfold_evidence")
    rows = evidence.example_rows(task.name, out / "baseline", labels)
    return {
        "system": f"trivial baseline: {BASELINES[task.name]}",
        "folder": str(out / "baseline"),
        "metric": evidence.corpus_metric(task.name, metric, rows),
        "wall_seconds": record["wall_seconds"],
    }


def _seconds(value, ratio) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f} ({ratio:.1f}x)" if ratio else f"{value:.1f}"


def write_markdown(table: list[dict], baseline: dict, metric: str, args, data: dict, path: Path) -> None:
    seeds = args.seeds
    spread = f"mean ± std over {seeds} seeds" if seeds > 1 else "one seed"
    interval = (
        "95% interval over seeds and examples (Student t over the per-seed paired differences plus a paired "
        "bootstrap over examples, as recipes/ablation.py)"
        if seeds > 1
        else "95% paired-bootstrap interval over examples only (one seed: it does not cover training randomness)"
    )
    lines = [
        f"{metric} on the test split ({table[0]['examples']} examples); {spread}. {data['train']} training examples "
        f"(--unlabeled_fraction {args.unlabeled_fraction} left out), {args.folds} folds (each the single model's "
        f"steps), {args.full_fit_seeds} full-fit seeds, a {args.soup} soup. Difference: minus the single model, seed "
        f"s paired with seed s; {interval}; * where it excludes 0. Ensemble - members: the system minus the mean of "
        "its own members' scores.",
        "",
        f"| system | {metric} | difference vs single | ensemble - members | test NLL | training s (vs single) | "
        "test prediction s (vs single) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        d = r["difference"]
        score = f"{r['metric']:.4f} ± {r['std']:.4f}" if seeds > 1 else f"{r['metric']:.4f}"
        mark = " *" if d["significant"] and r["system"] != "single" else ""
        members = "" if r["minus_mean_member"] is None else f"{r['minus_mean_member']:+.4f}"
        nll = "" if r["test_nll"] is None else f"{r['test_nll']:.4f}"
        lines.append(
            f"| {r['system']} | {score} | {d['value']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]{mark} | {members} | "
            f"{nll} | {_seconds(r['train_seconds'], r['train_vs_single'])} | "
            f"{_seconds(r['test_predict_seconds'], r['test_predict_vs_single'])} |"
        )
    gap = baseline["metric"] - table[0]["metric"]
    lines.append(f"| {baseline['system']} | {baseline['metric']:.4f} | {gap:+.4f} (against the mean) | | | | |")
    path.write_text("\n".join(lines) + "\n")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python recipes/kfold_evidence.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--recipe", required=True, choices=list(TASKS), help="the recipe compared")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 1 ... N; from 2 on the intervals cover seeds")
    parser.add_argument("--folds", type=int, default=5, help="folds of the ensemble (>= 2)")
    parser.add_argument("--full_fit_seeds", type=int, default=3, help="models on all the training data (>= 1)")
    parser.add_argument("--soup", default="uniform", choices=["uniform", "greedy"], help="the fold models' soup")
    parser.add_argument(
        "--teacher",
        default=None,
        help="an external teacher (model, ensemble folder or k-fold run over the same labels): adds "
        "the row of the recipe distilling it (--teacher)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="folds trained at a time (recipes/kfold.py --jobs)")
    parser.add_argument(
        "--unlabeled_fraction",
        type=float,
        default=0.0,
        help="share in [0, 1) of the training split left out (self-training's cut with the recipe's "
        "--split_seed; 0.5 keeps the labelled half of the earlier pseudo-label evidence)",
    )
    parser.add_argument("--output_dir", required=True, help="where seed{s}/ and the table go")
    parser.add_argument("--metric", default=None, help="the metric compared (default: the recipe's MAIN_METRIC)")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the intervals")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.folds < 2 or args.jobs < 1 or args.full_fit_seeds < 1:
        parser.error("--seeds >= 1, --folds >= 2, --full_fit_seeds >= 1 and --jobs >= 1")
    if not 0.0 <= args.unlabeled_fraction < 1.0:
        parser.error(f"--unlabeled_fraction {args.unlabeled_fraction}: it must be in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parse(argv[: argv.index("--")] if "--" in argv else argv)
    task = TASKS[args.recipe]
    metric = args.metric or getattr(task.recipe, "MAIN_METRIC", "f1")
    out = Path(args.output_dir)
    try:
        data = prepare_data(task, recipe_flags, args.unlabeled_fraction, out, args.folds)
        seeds = [run_seed(args, task, recipe_flags, data, seed) for seed in range(1, args.seeds + 1)]
        labels = data["labels"] if task.name == "classification" else None
        baseline = run_baseline(task, data, out, metric, labels)
    except (DataError, RuntimeError) as err:
        print(f"kfold_evidence: {err}", file=sys.stderr)
        return 1
    table = summarize(task.name, metric, seeds, args, labels, args.resamples)
    report = {
        "recipe": task.name,
        "metric": metric,
        "folds": args.folds,
        "full_fit_seeds": args.full_fit_seeds,
        "soup": args.soup,
        "teacher": args.teacher,
        "unlabeled_fraction": args.unlabeled_fraction,
        "data": {k: v if not isinstance(v, dict) else {n: str(p) for n, p in v.items()} for k, v in data.items()},
        "recipe_flags": recipe_flags,
        "rows": table,
        "baseline": baseline,
        "seeds": seeds,
    }
    (out / "kfold_evidence.json").write_text(json.dumps(report, indent=2))
    write_markdown(table, baseline, metric, args, data, out / "kfold_evidence.md")
    print((out / "kfold_evidence.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
