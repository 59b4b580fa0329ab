"""SAM and SMART under real 2-process DDP (gloo on CPU): one all-reduce per optimizer step, identical ranks."""

import pytest
import torch
from safetensors.torch import load_file

from recipe_helpers import launch_ddp_script, rank_report

NAMES = ["plain", "sam", "smart_fgm"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch_ddp_script("sam_smart_ddp.py", tmp_path_factory.mktemp("ddp"))


def test_one_allreduce_per_optimizer_step(ddp_run):
    """SAM runs 2 micro-batches x 2 passes per step, SMART with FGM 2 passes of 3 forwards each per micro-batch:
    still one all-reduce of each gradient bucket per optimizer step, as plain training."""
    plain = rank_report(ddp_run, "plain", 0)
    assert plain["world_size"] == 2 and plain["steps"] == 2
    buckets, rest = divmod(plain["allreduces"], plain["steps"])
    assert buckets >= 1 and rest == 0
    for name in NAMES:
        for rank in (0, 1):
            report = rank_report(ddp_run, name, rank)
            assert report["allreduces"] == buckets * report["steps"], (name, rank, report)
            assert report["trick_state"].get("sam_skipped", 0) == 0
            assert report["trick_state"].get("smart_skipped", 0) == 0
    assert all(e["loss_sam"] > e["loss"] for e in rank_report(ddp_run, "sam", 0)["logged"])
    assert all(e["loss_smart"] > 0 for e in rank_report(ddp_run, "smart_fgm", 0)["logged"])


def test_ranks_end_with_identical_weights(ddp_run):
    """The ascent gradient is each process's own (m-sharpness), but the update is all-reduced: the ranks agree."""
    plain = load_file(str(ddp_run / "plain_rank0.safetensors"))
    for name in NAMES:
        rank0 = load_file(str(ddp_run / f"{name}_rank0.safetensors"))
        rank1 = load_file(str(ddp_run / f"{name}_rank1.safetensors"))
        for key, value in rank0.items():
            assert torch.equal(value, rank1[key]), f"{name}: {key} differs between ranks"
        if name != "plain":
            assert not torch.equal(rank0["classifier.weight"], plain["classifier.weight"]), f"{name} changed nothing"
