"""Timing shared by the benchmarks: interleaved rounds in a rotating order, and ratios paired by round.

The machines these run on are shared and noisy: a slow stretch can last several steps. Running every variant once
per round (in an order that rotates, so none always follows the same neighbour) and taking the median over rounds of
the per-round ratio lets such drifts hit both sides of a ratio alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable

import torch


def synchronize() -> None:
    """Wait for queued CUDA work (no-op on the CPU), so a step's time includes its kernels."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_interleaved(
    steps: dict[Hashable, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict[Hashable, list[float]]:
    """Seconds per call of every step, per round: one warm-up call each, then ``repeats`` rounds. ``clock``: wall
    time by default; ``time.process_time`` (this process's CPU time) for one-thread steps on a machine others load."""
    labels = list(steps)
    for label in labels:
        steps[label]()
    times = {label: [] for label in labels}
    for r in range(repeats):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            synchronize()
            start = clock()
            steps[label]()
            synchronize()
            times[label].append(clock() - start)
    return times


def paired_ratio(times: dict[Hashable, list[float]], a: Hashable, b: Hashable) -> float:
    """Median over rounds of time(a) / time(b) in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))
