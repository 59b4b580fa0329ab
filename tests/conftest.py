import os

# No network in tests: everything is built from config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# Tiny models run fastest on one thread, and subprocess tests (2-process DDP) must not oversubscribe 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The recipes import their shared glue (the package recipes/common/) and each other by module name, as when run as
# scripts.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny BERT folder (config, safetensors weights, WordLevel tokenizer) standing in for the demo's MiniLM."""
    from recipe_helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture
def one_thread():
    """The same kernels in every run and process, so the runs are comparable to float32 round-off."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
