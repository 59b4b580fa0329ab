"""``evaluate`` metric modules shipped inside the package, loaded by local path (no network needed).

``evaluate.load("rouge")`` fetches its script from the Hub; a local module path loads offline::

    import evaluate
    from nlp_tricks.metrics import metric_path

    rouge = evaluate.load(metric_path("rouge"))
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["METRICS", "metric_path", "load_metric"]

METRICS = ("rouge", "accuracy_f1", "multi_label_f1")


def metric_path(name: str) -> str:
    """The folder of the shipped metric module ``name`` (one of ``METRICS``), as ``evaluate.load`` takes it."""
    if name not in METRICS:
        raise ValueError(f"metric {name!r} is not shipped; choose one of {', '.join(map(repr, METRICS))}")
    return str(Path(__file__).parent / name)


def load_metric(name: str):
    """``evaluate.load`` of a shipped metric, kept in memory (no cache files shared between DDP processes)."""
    import evaluate

    return evaluate.load(metric_path(name), keep_in_memory=True)
