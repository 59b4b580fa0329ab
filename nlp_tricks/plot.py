"""Training plots from a run's ``trainer_state.json``: losses, eval metrics, per-group learning rates, teacher forcing.

    nlp-tricks plot OUTPUT_DIR

Writes ``loss.png``, ``eval.png``, ``learning_rate.png`` and ``teacher_forcing.png`` (each only when the log has
such values) next to the ``trainer_state.json`` it read. Needs matplotlib (``pip install "nlp-tricks[plot]"``).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["find_trainer_state", "plot_run"]

_NOT_METRICS = ("runtime", "per_second", "epoch", "step")


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
    raise FileNotFoundError(f"{output_dir}: no trainer_state.json here or in a checkpoint-N folder")


def _series(log_history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(entry["step"], entry[key]) for entry in log_history if isinstance(entry.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path, written: list[Path]) -> None:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    written.append(path)


def plot_run(output_dir: str | Path) -> list[Path]:
    """Draw the plots of one run; returns the PNG paths written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError('plotting needs matplotlib: pip install "nlp-tricks[plot]"') from err
    state_path = find_trainer_state(output_dir)
    history = json.loads(state_path.read_text())["log_history"]
    keys = {k for entry in history for k in entry}
    out, written = state_path.parent, []

    loss_keys = [k for k in ("loss", "loss_clean", "loss_adv", "eval_loss") if k in keys]
    if loss_keys:
        fig, ax = _figure("Loss", "loss")
        for key in loss_keys:
            ax.plot(*_series(history, key), label=key, marker="o" if key == "eval_loss" else None)
        _save(fig, ax, out / "loss.png", written)

    metric_keys = sorted(
        k for k in keys if k.startswith("eval_") and k != "eval_loss" and not any(s in k for s in _NOT_METRICS)
    )
    if metric_keys:
        fig, ax = _figure("Evaluation", "metric")
        for key in metric_keys:
            ax.plot(*_series(history, key), label=key, marker="o")
        _save(fig, ax, out / "eval.png", written)

    lr_keys = sorted(k for k in keys if k.startswith("lr/")) or (["learning_rate"] if "learning_rate" in keys else [])
    if lr_keys:
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
        _save(fig, ax, out / "learning_rate.png", written)

    if "teacher_forcing_ratio" in keys:
        fig, ax = _figure("Scheduled sampling", "teacher-forcing ratio")
        ax.plot(*_series(history, "teacher_forcing_ratio"), label="teacher_forcing_ratio")
        ax.set_ylim(-0.05, 1.05)
        _save(fig, ax, out / "teacher_forcing.png", written)
    return written
