"""Frozen and thawed layers under real 2-process DDP (gloo on CPU): tests/scripts/layers_ddp.py."""

import pytest
import torch
from safetensors.torch import load_file

from recipe_helpers import launch_ddp_script

FROZEN = ("bert.embeddings.", "bert.encoder.layer.0.")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch_ddp_script("layers_ddp.py", tmp_path_factory.mktemp("ddp"))


def _names(saved):
    return [key[len("final.") :] for key in saved if key.startswith("final.")]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["freeze", "thaw"])
def test_ranks_agree_and_frozen_layers_hold_until_they_thaw(ddp_run, name):
    from tiny import bert_seq_cls

    initial = dict(bert_seq_cls().named_parameters())
    rank0 = load_file(str(ddp_run / f"{name}_rank0.safetensors"))
    rank1 = load_file(str(ddp_run / f"{name}_rank1.safetensors"))
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), f"{name}: {key} differs between ranks"
    for param in _names(rank0):
        frozen = param.startswith(FROZEN)
        start = initial[param].detach()
        assert torch.equal(rank0[f"final.{param}"], start) == (frozen and name == "freeze"), param
        if frozen:
            assert torch.equal(rank0[f"at_step.{param}"], start), f"{param} changed before step 2"
            assert not rank0[f"state_at_step.{param}"], f"{param} had optimizer state before step 2"
        expected_steps = 4 if not frozen else (2 if name == "thaw" else 0)
        assert int(rank0[f"steps.{param}"]) == expected_steps, param


@pytest.mark.slow
def test_thawing_without_find_unused_parameters_is_refused(ddp_run):
    message = (ddp_run / "refused.txt").read_text()
    assert message.startswith("unfreeze_at_step=2 under DDP needs ddp_find_unused_parameters=True"), message
