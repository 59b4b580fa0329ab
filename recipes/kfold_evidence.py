"""K-fold evidence: a single model vs the K-fold ensemble vs the ensemble with one pseudo-label round vs its
distilled student, per seed, on the same examples, with their wall times; with several seeds, each system's
difference from the single model with its interval over seeds and examples.

    python recipes/kfold_evidence.py --recipe ner --seeds 3 --folds 5 --unlabeled_fraction 0.5 \\
        --output_dir evidence/kfold_ner
    python recipes/kfold_evidence.py --recipe classification --seeds 3 --folds 5 --unlabeled_fraction 0.5 \\
        --output_dir evidence/kfold_cls -- --max_train_samples 200 --num_train_epochs 5 --max_seq_length 128 \\
        --eval_strategy no
    python recipes/kfold_evidence.py --recipe ner --seeds 1 --folds 2 --output_dir /tmp/kev -- --max_steps 2

The recipe's training split (flags after ``--`` are the recipe's: the demo by default) is cut as the self-training
recipe cuts it (``--unlabeled_fraction``, with the recipe's ``--split_seed``): the labelled share trains every
system, the rest, labels removed, is the unlabelled text of the pseudo-labels and the student. Every system is
scored on the recipe's test split. Per seed s (``--seed s`` for every run):

- single: ``recipes/<recipe>.py`` on all the labelled data (``seed{s}/single/``);
- ensemble: ``recipes/kfold.py --folds K`` on it (``seed{s}/kfold/round0/``);
- ensemble + pseudo-labels: its second round, each fold also trained on the unlabelled text labelled by its own
  first-round model (``seed{s}/kfold/``);
- student: one model distilled from that ensemble on the labelled and unlabelled text (``seed{s}/kfold/student/``).

Costs: training seconds (the Trainer's ``train_runtime``, a system's training loops one after the other: the
ensemble's K folds summed, pseudo-labels adding the second round, the student adding its own training to all of
that) and test prediction seconds (the ensemble: all K models); the JSON also holds whole-process wall times.
Folds trained at the same time (``--jobs`` > 1) share the machine and slow each other's loops: time with
``--jobs 1`` (or one GPU per job).
Finished runs are not rerun (the runners' own resume), so an interrupted evidence run resumes.

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

from nlp_tricks.data import DataError, split_examples

from ensemble_folder import TASKS
from kfold_data import cut_folds, example_record, jsonl_text, read_training_data, strip_flags, write_if_changed
from sweep import run_one

HERE = Path(__file__).resolve().parent
SYSTEMS = ("single", "ensemble", "ensemble + pseudo-labels", "student")
# The flags this script sets for every run: after --, they only choose the data it reads.
DATA_FLAGS = ("output_dir", "overwrite_output_dir", "train_file", "validation_file", "test_file", "dataset_name",
              "dataset_config_name", "max_train_samples", "max_eval_samples", "split_seed", "tag_names", "seed",
              "num_folds", "fold")  # fmt: skip


def prepare_data(task, recipe_flags: list[str], fraction: float, out: Path, folds: int) -> dict:
    """The labelled / unlabelled / test files every run reads, cut once (self-training's cut) and kept; a labelled
    share the k-fold run would refuse (a class with fewer examples than folds) is refused here, before the single
    model trains."""
    data_args, _, _ = task.parse(strip_flags(recipe_flags, ("output_dir",)) + ["--output_dir", str(out)])
    data = read_training_data(task, data_args)
    if not data["test"]:
        raise DataError(None, None, "the evidence needs a test split: the demo's, or --test_file after --")
    labelled, unlabeled = split_examples(data["train"], (1.0 - fraction, fraction), seed=data_args.split_seed)
    if len(labelled) < 2 or not unlabeled:
        raise DataError(data["sources"]["train"], None, f"--unlabeled_fraction {fraction} leaves nothing to compare")
    cut_folds(task, labelled, folds, data_args.split_seed, data["sources"]["train"],
              f"the labelled share of --unlabeled_fraction {fraction}: ")  # fmt: skip
    column = data_args.tokens_column if task.name == "ner" else data_args.text_column
    key = "tokens" if task.name == "ner" else "text"
    files = {"labelled": out / "data" / "labelled.jsonl", "unlabeled": out / "data" / "unlabeled.jsonl",
             "test": out / "data" / "test.jsonl"}  # fmt: skip
    write_if_changed(
        files["labelled"], jsonl_text([example_record(task, ex, data_args, i) for i, ex in enumerate(labelled)])
    )
    write_if_changed(
        files["unlabeled"], jsonl_text([{"id": f"unlabeled{i}", column: ex[key]} for i, ex in enumerate(unlabeled)])
    )
    write_if_changed(
        files["test"],
        jsonl_text([example_record(task, ex, data_args, f"test{i}") for i, ex in enumerate(data["test"])]),
    )
    return {"files": files, "labels": data["labels"], "labelled": len(labelled), "unlabeled": len(unlabeled),
            "test": len(data["test"]), "sources": data["sources"]}  # fmt: skip


def run_seed(args, task, recipe_flags: list[str], data: dict, seed: int) -> dict:
    """One seed's four systems: their folders and costs."""
    out = Path(args.output_dir) / f"seed{seed}"
    files = data["files"]
    flags = strip_flags(recipe_flags, DATA_FLAGS)
    flags += ["--train_file", str(files["labelled"]), "--test_file", str(files["test"]), "--seed", str(seed)]
    if task.name == "ner":
        flags += ["--tag_names", *data["labels"]]
    single = run_one(str(Path(task.recipe.__file__).resolve()), out / "single", flags)
    command = [sys.executable, str(HERE / "kfold.py"), "--recipe", task.name, "--folds", str(args.folds), "--jobs",
               str(args.jobs), "--output_dir", str(out / "kfold"), "--unlabeled_file", str(files["unlabeled"]),
               "--pseudo_label_rounds", "1", "--distill", "true", "--", *flags]  # fmt: skip
    print(f"[kfold_evidence] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(out / "kfold_log.txt", "w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (out / "kfold_log.txt").read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"{out / 'kfold'}: the k-fold run failed (exit {proc.returncode}):\n" + "\n".join(tail))
    kfold = json.loads((out / "kfold" / "all_results.json").read_text())
    first = kfold["rounds"][0]
    return {
        "seed": seed,
        "folders": {
            "single": str(out / "single"),
            "ensemble": str(out / "kfold" / "round0"),
            "ensemble + pseudo-labels": str(out / "kfold"),
            "student": str(out / "kfold" / "student"),
        },
        # The Trainer's training loops (train_runtime), one after the other: loading and tokenizing left out.
        "train_seconds": {
            "single": single["results"]["train_runtime"],
            "ensemble": first["train_runtime"],
            "ensemble + pseudo-labels": first["train_runtime"] + kfold["train_runtime"],
            "student": first["train_runtime"] + kfold["train_runtime"] + kfold["student_train_runtime"],
        },
        "test_predict_seconds": {
            "single": single["results"].get("test_runtime"),
            "ensemble": first["test_predict_seconds"],
            "ensemble + pseudo-labels": kfold["test_predict_seconds"],
            "student": kfold["student_test_predict_seconds"],
        },
        # Whole processes: the k-fold run of this invocation (its folds --jobs at a time, and the student; a resumed
        # run skips what had finished) and the single run when it ran.
        "kfold_wall_seconds": time.perf_counter() - start,
        "single_wall_seconds": single["wall_seconds"],
    }


def summarize(task: str, metric: str, seeds: list[dict], labels: list[str] | None, resamples: int) -> list[dict]:
    """One row per system: its metric over the seeds, its difference from the single model (seed s paired with
    seed s) with the interval ``ablation`` uses, and its costs relative to the single model."""
    rows = {name: [evidence.example_rows(task, s["folders"][name], labels) for s in seeds] for name in SYSTEMS}
    method = "seeds and examples" if len(seeds) > 1 else "examples only"
    table = []
    for name in SYSTEMS:
        scores = [evidence.corpus_metric(task, metric, r) for r in rows[name]]
        if method == "seeds and examples":
            diff, low, high = evidence.seed_example_interval(task, metric, rows["single"], rows[name], resamples)
        else:
            diff, low, high = evidence.paired_bootstrap(task, metric, rows["single"][0], rows[name][0], resamples)
        train = statistics.fmean(s["train_seconds"][name] for s in seeds)
        predict = [s["test_predict_seconds"][name] for s in seeds if s["test_predict_seconds"][name] is not None]
        table.append(
            {
                "system": name,
                "metric": statistics.fmean(scores),
                "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                "per_seed": scores,
                "difference": {
                    "value": diff,
                    "low": low,
                    "high": high,
                    "interval": method,
                    "significant": not (low <= 0.0 <= high),
                },  # fmt: skip
                "train_seconds": train,
                "test_predict_seconds": statistics.fmean(predict) if predict else None,
                "examples": int(rows[name][0].shape[0]),
            }
        )
    base = table[0]
    for row in table:
        row["train_vs_single"] = row["train_seconds"] / base["train_seconds"] if base["train_seconds"] else None
        row["predict_vs_single"] = (
            row["test_predict_seconds"] / base["test_predict_seconds"]
            if row["test_predict_seconds"] and base["test_predict_seconds"]
            else None
        )
    return table


def write_markdown(table: list[dict], metric: str, args, data: dict, path: Path) -> None:
    seeds = args.seeds
    spread = f"mean ± std over {seeds} seeds" if seeds > 1 else "one seed"
    interval = (
        "95% interval over seeds and examples (Student t over the per-seed paired differences plus a paired "
        "bootstrap over examples, as recipes/ablation.py)"
        if seeds > 1
        else "95% paired-bootstrap interval over examples only (one seed: it does not cover training randomness)"
    )
    lines = [
        f"{metric} on the test split ({table[0]['examples']} examples); {spread}. {data['labelled']} labelled "
        f"training examples, {data['unlabeled']} unlabelled (--unlabeled_fraction {args.unlabeled_fraction}), "
        f"{args.folds} folds. Difference: minus the single model, seed s paired with seed s; {interval}; * where "
        "it excludes 0.",
        "",
        "| system | " + metric + " | difference vs single | training s (vs single) | test prediction s (vs single) |",
        "|---|---|---|---|---|",
    ]
    for r in table:
        d = r["difference"]
        score = f"{r['metric']:.4f} ± {r['std']:.4f}" if seeds > 1 else f"{r['metric']:.4f}"
        mark = " *" if d["significant"] and r["system"] != "single" else ""
        train = f"{r['train_seconds']:.1f} ({r['train_vs_single']:.1f}x)" if r["train_vs_single"] else "n/a"
        if r["test_predict_seconds"] is None:
            predict = "n/a"
        else:
            ratio = f" ({r['predict_vs_single']:.1f}x)" if r["predict_vs_single"] else ""
            predict = f"{r['test_predict_seconds']:.2f}{ratio}"
        lines.append(
            f"| {r['system']} | {score} | {d['value']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]{mark} | {train} | "
            f"{predict} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python recipes/kfold_evidence.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--recipe", required=True, choices=list(TASKS), help="the recipe compared")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 1 ... N; from 2 on the intervals cover seeds")
    parser.add_argument("--folds", type=int, default=5, help="folds of the ensemble (>= 2)")
    parser.add_argument("--jobs", type=int, default=1, help="folds trained at a time (recipes/kfold.py --jobs)")
    parser.add_argument(
        "--unlabeled_fraction",
        type=float,
        default=0.9,
        help="share in (0, 1) of the training split held out as unlabelled text (the self-training recipe's cut; "
        "its demo holds out 0.9)",
    )
    parser.add_argument("--output_dir", required=True, help="where seed{s}/ and the table go")
    parser.add_argument("--metric", default=None, help="the metric compared (default: the recipe's MAIN_METRIC)")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the intervals")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.folds < 2 or args.jobs < 1:
        parser.error("--seeds >= 1, --folds >= 2 and --jobs >= 1")
    if not 0.0 < args.unlabeled_fraction < 1.0:
        parser.error(f"--unlabeled_fraction {args.unlabeled_fraction}: it must be in (0, 1)")
    task = TASKS[args.recipe]
    metric = args.metric or getattr(task.recipe, "MAIN_METRIC", "f1")
    out = Path(args.output_dir)
    try:
        data = prepare_data(task, recipe_flags, args.unlabeled_fraction, out, args.folds)
        seeds = [run_seed(args, task, recipe_flags, data, seed) for seed in range(1, args.seeds + 1)]
    except (DataError, RuntimeError) as err:
        print(f"kfold_evidence: {err}", file=sys.stderr)
        return 1
    labels = data["labels"] if task.name == "classification" else None
    table = summarize(task.name, metric, seeds, labels, args.resamples)
    report = {
        "recipe": task.name,
        "metric": metric,
        "folds": args.folds,
        "unlabeled_fraction": args.unlabeled_fraction,
        "data": {k: v if not isinstance(v, dict) else {n: str(p) for n, p in v.items()} for k, v in data.items()},
        "recipe_flags": recipe_flags,
        "rows": table,
        "seeds": seeds,
    }
    (out / "kfold_evidence.json").write_text(json.dumps(report, indent=2))
    write_markdown(table, metric, args, data, out / "kfold_evidence.md")
    print((out / "kfold_evidence.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
