"""Adversarial training under real 2-process DDP (gloo on CPU): one all-reduce per step, identical ranks, exactness."""

import pytest
import torch
from safetensors.torch import load_file

from nlp_tricks import TricksTrainer
from recipe_helpers import launch_ddp_script, rank_report
from tiny import bert_token_cls, token_cls_data, tricks_args


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return launch_ddp_script("adversarial_ddp.py", tmp_path_factory.mktemp("ddp"))


def test_one_allreduce_per_optimizer_step(ddp_run):
    plain = rank_report(ddp_run, "plain", 0)
    assert plain["world_size"] == 2 and plain["steps"] == 3
    # Plain training all-reduces each gradient bucket once per step; adversarial training must do the same.
    buckets, rest = divmod(plain["allreduces"], plain["steps"])
    assert buckets >= 1 and rest == 0
    for name in ["plain", "fgm", "pgd", "example", "awp", "freelb", "freelb_example", "rdrop"]:
        for rank in (0, 1):
            report = rank_report(ddp_run, name, rank)
            assert report["allreduces"] == buckets * report["steps"], (name, rank, report)
            assert report["adv_skipped"] in (None, 0)
    awp = rank_report(ddp_run, "awp", 0)
    assert awp["adv_plain_steps"] == 1 and ["loss_adv" in e for e in awp["logged"]] == [False, True, True]
    assert all(e["loss_kl"] > 0 for e in rank_report(ddp_run, "rdrop", 0)["logged"])


def test_ranks_end_with_identical_weights(ddp_run):
    plain = load_file(str(ddp_run / "plain_rank0.safetensors"))
    for name in ["plain", "fgm", "pgd", "example", "awp", "freelb", "freelb_example", "rdrop"]:
        rank0 = load_file(str(ddp_run / f"{name}_rank0.safetensors"))
        rank1 = load_file(str(ddp_run / f"{name}_rank1.safetensors"))
        for key, value in rank0.items():
            assert torch.equal(value, rank1[key]), f"{name}: {key} differs between ranks"
        if name in ("fgm", "pgd", "awp", "freelb"):
            assert not torch.equal(rank0["classifier.weight"], plain["classifier.weight"]), f"{name} did not attack"


@pytest.mark.parametrize(
    "name,setting",
    [
        ("example", dict(adversarial="pgd", adv_norm="example", adv_steps=2, adv_epsilon=0.5)),
        ("freelb_example", dict(adversarial="freelb", adv_steps=3, adv_epsilon=0.4)),
    ],
)
def test_ddp_step_equals_one_process_step(ddp_run, tmp_path, name, setting):
    """Per-example normalisation (PGD's adv_norm="example", FreeLB's) makes the perturbation independent of how the 8
    examples are split, so 2 processes x 2 micro-batches x 2 examples equal one process with one batch of 8."""
    model = bert_token_cls()
    args = tricks_args(
        tmp_path,
        per_device_train_batch_size=8,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        weight_decay=0.0,
        **setting,
    )
    single = TricksTrainer(model=model, args=args, train_dataset=token_cls_data(n=8))
    single.train()
    ddp = load_file(str(ddp_run / f"{name}_rank0.safetensors"))
    for key, value in single.model.state_dict().items():
        # Summation order differs (all-reduce of two halves): float32 round-off only.
        torch.testing.assert_close(ddp[key], value, rtol=1e-5, atol=1e-6, msg=key)
