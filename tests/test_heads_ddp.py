"""CRF and class weights under real 2-process DDP (gloo on CPU): the step equals one process over the whole batch."""

import pytest
import torch
from safetensors.torch import load_file
from scripts.heads_ddp import SETTINGS, ner_data, ner_model

from nlp_tricks import TricksTrainer
from nlp_tricks.functional.crf import add_crf
from recipe_helpers import launch_ddp_script
from tiny import sgd_step_args


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch_ddp_script("heads_ddp.py", tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_ddp_step_equals_one_process_step(ddp_run, tmp_path, name):
    model = ner_model()
    if name == "crf":
        add_crf(model)  # the same module order as the DDP runs (the Trainer attaches it again: kept)
    single = TricksTrainer(
        model=model,
        args=sgd_step_args(tmp_path, per_device_train_batch_size=8, **SETTINGS[name]),
        train_dataset=ner_data(),
    )
    single.train()
    rank0 = load_file(str(ddp_run / f"{name}_rank0.safetensors"))
    rank1 = load_file(str(ddp_run / f"{name}_rank1.safetensors"))
    for key, value in single.model.state_dict().items():
        assert torch.equal(rank0[key], rank1[key]), f"{name}: {key} differs between ranks"
        # Summation order differs (per-rank partial sums, then the all-reduce): float32 round-off only.
        torch.testing.assert_close(rank0[key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    if name == "crf":
        assert not torch.equal(rank0["crf.transitions"], torch.zeros(5, 5))
