"""Scores from the recipes' test-prediction files, per example, and paired bootstrap intervals between two systems.

Each task's predictions file is read back into one row of counts per example (a sentence, a text, a document), so
that a corpus metric is a function of summed rows: entity F1 from (true positives, predicted, gold) per sentence;
accuracy and macro-F1 from per-class counts per text; ROUGE-L as the mean of per-document F-measures. A paired
bootstrap resamples examples (the same resample for both systems) and recomputes the metric difference.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

PREDICTION_FILES = {
    "ner": "test_predictions.txt",
    "classification": "test_predictions.csv",
    "summarization": "test_predictions.jsonl",
}


# ---- Per-example rows -----------------------------------------------------------------------------------------------


def read_ner_predictions(path: str | Path) -> list[tuple[list[str], list[str]]]:
    """``[(gold tags, predicted tags)]`` per sentence of a ``token<TAB>gold<TAB>predicted`` file."""
    sentences, gold, pred = [], [], []
    for line in Path(path).read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            if gold:
                sentences.append((gold, pred))
            gold, pred = [], []
            continue
        fields = line.split("\t")
        gold.append(fields[-2])
        pred.append(fields[-1])
    if gold:
        sentences.append((gold, pred))
    return sentences


def ner_rows(path: str | Path) -> np.ndarray:
    """Per sentence: (entities right, entities predicted, gold entities, words right, words), the entities of tags
    in any scheme read by one rule (:func:`nlp_tricks.data.schemes.tags_to_spans`: conlleval's lenient reading, as
    seqeval's default mode; IOB1, IOB2, BIOES, BMES, BILOU), as the NER recipe scores them."""
    from nlp_tricks.data.schemes import tags_to_spans

    rows = []
    for gold, pred in read_ner_predictions(path):
        gold_entities, pred_entities = set(tags_to_spans(gold)), set(tags_to_spans(pred))
        right_words = sum(g == p for g, p in zip(gold, pred))
        rows.append(
            (len(gold_entities & pred_entities), len(pred_entities), len(gold_entities), right_words, len(gold))
        )
    return np.array(rows, dtype=np.float64).reshape(-1, 5)


def classification_rows(path: str | Path, labels: list[str] | None = None) -> tuple[np.ndarray, list[str]]:
    """Per text: 1 if right, then per class (predicted as it and right, predicted as it, gold is it)."""
    with Path(path).open(encoding="utf-8", newline="") as f:
        records = [(r["label"], r["predicted"]) for r in csv.DictReader(f)]
    labels = labels or sorted({g for g, _ in records} | {p for _, p in records})
    index = {label: i for i, label in enumerate(labels)}
    rows = np.zeros((len(records), 1 + 3 * len(labels)))
    for n, (gold, pred) in enumerate(records):
        rows[n, 0] = gold == pred
        rows[n, 1 + 3 * index[pred]] += gold == pred
        rows[n, 2 + 3 * index[pred]] += 1
        rows[n, 3 + 3 * index[gold]] += 1
    return rows, labels


def summarization_rows(path: str | Path) -> np.ndarray:
    """Per document: ROUGE-1, ROUGE-2 and ROUGE-L F-measures (rouge_score with stemming, as the recipe's metric)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            scores = scorer.score(record["reference"], record["prediction"])
            rows.append([scores[k].fmeasure for k in ("rouge1", "rouge2", "rougeL")])
    return np.array(rows, dtype=np.float64).reshape(-1, 3)


def example_rows(task: str, run_dir: str | Path, labels: list[str] | None = None) -> np.ndarray:
    """The per-example rows of the predictions file a recipe (or a baseline) wrote in ``run_dir``."""
    path = Path(run_dir) / PREDICTION_FILES[task]
    if task == "ner":
        return ner_rows(path)
    if task == "classification":
        return classification_rows(path, labels)[0]
    return summarization_rows(path)


# ---- Corpus metrics from summed rows --------------------------------------------------------------------------------


def metric(task: str, name: str, totals: np.ndarray, count: int) -> float | np.ndarray:
    """The corpus metric ``name`` from rows summed over ``count`` examples (see the row layouts above).

    ``totals`` is one summed row, or a stack of them (``(..., columns)``: one per bootstrap resample), which gives
    an array of metrics."""
    totals = np.asarray(totals, dtype=np.float64)
    if task == "ner":
        right, predicted, gold, right_words, words = np.moveaxis(totals, -1, 0)
        if name == "f1":
            return _ratio(2 * right, predicted + gold)
        if name == "precision":
            return _ratio(right, predicted)
        if name == "recall":
            return _ratio(right, gold)
        if name == "accuracy":
            return _ratio(right_words, words)
    elif task == "classification":
        if name == "accuracy":
            return _ratio(totals[..., 0], np.full(totals.shape[:-1], float(count)))
        if name == "f1":  # macro over the classes
            per_class = totals[..., 1:].reshape(*totals.shape[:-1], -1, 3)
            return _ratio(2 * per_class[..., 0], per_class[..., 1] + per_class[..., 2]).mean(axis=-1)
    elif task == "summarization":
        columns = {"rouge1": 0, "rouge2": 1, "rougeL": 2}
        if name in columns:
            return _ratio(totals[..., columns[name]], np.full(totals.shape[:-1], float(count)))
    raise ValueError(f"metric {name!r} is not defined for task {task!r}")


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> float | np.ndarray:
    """``numerator / denominator``, 0 where the denominator is 0 (no entity predicted, no example)."""
    numerator, denominator = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    out = np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)
    return float(out) if out.ndim == 0 else out


def corpus_metric(task: str, name: str, rows: np.ndarray) -> float:
    return float(metric(task, name, rows.sum(axis=0), len(rows)))


def paired_bootstrap(
    task: str, name: str, rows_a: np.ndarray, rows_b: np.ndarray, resamples: int = 1000, seed: int = 0
) -> tuple[float, float, float]:
    """``(difference, low, high)``: metric(b) - metric(a) on all examples, and the 2.5% / 97.5% percentiles of that
    difference over ``resamples`` resamples of the examples with replacement, the same resample for both systems
    (Koehn 2004; Efron & Tibshirani 1993). ``rows_a[i]`` and ``rows_b[i]`` must describe the same example."""
    if rows_a.shape[0] != rows_b.shape[0]:
        raise ValueError(f"paired rows differ in length: {rows_a.shape[0]} vs {rows_b.shape[0]} examples")
    n = rows_a.shape[0]
    difference = corpus_metric(task, name, rows_b) - corpus_metric(task, name, rows_a)
    counts = resample_counts(np.random.default_rng(seed), n, resamples)
    diffs = metric(task, name, counts @ rows_b, n) - metric(task, name, counts @ rows_a, n)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return difference, float(low), float(high)


# ---- Intervals that cover training randomness: paired seeds and examples --------------------------------------------


def resample_counts(rng: np.random.Generator, examples: int, resamples: int) -> np.ndarray:
    """``(resamples, examples)``: how often each example is drawn in each resample of ``examples`` draws with
    replacement (the draws in the order of one ``rng.integers(0, examples)`` call per resample)."""
    draws = rng.integers(0, examples, (resamples, examples)) + examples * np.arange(resamples)[:, None]
    return np.bincount(draws.ravel(), minlength=resamples * examples).reshape(resamples, examples).astype(np.float64)


def _check_paired(rows_a: list[np.ndarray], rows_b: list[np.ndarray]) -> int:
    if len(rows_a) != len(rows_b) or not rows_a:
        raise ValueError(f"paired seeds differ in number: {len(rows_a)} vs {len(rows_b)}")
    lengths = {rows.shape[0] for rows in (*rows_a, *rows_b)}
    if len(lengths) != 1:
        raise ValueError(f"paired rows differ in length: {sorted(lengths)} examples")
    return lengths.pop()


def _per_seed_differences(task: str, name: str, rows_a, rows_b, counts: np.ndarray) -> np.ndarray:
    """``(resamples, seeds)``: metric(b, seed s) - metric(a, seed s) on each resample of the examples."""
    n = counts.shape[1]
    return np.stack(
        [metric(task, name, counts @ b, n) - metric(task, name, counts @ a, n) for a, b in zip(rows_a, rows_b)],
        axis=1,
    )


def seed_example_interval(
    task: str,
    name: str,
    rows_a: list[np.ndarray],
    rows_b: list[np.ndarray],
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float, float]:
    """``(difference, low, high)`` of metric(b) - metric(a) over paired seeds: ``rows_a[s]`` and ``rows_b[s]`` are
    the per-example rows of seed s of each system (the same examples in the same order; seed s of one system is
    paired with seed s of the other, e.g. the same seed on the same folds).

    The difference is the mean over seeds of the per-seed differences. Its variance has two parts, added:

    - seeds: the sample variance of the per-seed differences over S (S - 1 degrees of freedom). It holds training
      randomness (a seed that moves a whole run) and which of these examples each run gets right by chance.
    - examples: the variance of the seed-mean difference over ``resamples`` bootstrap resamples of the examples (the
      same resample for every seed and both systems): which examples were drawn, common to every seed.

    The interval is the difference ± t · the standard error, t the Student quantile at the Welch-Satterthwaite
    degrees of freedom of the two parts (each with S - 1: between S - 1 and 2 (S - 1)). A percentile bootstrap over
    S = 3 seeds is too narrow (its distribution of the seed mean has 10 points, and all three differences share a sign
    in a quarter of the cases); ``python recipes/evidence.py`` simulates both (docs/evidence.md).
    """
    from scipy.stats import t as student_t

    n = _check_paired(rows_a, rows_b)
    seeds = len(rows_a)
    if seeds < 2:
        raise ValueError("seed_example_interval needs >= 2 seeds per system; with one, use paired_bootstrap")
    per_seed = np.array([corpus_metric(task, name, b) - corpus_metric(task, name, a) for a, b in zip(rows_a, rows_b)])
    difference = float(per_seed.mean())
    counts = resample_counts(np.random.default_rng(seed), n, resamples)
    covariance = np.cov(_per_seed_differences(task, name, rows_a, rows_b, counts), rowvar=False)
    # The example draw shared by every seed: the covariance of two seeds' differences across the resamples. (The
    # variance of one seed's difference also holds that run's luck on single examples, already in the seed part.)
    var_examples = max(float((covariance.sum() - np.trace(covariance)) / (seeds * (seeds - 1))), 0.0)
    var_seeds = float(per_seed.var(ddof=1)) / seeds
    total = var_seeds + var_examples
    if total == 0.0:
        return difference, difference, difference
    # Welch-Satterthwaite degrees of freedom, each part given S - 1: the example part too is estimated from these S
    # seeds' runs (the same borderline examples flip with every seed's shift, so its noise is the seeds').
    dof = total**2 * (seeds - 1) / (var_seeds**2 + var_examples**2)
    half = float(student_t.ppf(0.5 + level / 2, dof)) * total**0.5
    return difference, difference - half, difference + half


def hierarchical_bootstrap(
    task: str, name: str, rows_a: list[np.ndarray], rows_b: list[np.ndarray], resamples: int = 1000, seed: int = 0
) -> tuple[float, float, float]:
    """``(difference, low, high)``: the percentile interval of a two-level bootstrap, seeds then examples. Each
    resample draws S seeds with replacement (a drawn seed brings both systems' runs of it), then the examples (one
    draw for all), and averages the drawn seeds' differences. Kept to compare with :func:`seed_example_interval`: it
    is too narrow with few seeds (see the simulation in ``python recipes/evidence.py``)."""
    n = _check_paired(rows_a, rows_b)
    seeds = len(rows_a)
    rng = np.random.default_rng(seed)
    counts = resample_counts(rng, n, resamples)
    per_seed = _per_seed_differences(task, name, rows_a, rows_b, counts)
    weights = rng.multinomial(seeds, [1 / seeds] * seeds, size=resamples)
    diffs = (weights * per_seed).sum(axis=1) / seeds
    difference = float(
        np.mean([corpus_metric(task, name, b) - corpus_metric(task, name, a) for a, b in zip(rows_a, rows_b)])
    )
    low, high = np.percentile(diffs, [2.5, 97.5])
    return difference, float(low), float(high)


# ---- Simulation: which interval holds its 5% when the seeds move the runs -------------------------------------------


def synthetic_runs(
    rng: np.random.Generator,
    examples: int = 1000,
    seeds: int = 3,
    effect: float = 0.0,
    effect_sd: float = 0.0,
    seed_sd: float = 0.1,
    run_noise_sd: float = 0.3,
    ease_sd: float = 2.0,
    base: float = 1.5,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-example accuracy rows (one column: 1 if right) of systems a and b over ``seeds`` paired seeds.

    Example i is right in the run of system c with seed s when ``base + ease_i + gain_ci + shift_cs + noise_csi >
    0``: ``ease_i ~ N(0, ease_sd)`` is common to every run (runs agree on most examples, as trained models do),
    ``shift_cs ~ N(0, seed_sd)`` moves a whole run (training randomness), ``noise_csi ~ N(0, run_noise_sd)`` is the
    run's luck on one example, and ``gain_bi ~ N(effect, effect_sd)`` is system b's gain on example i (``gain_a`` =
    0): with ``effect=0, effect_sd=0`` the systems do not differ, and all of a difference is noise."""
    ease = rng.normal(0.0, ease_sd, examples)
    gain = {
        "a": np.zeros(examples),
        "b": rng.normal(effect, effect_sd, examples) if effect_sd else np.full(examples, effect),
    }
    rows = {}
    for system in ("a", "b"):
        rows[system] = [
            (base + ease + gain[system] + rng.normal(0.0, seed_sd) + rng.normal(0.0, run_noise_sd, examples) > 0)
            .astype(np.float64)
            .reshape(-1, 1)
            for _ in range(seeds)
        ]
    return rows["a"], rows["b"]


def expected_difference(
    effect: float = 0.0,
    effect_sd: float = 0.0,
    seed_sd: float = 0.1,
    run_noise_sd: float = 0.3,
    ease_sd: float = 2.0,
    base: float = 1.5,
    **_,
) -> float:
    """The accuracy difference b - a of :func:`synthetic_runs` in expectation over examples and seeds (what an
    interval should cover): P(right) = Phi(mean / sd of the sum of the normal terms)."""
    from scipy.stats import norm

    spread = ease_sd**2 + seed_sd**2 + run_noise_sd**2
    return float(norm.cdf((base + effect) / (spread + effect_sd**2) ** 0.5) - norm.cdf(base / spread**0.5))


INTERVAL_METHODS = ("examples only", "hierarchical bootstrap", "seeds and examples")


def interval_of(method: str, task: str, name: str, rows_a, rows_b, resamples: int = 1000, seed: int = 0):
    """``(difference, low, high)`` by ``method`` (one of :data:`INTERVAL_METHODS`); "examples only" is the paired
    bootstrap over examples of the seeds' predictions counted together (what one seed per configuration allows)."""
    if method == "examples only":  # the mean row: a corpus metric of summed rows may be a sum (accuracy, ROUGE)
        return paired_bootstrap(task, name, sum(rows_a) / len(rows_a), sum(rows_b) / len(rows_b), resamples, seed)
    if method == "hierarchical bootstrap":
        return hierarchical_bootstrap(task, name, rows_a, rows_b, resamples, seed)
    if method == "seeds and examples":
        return seed_example_interval(task, name, rows_a, rows_b, resamples, seed)
    raise ValueError(f"interval method {method!r}: choose from {INTERVAL_METHODS}")


def interval_rates(
    simulations: int = 300, resamples: int = 500, rng_seed: int = 0, methods=INTERVAL_METHODS, **scores
) -> dict[str, dict[str, float]]:
    """Per method, over ``simulations`` synthetic ablations (:func:`synthetic_runs` with ``scores``): the share whose
    95% interval excludes zero ("significant": with no effect the false-positive rate, which "95%" promises to be
    5%; with an effect the power) and the share that misses :func:`expected_difference` (5% promised)."""
    rng = np.random.default_rng(rng_seed)
    truth = expected_difference(**scores)
    hits = {method: {"significant": 0, "misses the truth": 0} for method in methods}
    for simulation in range(simulations):
        rows_a, rows_b = synthetic_runs(rng, **scores)
        for method in methods:
            _, low, high = interval_of(method, "classification", "accuracy", rows_a, rows_b, resamples, simulation)
            hits[method]["significant"] += not (low <= 0.0 <= high)
            hits[method]["misses the truth"] += not (low <= truth <= high)
    return {method: {k: v / simulations for k, v in counts.items()} for method, counts in hits.items()}


# Regimes of the simulation printed by `python recipes/evidence.py` (docs/evidence.md quotes its table): seed noise
# as in the classification yardstick (a seed moves one system's accuracy by about 0.018, the example-only interval of
# a seed difference is about +-0.015 wide), with no effect and with two effects; then a trick that helps some
# examples and hurts others (no mean gain: effect_sd) on models whose seeds barely move them.
SIMULATION_REGIMES = {
    "no effect, seed noise": {"seed_sd": 0.1},
    "effect +0.3 (accuracy +0.042), seed noise": {"seed_sd": 0.1, "effect": 0.3},
    "effect +0.6 (accuracy +0.080), seed noise": {"seed_sd": 0.1, "effect": 0.6},
    "per-example effects (sd 0.5), little seed noise": {"seed_sd": 0.02, "effect_sd": 0.5},
}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python recipes/evidence.py",
        description="Simulate synthetic ablations (1,000 examples, accuracy) and print, per interval method, how "
        "often its 95% interval excludes zero and how often it misses the true difference.",
    )
    parser.add_argument("--simulations", type=int, default=300, help="synthetic ablations per row")
    parser.add_argument("--resamples", type=int, default=300, help="bootstrap resamples per interval")
    parser.add_argument("--seeds", default="2,3,5", help="comma-separated seeds per system")
    args = parser.parse_args(argv)
    print(
        f"{args.simulations} simulations a row, {args.resamples} resamples an interval; cells: share significant "
        "(excludes 0) / share missing the true difference"
    )
    print()
    print("| regime | seeds | " + " | ".join(INTERVAL_METHODS) + " |")
    print("|---|---|" + "---|" * len(INTERVAL_METHODS))
    for regime, scores in SIMULATION_REGIMES.items():
        for seeds in map(int, args.seeds.split(",")):
            rates = interval_rates(args.simulations, args.resamples, seeds=seeds, **scores)
            cells = [f"{r['significant']:.1%} / {r['misses the truth']:.1%}" for r in rates.values()]
            print(f"| {regime} | {seeds} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
