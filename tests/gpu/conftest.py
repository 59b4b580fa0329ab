"""The GPU tests run on CUDA and are skipped, each with its reason, where there is none.

``NLP_TRICKS_GPU_TESTS_DEVICE=cpu`` runs them on the CPU instead (CPU autocast, CPU GradScaler): a dry run of the
tests' own logic for development on a machine without a GPU. It proves nothing about CUDA kernels; tests that need
CUDA's behaviour (the Trainer's fp16 GradScaler, which Accelerate only builds on CUDA; several GPUs) skip there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def gpu_test_device() -> str | None:
    """``"cuda"`` when a CUDA device is visible, ``"cpu"`` for an explicit dry run, else ``None`` (skip)."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("NLP_TRICKS_GPU_TESTS_DEVICE") == "cpu":
        return "cpu"
    return None


def pytest_collection_modifyitems(config, items):
    if gpu_test_device() is not None:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents and item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return gpu_test_device()


@pytest.fixture
def cuda_only(device):
    """Skip in the CPU dry run: the test checks behaviour only CUDA has."""
    if device != "cuda":
        pytest.skip("checks CUDA-only behaviour; skipped in the CPU dry run")
