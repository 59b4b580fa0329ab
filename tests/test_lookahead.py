"""Lookahead (``lookahead_k`` / ``lookahead_alpha``): the slow-weight update written out against plain torch loops,
the trainer against a plain loop (and under gradient accumulation), exact resume from the middle of a k-cycle, and
its declared order with the EMA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nlp_tricks import TricksTrainer
from nlp_tricks.functional.lookahead import SlowWeights
from nlp_tricks.trick import capability_problem
from nlp_tricks.tricks import BUILT_IN_TRICKS
from nlp_tricks.tricks.ema import EMATrick
from nlp_tricks.tricks.lookahead import LookaheadTrick
from tiny import bert_seq_cls, ema_of, seq_cls_data, tricks_args

K, ALPHA = 3, 0.5


def test_slow_weights_equal_k_fast_steps_then_the_update_written_out():
    """AdamW on a small MLP, 8 steps with k=3: the weights equal, bitwise, a loop that takes k fast steps and then
    sets slow = slow + alpha * (fast - slow), fast = slow (AdamW's state kept across the sync)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4, 6), torch.randint(0, 2, (8, 4))

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    slow = SlowWeights(model.named_parameters(), k=K, alpha=ALPHA)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    ref_slow = [p.detach().clone() for p in reference.parameters()]  # the weights before the first step
    synced = []
    for step in range(8):
        for net, opt in ((model, optimizer), (reference, ref_optimizer)):
            opt.zero_grad()
            F.cross_entropy(net(x[step]), y[step]).backward()
            opt.step()
        synced.append(slow.step())
        if (step + 1) % K == 0:
            with torch.no_grad():
                for i, p in enumerate(reference.parameters()):
                    ref_slow[i] = ref_slow[i] + ALPHA * (p - ref_slow[i])
                    p.copy_(ref_slow[i])
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a, b), step
    assert synced == [False, False, True] * 2 + [False, False]
    assert slow.count == 8
    for a, b in zip(slow.slow, ref_slow):
        assert torch.equal(a, b)


def test_slow_weights_are_float32_for_bfloat16_weights():
    """The slow weights keep float32 precision; the bfloat16 weights get them rounded."""
    layer = nn.Linear(4, 4).to(torch.bfloat16)
    slow = SlowWeights(layer.named_parameters(), k=1, alpha=0.3)
    start = layer.weight.detach().float()
    with torch.no_grad():
        layer.weight.add_(0.1)
    fast = layer.weight.detach().float()
    slow.step()
    expected = start + 0.3 * (fast - start)
    assert slow.slow[0].dtype == torch.float32 and torch.equal(slow.slow[0], expected)
    assert torch.equal(layer.weight.detach(), expected.to(torch.bfloat16))


# ---- The trainer ----------------------------------------------------------------------------------------------------


def _plain_loop(model, data, steps, batch, lr=0.5, k=K, alpha=ALPHA, ema_decay=None, ema_after_sync=True):
    """SGD on the mean cross-entropy of ``batch`` examples in order, Lookahead written out, and (with ``ema_decay``)
    an EMA without warm-up updated after the sync (or before it); returns the EMA."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    slow = [p.detach().clone() for p in model.parameters()]
    ema = [p.detach().clone() for p in model.parameters()]

    def update_ema():
        for i, p in enumerate(model.parameters()):
            ema[i] = ema_decay * ema[i] + (1 - ema_decay) * p.detach()

    for step in range(steps):
        rows = [data[i] for i in range(step * batch, (step + 1) * batch)]
        inputs = {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "attention_mask")}
        optimizer.zero_grad()
        F.cross_entropy(model(**inputs).logits, torch.stack([row["labels"] for row in rows])).backward()
        optimizer.step()
        if ema_decay is not None and not ema_after_sync:
            update_ema()
        if (step + 1) % k == 0:
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    slow[i] = slow[i] + alpha * (p - slow[i])
                    p.copy_(slow[i])
        if ema_decay is not None and ema_after_sync:
            update_ema()
    return ema


def _sgd_args(out, **overrides):
    kwargs = dict(
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
    )
    kwargs.update(overrides)
    return tricks_args(out, **kwargs)


@pytest.mark.parametrize("batch,accumulation", [(4, 1), (2, 2)])
def test_the_trainer_equals_a_plain_loop_with_lookahead_written_out(tmp_path, one_thread, batch, accumulation):
    """7 SGD steps with k=3 (two syncs and one step past them), in one micro-batch of 4 and in 2 x 2 accumulated: the
    sync comes once per optimizer step, not per micro-batch."""
    steps, data = 7, seq_cls_data(n=28)
    model, reference = bert_seq_cls(), bert_seq_cls()
    args = _sgd_args(
        tmp_path,
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        lookahead_k=K,
        lookahead_alpha=ALPHA,
    )
    trainer = TricksTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    _plain_loop(reference, data, steps, batch=4)
    assert trainer.get_trick(LookaheadTrick).slow.count == steps
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        # float32 round-off: the trainer's loss is a sum over the step's examples divided by their count (and, with
        # accumulation, two micro-batches' gradients summed), the loop's a mean of one batch.
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)


def test_resume_from_the_middle_of_a_cycle_equals_the_uninterrupted_run_bitwise(tmp_path, one_thread):
    """AdamW, k=4, 6 steps: checkpoint-3 is 3 steps into the first cycle; the run resumed from it ends bitwise where
    the uninterrupted run ends, slow weights and counter included."""

    def run(out, resume=None):
        model = bert_seq_cls()
        args = tricks_args(
            out, max_steps=6, learning_rate=1e-2, save_strategy="steps", save_steps=3, lookahead_k=4,
            train_sampling_strategy="sequential",
        )  # fmt: skip
        trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=24))
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer.get_trick(LookaheadTrick).slow

    reference, ref_slow = run(tmp_path / "reference")
    run(tmp_path / "crashed")
    resumed, slow = run(tmp_path / "crashed", resume=str(tmp_path / "crashed" / "checkpoint-3"))
    assert slow.count == ref_slow.count == 6
    for (name, a), b in zip(reference.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    for name, a, b in zip(ref_slow.names, ref_slow.slow, slow.slow):
        assert torch.equal(a, b), name


def test_the_ema_averages_the_weights_after_the_sync(tmp_path, one_thread):
    """Lookahead (order 1050) runs before the EMA (1100): on a sync step the EMA's update sees the synced weights.
    The trainer's EMA equals the loop's EMA updated after the sync, and differs from one updated before it."""
    steps, data = 5, seq_cls_data(n=20)
    pair = (LookaheadTrick, EMATrick)
    orders = sorted((cls.order, cls.__name__) for cls in BUILT_IN_TRICKS if cls in pair)
    assert [name for _, name in orders] == ["LookaheadTrick", "EMATrick"]
    model = bert_seq_cls()
    args = _sgd_args(tmp_path, max_steps=steps, lookahead_k=2, ema_decay=0.5, ema_warmup=False)
    trainer = TricksTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    got = ema_of(trainer).state_dict()["shadow"]
    after = _plain_loop(bert_seq_cls(), data, steps, batch=4, k=2, ema_decay=0.5)
    before = _plain_loop(bert_seq_cls(), data, steps, batch=4, k=2, ema_decay=0.5, ema_after_sync=False)
    names = [n for n, _ in bert_seq_cls().named_parameters()]
    gap = max((a - b).abs().max().item() for a, b in zip(after, before))
    assert gap > 1e-3  # the two orders are told apart
    for name, a in zip(names, after):
        torch.testing.assert_close(got[name], a, rtol=0, atol=2e-6, msg=name)  # float32 round-off, as above


@pytest.mark.parametrize(
    "setting,message",
    [
        (dict(lookahead_k=-1), r"lookahead_k=-1 is not allowed; it must be an integer >= 0"),
        (dict(lookahead_k=5, lookahead_alpha=0.0), r"lookahead_alpha=0.0 is not allowed; it must be in \(0, 1\]"),
        (dict(lookahead_k=5, lookahead_alpha=1.5), r"lookahead_alpha=1.5 is not allowed"),
    ],
)
def test_bad_values_name_the_field(tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        tricks_args(tmp_path, **setting)


def test_refused_under_deepspeed_and_fsdp_naming_why(tmp_path):
    trick = LookaheadTrick(tricks_args(tmp_path, lookahead_k=5))
    for engine, setting in (("DeepSpeed", dict(deepspeed=True)), ("FSDP", dict(fsdp=True))):
        problem = capability_problem(trick, **setting)
        assert problem.startswith(f"lookahead_k=5, lookahead_alpha=0.5 is not supported with {engine}: "), problem
        assert "master weights" in problem and "lookahead_k=0" in problem and "\n" not in problem
    assert capability_problem(trick) is None  # DDP / one process


@pytest.mark.slow  # two processes of accelerate launch: ~40 s on 2 shared cores
def test_ddp_ranks_sync_alike_and_equal_one_process(tmp_path, tmp_path_factory, one_thread):
    """2 processes x 2 examples, Lookahead on SGD and Lookahead with Muon: every rank holds the same weights and slow
    weights bitwise (no communication of their own: each syncs its identical copy); on SGD they equal one process's
    run of 4 examples."""
    from safetensors.torch import load_file
    from scripts.optim_ddp import run, settings

    from recipe_helpers import launch_ddp_script, rank_report

    out = launch_ddp_script("optim_ddp.py", tmp_path_factory.mktemp("optim_ddp"))
    for name in settings():
        assert rank_report(out, name, 0)["world_size"] == 2
        rank0, rank1 = (load_file(out / f"{name}_rank{r}.safetensors") for r in (0, 1))
        assert set(rank0) == set(rank1) and any(key.startswith("slow.") for key in rank0)
        for key in rank0:
            assert torch.equal(rank0[key], rank1[key]), (name, key)
        if name == "muon":
            # Not compared with one process: torch's Newton-Schulz iteration runs in bfloat16, so the gradient's
            # float32 round-off (2 + 2 examples summed against 4) can move a bfloat16 rounding, which the iteration
            # amplifies in a matrix's small singular directions (measured: 1.4e-3 after 4 steps at lr 1e-2).
            continue
        _, single = run(tmp_path, name, per_device=4, trainer_cls=TricksTrainer)
        for key, value in single.items():
            # float32 round-off: the gradient all-reduced against one batch's (on SGD: AdamW's first steps, about
            # lr * sign(g), would turn the round-off of a near-zero gradient into lr).
            torch.testing.assert_close(rank0[key], value, rtol=0, atol=2e-6, msg=(name, key))


def test_a_host_trainer_runs_lookahead(tmp_path):
    """with_tricks(Seq2SeqTrainer), a plain host: it keeps its optimizer and Lookahead syncs after its steps, as in
    TricksTrainer."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from nlp_tricks import TricksConfig, with_tricks

    args = Seq2SeqTrainingArguments(
        str(tmp_path), max_steps=4, per_device_train_batch_size=4, optim="sgd", learning_rate=0.5, weight_decay=0.0,
        max_grad_norm=0.0, lr_scheduler_type="constant", report_to="none", use_cpu=True, save_strategy="no",
        train_sampling_strategy="sequential", disable_tqdm=True,
    )  # fmt: skip
    model, reference, data = bert_seq_cls(), bert_seq_cls(), seq_cls_data(n=16)
    config = TricksConfig(lookahead_k=2)
    trainer = with_tricks(Seq2SeqTrainer)(model=model, args=args, train_dataset=data, tricks_config=config)
    trainer.train()
    assert trainer.get_trick(LookaheadTrick).slow.count == 4
    _plain_loop(reference, data, 4, batch=4, k=2)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)  # float32 round-off, as above
