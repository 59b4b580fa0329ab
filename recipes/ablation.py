"""Ablation: run a recipe once per trick configuration, seed (and learning rate), then tabulate and plot.

    python recipes/ablation.py --recipe ner --seeds 3 --output_dir ablation/ner
    python recipes/ablation.py --recipe ner --seeds 3 --lrs 3e-5,5e-5,1e-4 --output_dir ablation/ner
    python recipes/ablation.py --recipe ner --seeds 1 --max_steps 20 --output_dir /tmp/abl -- --max_train_samples 64

Each run is ``python recipes/<recipe>.py --output_dir <dir>/<config>/lr<lr>/seed<s> --seed <s>
[--learning_rate lr] <config flags> <flags after -->`` (the file of the recipe module it imports), one after another.
A run that finished with the same flags is not rerun, so an interrupted ablation resumes where it stopped (and a call
with a subset of ``--configurations`` tabulates finished runs). Writes ``ablation.md`` (mean ± std of the main
metric, time per step and peak memory relative to the baseline), ``ablation.png`` (bars with error bars) and
``ablation.json`` (every run).

Fair comparison: FGM and PGD add the clean and adversarial gradients, which acts like a larger step, so a table at
one learning rate can credit a trick with a learning-rate effect. With ``--lrs`` the table shows both the result at
the first learning rate of the list and each configuration's best learning rate, chosen on validation and reported
on test.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

# configuration name -> recipe flags. Plain data: add a row to ablate another trick.
CONFIGURATIONS = {
    "baseline": [],
    "fgm": ["--adversarial", "fgm"],
    "pgd": ["--adversarial", "pgd"],
    "focal": ["--loss_type", "focal"],
    "label_smoothing": ["--loss_type", "label_smoothing", "--label_smoothing_factor", "0.1"],
    "layer_decay": ["--layer_decay", "0.9"],
}


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


def run_one(recipe: ModuleType, run_dir: Path, flags: list[str]) -> dict:
    """Run the recipe once (unless its all_results.json exists); return its results plus time and memory."""
    results_path = run_dir / "all_results.json"
    record_path = run_dir / "ablation_run.json"
    if results_path.is_file() and record_path.is_file():
        record = json.loads(record_path.read_text())
        if record.get("flags") == flags:
            return record
        print(f"[ablation] {run_dir}: finished with other flags, running it again", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, recipe.__file__, "--output_dir", str(run_dir), *flags]
    print(f"[ablation] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(run_dir / "ablation_log.txt", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not results_path.is_file():
        tail = (run_dir / "ablation_log.txt").read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"{run_dir}: the recipe failed (exit {proc.returncode}):\n" + "\n".join(tail))
    results = json.loads(results_path.read_text())
    state_path = run_dir / "trainer_state.json"
    steps = json.loads(state_path.read_text()).get("global_step") if state_path.is_file() else None
    record = {
        "flags": flags,
        "results": results,
        "wall_seconds": wall,
        "train_seconds_per_step": results.get("train_runtime", wall) / steps if steps else None,
        "peak_memory_mb": usage.ru_maxrss / 1024,  # Linux: KiB
    }
    record_path.write_text(json.dumps(record, indent=2))
    return record


def _metric(results: dict, metric: str, split: str) -> float | None:
    for key in (f"{split}_{metric}", f"predict_{metric}" if split == "test" else None):
        if key and key in results:
            return float(results[key])
    return None


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: dict, metric: str, lrs: list[str]) -> list[dict]:
    """One row per configuration: same-lr and best-lr metric (mean ± std over seeds), cost relative to baseline."""
    rows = []
    for config, by_lr in runs.items():
        row = {"configuration": config}
        per_lr = {}
        for lr, records in by_lr.items():
            evals = [_metric(r["results"], metric, "eval") for r in records]
            tests = [_metric(r["results"], metric, "test") for r in records]
            tests = tests if all(t is not None for t in tests) else evals
            per_lr[lr] = {"eval": _mean_std(evals), "test": _mean_std(tests)}
        row["same_lr"] = per_lr[lrs[0]]["test"]
        best_lr = max(per_lr, key=lambda lr: per_lr[lr]["eval"][0])
        row["best_lr"], row["best"] = best_lr, per_lr[best_lr]["test"]
        records = by_lr[lrs[0]]
        row["seconds_per_step"] = statistics.fmean(r["train_seconds_per_step"] or 0.0 for r in records)
        row["peak_memory_mb"] = statistics.fmean(r["peak_memory_mb"] for r in records)
        rows.append(row)
    base = next((r for r in rows if r["configuration"] == "baseline"), rows[0])
    for row in rows:
        row["time_vs_baseline"] = (
            row["seconds_per_step"] / base["seconds_per_step"] if base["seconds_per_step"] else None
        )
        row["memory_vs_baseline"] = row["peak_memory_mb"] / base["peak_memory_mb"]
    return rows


def write_markdown(rows: list[dict], metric: str, lrs: list[str], seeds: int, path: Path) -> None:
    sweep = len(lrs) > 1
    head = f"| configuration | {metric} (lr {lrs[0]}) |"
    rule = "|---|---|"
    if sweep:
        head += f" {metric} (best lr, chosen on validation) | best lr |"
        rule += "---|---|"
    head += " time / step vs baseline | peak memory vs baseline |"
    rule += "---|---|"
    lines = [
        f"Mean ± std over {seeds} seed(s); test split (validation where the recipe has no test split).",
        "",
        head,
        rule,
    ]
    for r in rows:
        line = f"| {r['configuration']} | {r['same_lr'][0]:.4f} ± {r['same_lr'][1]:.4f} |"
        if sweep:
            line += f" {r['best'][0]:.4f} ± {r['best'][1]:.4f} | {r['best_lr']} |"
        t = f"{r['time_vs_baseline']:.2f}x" if r["time_vs_baseline"] else "n/a"
        line += f" {t} | {r['memory_vs_baseline']:.2f}x |"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")


def write_plot(rows: list[dict], metric: str, lrs: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('[ablation] matplotlib is missing (pip install "nlp-tricks[plot]"): no ablation.png', file=sys.stderr)
        return False
    names = [r["configuration"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4), dpi=110)
    width = 0.4 if len(lrs) > 1 else 0.6
    ax.bar(
        [i - (width / 2 if len(lrs) > 1 else 0) for i in x],
        [r["same_lr"][0] for r in rows],
        width,
        yerr=[r["same_lr"][1] for r in rows],
        capsize=4,
        label=f"lr {lrs[0]}",
    )
    if len(lrs) > 1:
        ax.bar(
            [i + width / 2 for i in x],
            [r["best"][0] for r in rows],
            width,
            yerr=[r["best"][1] for r in rows],
            capsize=4,
            label="best lr",
        )
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel(metric)
    ax.set_title(f"Ablation: {metric} per configuration (mean ± std over seeds)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python recipes/ablation.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", required=True, help="ner, classification, summarization, or a recipe .py path")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds per configuration (1, 2, ...)")
    parser.add_argument("--output_dir", required=True, help="where runs, ablation.md and ablation.png go")
    parser.add_argument("--lrs", default=None, help="comma-separated learning rates to sweep, e.g. 3e-5,5e-5,1e-4")
    parser.add_argument("--max_steps", type=int, default=None, help="passed to every run (quick ablations)")
    parser.add_argument(
        "--configurations",
        default=None,
        help=f"comma-separated subset of: {', '.join(CONFIGURATIONS)} (and the recipe's own, e.g. summarization: "
        "scheduled_sampling, untied)",
    )
    parser.add_argument("--metric", default=None, help="main metric (default: f1 for ner/classification, rougeL)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")

    try:
        recipe = load_recipe(args.recipe)
    except FileNotFoundError as err:
        print(f"ablation: {err}", file=sys.stderr)
        return 1
    configs = default_configurations(recipe)
    if args.configurations:
        wanted = args.configurations.split(",")
        unknown = [c for c in wanted if c not in configs]
        if unknown:
            parser.error(f"--configurations: unknown {unknown}; choose from {list(configs)}")
        configs = {c: configs[c] for c in wanted}
    lrs = args.lrs.split(",") if args.lrs else ["default"]
    metric = args.metric or getattr(recipe, "MAIN_METRIC", "f1")
    out = Path(args.output_dir)

    runs: dict[str, dict[str, list[dict]]] = {}
    try:
        for config, config_flags in configs.items():
            for lr in lrs:
                for seed in range(1, args.seeds + 1):
                    flags = ["--seed", str(seed), *config_flags, *recipe_flags]
                    if lr != "default":
                        flags += ["--learning_rate", lr]
                    if args.max_steps is not None:
                        flags += ["--max_steps", str(args.max_steps)]
                    record = run_one(recipe, out / config / f"lr{lr}" / f"seed{seed}", flags)
                    runs.setdefault(config, {}).setdefault(lr, []).append(record)
    except RuntimeError as err:
        print(f"ablation: {err}", file=sys.stderr)
        return 1

    rows = summarize(runs, metric, lrs)
    (out / "ablation.json").write_text(
        json.dumps({"metric": metric, "lrs": lrs, "rows": rows, "runs": runs}, indent=2)
    )
    write_markdown(rows, metric, lrs, args.seeds, out / "ablation.md")
    write_plot(rows, metric, lrs, out / "ablation.png")
    print((out / "ablation.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
