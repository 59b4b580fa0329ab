"""Ablation: run a recipe once per trick configuration, seed, learning rate (and fold), then tabulate and plot.

    python recipes/ablation.py --recipe ner --seeds 3 --output_dir ablation/ner
    python recipes/ablation.py --recipe ner --folds 5 --seeds 1 --lrs 1.5e-4,3e-4 --jobs 2 --output_dir ablation/ner_cv
    python recipes/ablation.py --recipe ner --seeds 1 --max_steps 20 --output_dir /tmp/abl -- --max_train_samples 64

Each run is ``python recipes/<recipe>.py --output_dir <dir>/<config>/lr<lr>/seed<s>[/fold<k>] --seed <s>
[--learning_rate lr] [--num_folds K --fold k] <config flags> <flags after -->`` (the file of the recipe module it
imports); ``--jobs N`` runs N at a time, each on one torch thread (or with GPUs, each on its own GPU), and
``--backend ray`` runs each as a Ray task on a cluster (``recipes/sweep.py``; docs/evidence.md, "Sweeps on a
cluster"). A run that finished with the same flags is not rerun, so an interrupted ablation resumes where it
stopped; a failed run loses no other (the others finish, the failed ones are named with the end of their logs, in
``failed_runs.txt`` too, and no table is written). Each run's record names where it ran (``node``). The recipe's
trivial baselines (``recipes/baselines.py``: NER gazetteer, classification TF-IDF + logistic regression,
summarization copy and lead-3) run on the same splits as rows of the table.

Protocol:

- ``--folds K`` (single-split data): the data is cut into K folds once (``--split_seed``); every configuration runs
  on the same folds and seeds, so comparisons are paired; every example is predicted once by a model that did not
  see it, and the metric is computed on the pooled test predictions of all folds.
- Learning rates (``--lrs``) are chosen per configuration and fold on that fold's validation part (a tenth of its
  training data, or the recipe's validation split without folds), never on a test fold; the table shows the
  first learning rate of the list and the chosen one.
- Every configuration runs on the baseline's seeds and folds, so seed s, fold k of a trick is paired with seed s,
  fold k of the baseline. With ``--seeds`` S >= 2 the difference from ``baseline`` (the mean of the per-seed
  differences) comes with a 95% interval over seeds and examples (``evidence.seed_example_interval``): the spread
  of the S paired differences (Student t, Welch-Satterthwaite degrees of freedom) plus a paired bootstrap over
  examples (sentences, texts, documents; ``--resamples``, default 1000) for the examples drawn; a ``*`` (the
  interval excludes zero) then means the difference exceeds what seeds and examples explain. With one seed the
  interval is the paired bootstrap over examples only, and the table says so: it does not cover training
  randomness.
- The yardstick: the baseline again with seeds S+1 ... 2S (same folds and flags), paired with seeds 1 ... S, is a
  row of the table (``--no_yardstick`` leaves it out). No trick differs there, so its difference is seed noise;
  under the seed-and-example interval it should not be starred (about 1 ablation in 20 is, by chance).

Writes ``ablation.md`` (the table), ``ablation.png`` (the differences with their intervals) and ``ablation.json``
(every run, every row).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
from argparse import ArgumentTypeError
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import evidence
import numpy as np
from transformers.hf_argparser import string_to_bool

import sweep
from common import TrickError, load_trick, trick_specs
from sweep import finished_record, run_one  # noqa: F401  (their home was this file: callers import them from here)

# configuration name -> recipe flags. Plain data: add a row to ablate another trick.
CONFIGURATIONS = {
    "baseline": [],
    "fgm": ["--adversarial", "fgm"],
    "pgd": ["--adversarial", "pgd"],
    "awp": ["--adversarial", "awp"],
    "freelb": ["--adversarial", "freelb"],
    "rdrop": ["--rdrop_alpha", "1.0"],
    "sam": ["--sam_rho", "0.05"],
    "asam": ["--sam_rho", "1.0", "--sam_adaptive", "true"],
    "smart": ["--smart_alpha", "1.0"],
    "focal": ["--loss_type", "focal"],
    "label_smoothing": ["--loss_type", "label_smoothing", "--label_smoothing_factor", "0.1"],
    "layer_decay": ["--layer_decay", "0.9"],
    "ema": ["--ema_decay", "0.999"],
    # The 3 newest of the saves every 50 steps (weights only), averaged into the final model.
    "swa": "--save_strategy steps --save_steps 50 --save_total_limit 3 --save_only_model true --swa_last_k 3".split(),
}
# task -> its trivial baselines (recipes/baselines.py --baseline NAME), run as rows beside the models
TRIVIAL_BASELINES = {"ner": ["gazetteer"], "classification": ["tfidf_lr"], "summarization": ["copy", "lead3"]}
BASELINES_SCRIPT = Path(__file__).resolve().with_name("baselines.py")


def load_recipe(name: str) -> ModuleType:
    """The recipe module: ``ner`` / ``classification`` / ``summarization`` beside this file, or a ``.py`` path.

    A recipe module names its ``MAIN_METRIC`` and may add ``ABLATION_CONFIGURATIONS`` to the common ones.
    """
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"recipe {name!r}: no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        raise FileNotFoundError(f"recipe {name!r}: no recipes/{name}.py") from None


def default_configurations(recipe: ModuleType) -> dict[str, list[str]]:
    return {**CONFIGURATIONS, **getattr(recipe, "ABLATION_CONFIGURATIONS", {})}


def _metric(results: dict, metric: str, split: str) -> float | None:
    for key in (f"{split}_{metric}", f"predict_{metric}" if split == "test" else None):
        if key and key in results:
            return float(results[key])
    return None


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


# ---- Tables ---------------------------------------------------------------------------------------------------------


INTERVAL_LINES = {
    "seeds and examples": "95% interval over seeds and examples (the spread of the per-seed paired differences, "
    "Student t, plus a paired bootstrap over examples): * where it excludes 0, a difference beyond seed noise",
    "examples only": "95% paired-bootstrap interval over examples only (one seed: it does not cover training "
    "randomness)",
}


def interval_method(seeds: int) -> str:
    """The interval the table uses: over seeds and examples from two seeds on, over examples with one."""
    return "seeds and examples" if seeds > 1 else "examples only"


def summarize(
    runs: dict, task: str, metric: str, lrs: list[str], resamples: int = 1000, reference: str = "baseline"
) -> list[dict]:
    """One row per configuration (and trivial baseline, and the yardstick).

    ``runs[config][lr][seed][fold]`` is a run record. Per fold, the learning rate with the best validation metric
    (mean over seeds) is chosen; the test predictions of the folds are pooled per seed; the row holds the pooled
    metric (mean ± std over seeds) at the first and at the chosen learning rate, the difference from ``reference``
    with its interval (:func:`interval_method`; seeds paired in sorted order: the i-th seed of a configuration with
    the i-th of ``reference``), and the cost relative to it.
    """
    labels = _classification_labels(runs) if task == "classification" else None
    rows_cache: dict[str, np.ndarray] = {}

    def example_rows(record: dict) -> np.ndarray:
        if record["run_dir"] not in rows_cache:
            rows_cache[record["run_dir"]] = evidence.example_rows(task, record["run_dir"], labels)
        return rows_cache[record["run_dir"]]

    def pooled(by_lr: dict, chosen: dict[str, str]) -> list[np.ndarray]:
        seeds = sorted(next(iter(by_lr.values())))
        return [np.concatenate([example_rows(by_lr[chosen[f]][s][f]) for f in sorted(chosen)]) for s in seeds]

    table, per_seed_rows = [], {}
    for config, by_lr in runs.items():
        folds = sorted(next(iter(next(iter(by_lr.values())).values())))
        chosen = {}
        for fold in folds:

            def validation(lr: str, fold=fold, by_lr=by_lr) -> float:
                return statistics.fmean(_metric(r[fold]["results"], metric, "eval") or 0.0 for r in by_lr[lr].values())

            chosen[fold] = max(by_lr, key=validation)
        first = lrs[0] if lrs[0] in by_lr else next(iter(by_lr))
        at_first = pooled(by_lr, {f: first for f in folds})
        at_chosen = pooled(by_lr, chosen)
        per_seed_rows[config] = at_chosen
        records = [r for by_seed in by_lr[first].values() for r in by_seed.values()]
        steps = [r["train_seconds_per_step"] for r in records if r["train_seconds_per_step"]]
        table.append(
            {
                "configuration": config,
                "seeds": sorted(next(iter(by_lr.values()))),
                "same_lr": _mean_std([evidence.corpus_metric(task, metric, r) for r in at_first]),
                "best": _mean_std([evidence.corpus_metric(task, metric, r) for r in at_chosen]),
                "best_lr": sorted(set(chosen.values())),
                "examples": int(at_chosen[0].shape[0]),
                "seconds_per_step": statistics.fmean(steps) if steps else None,
                "peak_memory_mb": statistics.fmean(r["peak_memory_mb"] for r in records),
            }
        )
    base = next((r for r in table if r["configuration"] == reference), table[0])
    base_rows = per_seed_rows[base["configuration"]]
    method = interval_method(len(base_rows))
    for row in table:
        rows = per_seed_rows[row["configuration"]]
        if len(rows) != len(base_rows):
            raise ValueError(f"{row['configuration']}: {len(rows)} seeds, the baseline {len(base_rows)}: not paired")
        if method == "seeds and examples":
            diff, low, high = evidence.seed_example_interval(task, metric, base_rows, rows, resamples)
        else:
            diff, low, high = evidence.paired_bootstrap(task, metric, base_rows[0], rows[0], resamples)
        row["difference"] = {
            "value": diff,
            "low": low,
            "high": high,
            "significant": not (low <= 0.0 <= high),
            "interval": method,
        }
        row["time_vs_baseline"] = (
            row["seconds_per_step"] / base["seconds_per_step"]
            if row["seconds_per_step"] and base["seconds_per_step"]
            else None
        )
        row["memory_vs_baseline"] = row["peak_memory_mb"] / base["peak_memory_mb"]
    return table


def _classification_labels(runs: dict) -> list[str]:
    """Every label in any classification predictions file, so all rows share one column layout."""
    labels = set()
    for by_lr in runs.values():
        for by_seed in by_lr.values():
            for by_fold in by_seed.values():
                for record in by_fold.values():
                    labels.update(evidence.classification_rows(Path(record["run_dir"]) / "test_predictions.csv")[1])
    return sorted(labels)


def write_markdown(table: list[dict], metric: str, lrs: list[str], seeds: int, folds: int | None, path: Path) -> None:
    """The table: one row per configuration. With one learning rate there is nothing to choose, so the chosen-lr
    columns are left out; with one seed there is no spread, so no ``± std``."""
    split = f"pooled test predictions of {folds} folds" if folds else "the test split"
    sweep = len(lrs) > 1

    def score(mean_std: tuple[float, float]) -> str:
        return f"{mean_std[0]:.4f} ± {mean_std[1]:.4f}" if seeds > 1 else f"{mean_std[0]:.4f}"

    spread = f"mean ± std over {seeds} seeds" if seeds > 1 else "one seed"
    chosen = "chosen lr minus baseline" if sweep else "minus baseline"
    lines = [
        f"{metric} on {split} ({table[0]['examples']} examples); {spread}. Difference: {chosen} (seed s paired with "
        "the baseline's seed s, on the same folds). Time and memory at the first lr.",
        "",
        f"Interval: {INTERVAL_LINES[interval_method(seeds)]}.",
        "",
        f"| configuration | {metric} (lr {lrs[0]}) |"
        + (f" {metric} (lr chosen on validation) | chosen lr |" if sweep else "")
        + " difference vs baseline | time / step vs baseline | peak memory vs baseline |",
        "|---|---|" + ("---|---|" if sweep else "") + "---|---|---|",
    ]
    for r in table:
        d = r["difference"]
        mark = " *" if d["significant"] and r["configuration"] != "baseline" else ""
        t = f"{r['time_vs_baseline']:.2f}x" if r["time_vs_baseline"] else "n/a"
        best = f" {score(r['best'])} | {', '.join(r['best_lr'])} |" if sweep else ""
        name = r["configuration"]
        if name == YARDSTICK:
            name = f"{YARDSTICK}: baseline, seed {', '.join(map(str, r['seeds']))}"
        lines.append(
            f"| {name} | {score(r['same_lr'])} |{best} {d['value']:+.4f} [{d['low']:+.4f}, "
            f"{d['high']:+.4f}]{mark} | {t} | {r['memory_vs_baseline']:.2f}x |"
        )
    if any(r["configuration"] == YARDSTICK for r in table):
        lines += [
            "",
            f"{YARDSTICK}: the baseline with other seeds (same folds and flags), paired with the baseline's: no trick "
            "differs, so its difference is what seeds alone do"
            + (" (with one seed, read every * against it)." if seeds == 1 else "."),
        ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(table: list[dict], metric: str, path: Path) -> bool:
    """The differences from the baseline with their 95% intervals, one bar per configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('[ablation] matplotlib is missing (pip install "nlp-tricks[plot]"): no ablation.png', file=sys.stderr)
        return False
    rows = [r for r in table if r["configuration"] != "baseline"]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4), dpi=110)
    x = range(len(rows))
    values = [r["difference"]["value"] for r in rows]
    errors = [
        [v - r["difference"]["low"] for v, r in zip(values, rows)],
        [r["difference"]["high"] - v for v, r in zip(values, rows)],
    ]
    colors = ["tab:green" if r["difference"]["significant"] else "tab:gray" for r in rows]
    ax.bar(list(x), values, 0.6, yerr=errors, capsize=4, color=colors)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), [r["configuration"] for r in rows], rotation=25, ha="right")
    ax.set_ylabel(f"{metric} minus baseline")
    method = rows[0]["difference"].get("interval", "examples only")
    ax.set_title(
        f"Difference from the baseline, 95% interval over {method}\n(green: the interval excludes 0)", fontsize=9
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ---- The runner -----------------------------------------------------------------------------------------------------


YARDSTICK = "yardstick"


class PlannedRun(NamedTuple):
    configuration: str
    lr: str
    seed: int
    fold: int | None
    script: str
    run_dir: Path
    flags: list[str]
    env: dict | None = None  # the run's environment; None: this process's (the executor adds threads and GPUs)


def plan_runs(
    script: str,
    configs: dict[str, list[str]],
    lrs: list[str],
    seeds: int,
    folds: int | None,
    out: Path,
    recipe_flags: list[str] = (),
    max_steps: int | None = None,
    trivial_baselines: list[str] = (),
    yardstick: bool = True,
    plain_flags: list[str] = (),
) -> list[PlannedRun]:
    """Every run of an ablation, nothing started: each configuration (``configs``: name -> recipe flags, the
    baseline first) at each learning rate, seed 1 ... ``seeds`` and fold, with the same flags but its own; the
    yardstick (the baseline's flags with seeds ``seeds`` + 1 ... 2 ``seeds``, in the baseline's folder, so a later
    ablation with more seeds reuses them); the trivial baselines once per fold (deterministic). ``plain_flags`` go
    first in every model run (``--tricks none``: the baseline is the plain recipe, whatever it turns on by default)."""
    fold_list = list(range(folds)) if folds else [None]
    plan = []

    def add(configuration: str, config_flags: list[str], seed: int, lr: str, fold: int | None, folder: str) -> None:
        flags = ["--seed", str(seed), *plain_flags, *config_flags, *recipe_flags]
        if lr != "default":
            flags += ["--learning_rate", lr]
        if max_steps is not None:
            flags += ["--max_steps", str(max_steps)]
        run_dir = out / folder / f"lr{lr}" / f"seed{seed}"
        if fold is not None:
            flags += ["--num_folds", str(folds), "--fold", str(fold)]
            run_dir = run_dir / f"fold{fold}"
        plan.append(PlannedRun(configuration, lr, seed, fold, script, run_dir, flags))

    for config, config_flags in configs.items():
        for lr in lrs:
            for seed in range(1, seeds + 1):
                for fold in fold_list:
                    add(config, config_flags, seed, lr, fold, config)
    if yardstick:
        for lr in lrs:
            for seed in range(seeds + 1, 2 * seeds + 1):
                for fold in fold_list:
                    add(YARDSTICK, configs["baseline"], seed, lr, fold, "baseline")
    for name in trivial_baselines:
        for fold in fold_list:  # deterministic: one run per fold stands for every seed and lr
            flags = ["--baseline", name, *recipe_flags]
            run_dir = out / name
            if fold is not None:
                flags += ["--num_folds", str(folds), "--fold", str(fold)]
                run_dir = run_dir / f"fold{fold}"
            plan.append(PlannedRun(name, "-", 1, fold, str(BASELINES_SCRIPT), run_dir, flags))
    return plan


def parse_added_configuration(text: str) -> tuple[str, list[str]]:
    """``NAME=FLAGS`` (``awp_late=--adversarial awp --adv_start_step 36``) -> ``("awp_late", [flags])``."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not name or not flags.split() or "/" in name or name in (YARDSTICK, "baseline"):
        raise ValueError(f"{text!r}: expected NAME=FLAGS, e.g. 'awp_late=--adversarial awp --adv_start_step 36'")
    return name, flags.split()


def multi_label_requested(flags: list[str]) -> bool:
    """Whether recipe ``flags`` switch ``--multi_label`` on (``--multi_label``, ``--multi_label true``, ``=true``)."""
    for i, flag in enumerate(flags):
        name, _, value = flag.partition("=")
        if name.replace("-", "_") != "__multi_label":
            continue
        if not value and i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value = flags[i + 1]
        return not value or string_to_bool(value)  # as the recipe's HfArgumentParser reads it
    return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = _parser()
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.folds is not None and args.folds < 2:
        parser.error("--folds must be >= 2")
    problem = sweep.check_arguments(args)
    if problem:
        parser.error(problem)
    try:
        recipe = load_recipe(args.recipe)
    except FileNotFoundError as err:
        print(f"ablation: {err}", file=sys.stderr)
        return 1
    task = Path(recipe.__file__).stem
    _refuse_multi_label(parser, task, recipe_flags)
    configs = _configurations(parser, args, recipe, task)
    _check_user_tricks(parser, {f"configuration {name}": flags for name, flags in configs.items()}, recipe_flags)
    lrs = args.lrs.split(",") if args.lrs else ["default"]
    metric = args.metric or getattr(recipe, "MAIN_METRIC", "f1")
    out = Path(args.output_dir)
    jobs = plan_runs(
        recipe.__file__,
        configs,
        lrs,
        args.seeds,
        args.folds,
        out,
        recipe_flags,
        max_steps=args.max_steps,
        trivial_baselines=[] if args.no_trivial_baselines else TRIVIAL_BASELINES.get(task, []),
        yardstick=not args.no_yardstick,
        # The recipes' evidence defaults (e.g. NER's CRF) off: every row is the plain recipe plus its own flags.
        plain_flags=["--tricks", "none"] if hasattr(recipe, "EVIDENCE_DEFAULTS") else [],
    )
    if args.dry_run:
        return _dry_run(jobs)
    runs = _run(args, jobs, out, metric, task)
    if runs is None:
        return 1
    return _tabulate(args, runs, task, metric, lrs, out)


def _parser() -> argparse.ArgumentParser:
    """The runner's own flags (the recipe's go after ``--``)."""
    parser = argparse.ArgumentParser(
        prog="python recipes/ablation.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", required=True, help="ner, classification, summarization, or a recipe .py path")
    parser.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="seeds per configuration (1, 2, ...); from 2 on, the intervals cover seeds and examples; with 1, "
        "examples only",
    )
    parser.add_argument("--folds", type=int, default=None, help="K-fold cross-validation of single-split data")
    parser.add_argument("--output_dir", required=True, help="where runs, ablation.md and ablation.png go")
    parser.add_argument("--lrs", default=None, help="comma-separated learning rates to sweep, e.g. 3e-5,5e-5,1e-4")
    parser.add_argument("--max_steps", type=int, default=None, help="passed to every run (quick ablations)")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (>= 1000 recommended)")
    parser.add_argument(
        "--configurations",
        default=None,
        help=f"comma-separated subset of: {', '.join(CONFIGURATIONS)} (and the recipe's own, e.g. summarization: "
        "scheduled_sampling, untied)",
    )
    parser.add_argument(
        "--add_configuration",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more configuration, named and with its recipe flags, e.g. 'awp_late=--adversarial awp "
        "--adv_start_step 36' (repeatable; runs beside --configurations)",
    )
    parser.add_argument("--no_trivial_baselines", action="store_true", help="leave out the trivial baseline rows")
    parser.add_argument(
        "--no_yardstick",
        action="store_true",
        help="leave out the yardstick row (the baseline with seeds S+1 ... 2S, paired with seeds 1 ... S)",
    )
    parser.add_argument("--metric", default=None, help="main metric (default: the recipe's MAIN_METRIC)")
    parser.add_argument(
        "--dry_run", action="store_true", help="print the runs still to do and the counts; start nothing"
    )
    sweep.add_arguments(parser)
    return parser


def _refuse_multi_label(parser: argparse.ArgumentParser, task: str, recipe_flags: list[str]) -> None:
    try:
        multi_label = task == "classification" and multi_label_requested(recipe_flags)
    except ArgumentTypeError as err:
        parser.error(f"--multi_label: {err}")
    if multi_label:
        parser.error(
            "--multi_label: the ablation's per-example bootstrap and baselines score single-label classification only"
        )


def _configurations(parser: argparse.ArgumentParser, args, recipe: ModuleType, task: str) -> dict[str, list[str]]:
    """The configurations to run, the baseline first: the common ones and the recipe's (``--configurations``
    picks), and each ``--add_configuration``."""
    configs = default_configurations(recipe)
    if args.configurations:
        wanted = args.configurations.split(",")
        unknown = [c for c in wanted if c not in configs]
        if unknown:
            parser.error(f"--configurations: unknown {unknown}; choose from {list(configs)}")
        configs = {c: configs[c] for c in wanted}
    for text in args.add_configuration:
        try:
            name, flags = parse_added_configuration(text)
        except ValueError as err:
            parser.error(f"--add_configuration {err}")
        if name in TRIVIAL_BASELINES.get(task, []):
            parser.error(f"--add_configuration {text!r}: {name} is the name of a trivial baseline row")
        configs[name] = flags
    return {"baseline": configs.get("baseline", CONFIGURATIONS["baseline"]), **configs}


def _check_user_tricks(parser: argparse.ArgumentParser, configs: dict[str, list[str]], recipe_flags: list[str]):
    """Each ``--trick module:Class`` of the configurations and of the flags after ``--`` loaded here once, so a
    typo is one line before any run starts (the runs import it again, from this working directory)."""
    for where, flags in {**configs, "the flags after --": recipe_flags}.items():
        for spec in trick_specs(flags):
            try:
                load_trick(spec)
            except TrickError as err:
                parser.error(f"{where}: {err}")


def _dry_run(jobs: list[PlannedRun]) -> int:
    """Print the runs still to do and the counts; start nothing."""
    todo = [job for job in jobs if finished_record(job.run_dir, job.flags) is None]
    for job in todo:
        print(" ".join([Path(sys.executable).name, job.script, "--output_dir", str(job.run_dir), *job.flags]))
    print(f"[ablation] {len(jobs)} runs planned, {len(jobs) - len(todo)} finished, {len(todo)} to run")
    return 0


def _run(args, jobs: list[PlannedRun], out: Path, metric: str, task: str) -> dict | None:
    """Every run (the finished ones are not rerun): ``runs[config][lr][seed][fold]``, each run's record; ``None``
    when a run failed (the failures are printed)."""
    try:
        # Tiny runs are fastest on one thread each, and N of them at a time do not oversubscribe N cores.
        with sweep.make_executor(args, default_threads=lambda jobs: 1) as executor:
            print(f"[sweep] {len(jobs)} runs, {executor.describe()}", flush=True)
            outcomes = executor.run(jobs, out, metric, label="ablation")
    except sweep.SweepError as err:
        print(f"ablation: {err}", file=sys.stderr)
        return None
    if any(outcome.record is None for outcome in outcomes):
        print(f"ablation: {sweep.failure_report(outcomes, out)}", file=sys.stderr)
        return None
    sweep.forget_failures(out)
    runs: dict = {}
    for job, outcome in zip(jobs, outcomes):
        by_seed = runs.setdefault(job.configuration, {}).setdefault(job.lr, {})
        by_seed.setdefault(job.seed, {})[job.fold] = outcome.record
    for name in TRIVIAL_BASELINES.get(task, []):  # the same predictions for every seed
        if name in runs:
            runs[name]["-"] = {s: runs[name]["-"][1] for s in range(1, args.seeds + 1)}
    return runs


def _tabulate(args, runs: dict, task: str, metric: str, lrs: list[str], out: Path) -> int:
    """``ablation.json``, ``ablation.md`` (printed) and ``ablation.png``."""
    try:
        table = summarize(runs, task, metric, lrs, args.resamples)
    except ValueError as err:
        print(f"ablation: {err}", file=sys.stderr)
        return 1
    (out / "ablation.json").write_text(
        json.dumps(
            {
                "metric": metric,
                "lrs": lrs,
                "folds": args.folds,
                "seeds": args.seeds,
                "interval": interval_method(args.seeds),
                "rows": table,
                "runs": runs,
            },
            indent=2,
        )
    )
    write_markdown(table, metric, lrs, args.seeds, args.folds, out / "ablation.md")
    write_plot(table, metric, out / "ablation.png")
    print((out / "ablation.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
