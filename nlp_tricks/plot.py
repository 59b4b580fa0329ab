"""Training plots from a run's ``trainer_state.json``: losses, eval metrics, per-group learning rates, teacher forcing.

    nlp-tricks plot OUTPUT_DIR

Writes ``loss.png``, ``eval.png``, ``learning_rate.png`` and ``teacher_forcing.png`` (each only when the log has
such values) next to the ``trainer_state.json`` it read; a series the run did not log is named, with the reason, in
the notes (``nlp-tricks plot`` prints them) and, for the training loss, in ``loss.png`` itself. ``eval.png`` shows
the scores (F1, precision, recall, accuracy, ROUGE, ...; never support counts), per-entity F1 of NER runs in a panel
of its own, and metrics on another scale (``gen_len``) in a third; each curve of a panel has its own marker, hollow
and smaller than the one before, so curves that coincide (entity types stuck at 0) stay visible. A self-training
output folder gets ``self_training.png`` (teacher and students by round, and the pseudo-labels) and the plots of each
stage's ``round_<r>/{teacher,student}`` folder. Needs matplotlib (``pip install "nlp-tricks[plot]"``).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

__all__ = [
    "curve_style",
    "eval_panels",
    "find_trainer_state",
    "missing_series",
    "plot_run",
    "plot_self_training",
    "plot_trainer_state",
]

_NOT_METRICS = ("runtime", "per_second", "epoch", "step")
# The curves of one panel: marker shapes and line styles in turn, each marker smaller than the one before.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
_LINE_STYLES = ("-", "--", "-.", ":")
SELF_TRAINING_RESULTS = "self_training_results.json"
# The per-entity numbers of an NER run (nlp_tricks' recipes: eval_<TYPE>_<name>); `number` is the support count.
_ENTITY_NAMES = ("precision", "recall", "f1", "number")


def find_trainer_state(output_dir: str | Path) -> Path:
    """``OUTPUT_DIR/trainer_state.json``, else the one of its newest ``checkpoint-N`` folder."""
    output_dir = Path(output_dir)
    if output_dir.is_file():
        return output_dir
    direct = output_dir / "trainer_state.json"
    if direct.is_file():
        return direct
    checkpoints = sorted(
        (p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    for checkpoint in reversed(checkpoints):
        if (checkpoint / "trainer_state.json").is_file():
            return checkpoint / "trainer_state.json"
    if not output_dir.exists():
        raise FileNotFoundError(f"{output_dir}: no such file or folder")
    raise FileNotFoundError(f"{output_dir}: no trainer_state.json here or in a checkpoint-N folder")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path}: cannot read it as JSON ({str(err).splitlines()[0]})") from None


def _read_state(path: Path) -> dict:
    state = _read_json(path)
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
        raise ValueError(
            f"{path}: not a trainer state (no 'log_history' list); give a run's output_dir, a checkpoint-N folder, "
            f"its trainer_state.json or a self-training output_dir"
        )
    return state


def _series(log_history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [
        (entry.get("step", 0), entry[key])
        for entry in log_history
        if isinstance(entry.get(key), int | float) and not isinstance(entry.get(key), bool)
    ]
    return [s for s, _ in points], [v for _, v in points]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(title: str, ylabel: str):
    fig, ax = _pyplot().subplots(figsize=(7, 4), dpi=110)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def curve_style(index: int, count: int) -> dict:
    """The marker, its size and the line style of curve ``index`` of ``count`` in one panel: every curve is told
    apart where they coincide (hollow markers, each smaller than the one before, so they nest)."""
    return {
        "marker": _MARKERS[index % len(_MARKERS)],
        "markersize": 3.5 + 6.0 * (count - 1 - index) / max(count - 1, 1),
        "fillstyle": "none" if count > 1 else "full",
        "linestyle": _LINE_STYLES[index % len(_LINE_STYLES)],
    }


def _save(fig, ax, path: Path, written: list[Path]) -> None:
    ax.legend(fontsize=8, loc="best")
    _write(fig, path, written)


def _write(fig, path: Path, written: list[Path]) -> None:
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    written.append(path)


def eval_panels(keys) -> dict[str, list[str]]:
    """The evaluation metrics of a log, by panel: ``scores`` (values in [0, 1]: F1, precision, recall, accuracy,
    ROUGE, ...), ``entity_f1`` (an NER run's per-entity F1, ``eval_<TYPE>_f1``) and ``other`` (another scale:
    ``gen_len``, perplexity). Support counts (``eval_<TYPE>_number``), per-entity precision / recall, the loss and
    the timing numbers are left out. ``keys`` maps each key to its values (or is a set of keys: all go to
    ``scores``)."""
    values = keys if isinstance(keys, dict) else dict.fromkeys(keys, [])
    metrics = sorted(
        k for k in values if k.startswith("eval_") and k != "eval_loss" and not any(s in k for s in _NOT_METRICS)
    )
    entities = {k[len("eval_") : -len("_number")] for k in metrics if k.endswith("_number")}
    entity_keys = {f"eval_{entity}_{name}" for entity in entities for name in _ENTITY_NAMES}
    panels = {"scores": [], "entity_f1": [], "other": []}
    for key in metrics:
        if key in entity_keys:
            if key.endswith("_f1"):
                panels["entity_f1"].append(key)
        elif all(0.0 <= v <= 1.0 for v in values[key]):
            panels["scores"].append(key)
        else:
            panels["other"].append(key)
    return panels


def _plot_eval(history: list[dict], path: Path, written: list[Path]) -> None:
    keys = {k for entry in history for k in entry}
    panels = eval_panels({k: _series(history, k)[1] for k in keys})
    titles = {
        "scores": ("Evaluation", "score"),
        "entity_f1": ("Per-entity F1", "F1"),
        "other": ("Other evaluation metrics", "value"),
    }
    shown = [name for name in titles if panels[name]]
    if not shown:
        return
    plt = _pyplot()
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 3.2 * len(shown)), dpi=110, sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], shown):
        title, ylabel = titles[name]
        for i, key in enumerate(panels[name]):
            steps, values = _series(history, key)
            # An entity type's last F1 in its label: the legend tells the types apart where their curves coincide.
            label = key
            if name == "entity_f1":
                label = f"{key.removeprefix('eval_').removesuffix('_f1')} ({values[-1]:.2f})"
            ax.plot(steps, values, label=label, **curve_style(i, len(panels[name])))
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if name != "other":
            ax.set_ylim(-0.02, 1.02)
        # Beside the axes, so no legend covers a curve however many entity types there are.
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes[-1, 0].set_xlabel("optimizer step")
    _write(fig, path, written)


def plot_trainer_state(state_path: str | Path, notes: list[str] | None = None) -> list[Path]:
    """Draw the plots of one ``trainer_state.json`` next to it; returns the PNG paths written. A series the run did
    not log (training loss, learning rate, evaluation) is added to ``notes`` with the reason."""
    state_path = Path(state_path)
    state = _read_state(state_path)
    history = state["log_history"]
    keys = {k for entry in history for k in entry}
    out, written, missing = state_path.parent, [], missing_series(state)
    if notes is not None:
        notes += [f"{state_path}: {note}" for note in missing.values()]

    loss_keys = [k for k in ("loss", "loss_clean", "loss_adv", "eval_loss") if k in keys]
    if loss_keys:
        fig, ax = _figure("Loss", "loss")
        for key in loss_keys:
            ax.plot(*_series(history, key), label=key, marker="o" if key == "eval_loss" else None)
        if "loss" in missing:
            note = "\n".join(textwrap.wrap(missing["loss"], 110))
            ax.text(0.01, 0.02, note, transform=ax.transAxes, fontsize=7, va="bottom")
        _save(fig, ax, out / "loss.png", written)

    _plot_eval(history, out / "eval.png", written)
    _plot_learning_rates(history, keys, out / "learning_rate.png", written)

    if "teacher_forcing_ratio" in keys:
        fig, ax = _figure("Scheduled sampling", "teacher-forcing ratio")
        ax.plot(*_series(history, "teacher_forcing_ratio"), label="teacher_forcing_ratio")
        ax.set_ylim(-0.05, 1.05)
        _save(fig, ax, out / "teacher_forcing.png", written)
    return written


def missing_series(state: dict) -> dict[str, str]:
    """The series a trainer state lacks though its run trained, each with the reason: ``loss`` (and with it the
    learning rate, logged together every ``logging_steps``) and ``eval`` (no evaluation during training)."""
    history = state.get("log_history") or []
    steps = state.get("global_step") or max((e.get("step", 0) for e in history), default=0)
    if not steps:
        return {}
    keys = {k for entry in history for k in entry}
    missing = {}
    if "loss" not in keys:
        every = state.get("logging_steps")
        why = f"logged every {every} steps, the run had {steps}" if isinstance(every, int | float) else "not logged"
        missing["loss"] = (
            f"no training loss in the log ({why}): rerun with a smaller --logging_steps, or leave it out (the "
            "recipes log about 50 times a run, the first step too)"
        )
        missing["learning_rate"] = "no learning rate in the log either (it is logged with the training loss)"
    if not any(k.startswith("eval_") for k in keys):
        missing["eval"] = "no evaluation in the log (--eval_strategy no, or no validation data): no eval.png"
    return missing


def _plot_learning_rates(history: list[dict], keys: set[str], path: Path, written: list[Path]) -> None:
    lr_keys = sorted(k for k in keys if k.startswith("lr/")) or (["learning_rate"] if "learning_rate" in keys else [])
    if not lr_keys:
        return
    fig, ax = _figure("Learning rate per parameter group", "learning rate")
    firsts = []
    for key in lr_keys:
        steps, values = _series(history, key)
        ax.plot(steps, values, label=key)
        firsts += values[:1]
    # A 10x head rate would flatten the layer-wise decay of the body's groups to one line: spread them out.
    if len(firsts) > 1 and min(firsts) > 0 and max(firsts) / min(firsts) > 3:
        ax.set_yscale("log")
        ax.set_ylabel("learning rate (log scale)")
    _save(fig, ax, path, written)


def plot_self_training(results_path: str | Path) -> list[Path]:
    """Draw ``self_training.png`` next to a ``self_training_results.json``: the scores of round 1's teacher and of
    each round's student on validation and test, and the pseudo-labels each round kept (share of the unlabelled
    data, and their accuracy when it was measured)."""
    results_path = Path(results_path)
    results = _read_json(results_path)
    rounds = results.get("rounds") if isinstance(results, dict) else None
    if not isinstance(rounds, list) or not rounds or not all(isinstance(r, dict) for r in rounds):
        raise ValueError(f"{results_path}: not a self-training results file (no 'rounds' list)")
    stages = [("teacher", rounds[0].get("teacher") or {})] + [
        (f"student {r.get('round', i + 1)}", r.get("student") or {}) for i, r in enumerate(rounds)
    ]
    score_keys = [
        f"{split}_{name}"
        for split in ("eval", "test")
        for name in ("f1", "precision", "recall", "accuracy")
        if any(isinstance(metrics.get(f"{split}_{name}"), int | float) for _, metrics in stages)
    ]
    plt = _pyplot()
    fig, (scores, pseudo) = plt.subplots(2, 1, figsize=(8, 6.4), dpi=110)
    positions = list(range(len(stages)))
    for key in score_keys:
        points = [(i, m[key]) for i, (_, m) in enumerate(stages) if isinstance(m.get(key), int | float)]
        scores.plot([i for i, _ in points], [v for _, v in points], marker="o", label=key)
    scores.set_xticks(positions, [name for name, _ in stages])
    scores.set_title(f"Self-training ({results.get('task', '?')}): round 1's teacher, then each round's student")
    scores.set_ylabel("score")
    scores.set_ylim(-0.02, 1.02)
    scores.grid(alpha=0.3)
    scores.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))

    numbers = [r.get("round", i + 1) for i, r in enumerate(rounds)]
    pseudo_stats = [r.get("pseudo_labels") or {} for r in rounds]
    kept = [p.get("kept", 0) / p["unlabeled"] if p.get("unlabeled") else None for p in pseudo_stats]
    series = {"kept (share of the unlabelled data)": kept}
    if any(p.get("accuracy_of_kept") is not None for p in pseudo_stats):
        series["accuracy of the kept pseudo-labels"] = [p.get("accuracy_of_kept") for p in pseudo_stats]
    if any(p.get("mean_confidence") is not None for p in pseudo_stats):
        series["mean confidence"] = [p.get("mean_confidence") for p in pseudo_stats]
    for label, values in series.items():
        points = [(n, v) for n, v in zip(numbers, values) if v is not None]
        pseudo.plot([n for n, _ in points], [v for _, v in points], marker="s", label=label)
    pseudo.set_xticks(numbers, [f"round {n}" for n in numbers])
    pseudo.set_title("Pseudo-labels")
    pseudo.set_ylim(-0.02, 1.02)
    pseudo.grid(alpha=0.3)
    pseudo.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    written: list[Path] = []
    _write(fig, results_path.parent / "self_training.png", written)
    return written


def plot_run(output_dir: str | Path, notes: list[str] | None = None) -> list[Path]:
    """Draw the plots of one run (an output folder, a checkpoint, a ``trainer_state.json``, or a self-training
    output folder / its ``self_training_results.json``); returns the PNG paths written, and adds to ``notes`` the
    series a run did not log, with the reason.

    Raises ``FileNotFoundError`` when there is nothing to read and ``ValueError`` (one line naming the file) for a
    file that is not a trainer state or self-training results.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError('plotting needs matplotlib: pip install "nlp-tricks[plot]"') from err
    path = Path(output_dir)
    results = path if path.name == SELF_TRAINING_RESULTS else path / SELF_TRAINING_RESULTS
    if results.is_file():
        written = plot_self_training(results)
        for stage in sorted(results.parent.glob("round_*/*/trainer_state.json")):
            written += plot_trainer_state(stage, notes)
        return written
    return plot_trainer_state(find_trainer_state(path), notes)
