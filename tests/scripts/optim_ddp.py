"""Lookahead and Muon under 2-process DDP: save each rank's weights (and Lookahead's slow weights).

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/optim_ddp.py OUT_DIR

Runs 4 optimizer steps of a tiny BERT (one micro-batch of 2 per process and step) with ``lookahead_k=2`` on SGD
("lookahead") and, where torch has ``torch.optim.Muon``, with ``muon`` and ``lookahead_k=2`` ("muon"), and writes per
setting and rank ``{name}_rank{r}.safetensors`` (the weights, the slow weights under ``slow.`` keys) and
``{name}_rank{r}.json``. tests/test_lookahead.py launches it and compares the ranks, and (Lookahead on SGD) one
process of 4 examples.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from ddp_helpers import AllReduceCountingTrainer, model_weights, save_rank  # noqa: E402
from tiny import bert_seq_cls, seq_cls_data  # noqa: E402

STEPS = 4


def settings() -> dict[str, dict]:
    """The settings, each a dict of TricksArguments fields (the test runs the same ones in one process)."""
    lookahead = dict(optim="sgd", learning_rate=0.5, lookahead_k=2)
    found = {"lookahead": lookahead}
    if hasattr(torch.optim, "Muon"):
        found["muon"] = dict(muon=True, learning_rate=1e-2, lookahead_k=2)
    return found


def run(out: Path, name: str, per_device: int, trainer_cls=AllReduceCountingTrainer):
    from nlp_tricks.tricks.lookahead import LookaheadTrick
    from tiny import tricks_args

    args = tricks_args(
        out / name, per_device_train_batch_size=per_device, max_steps=STEPS, max_grad_norm=0.0,
        lr_scheduler_type="constant", train_sampling_strategy="sequential", **settings()[name],
    )  # fmt: skip
    trainer = trainer_cls(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=4 * STEPS))
    trainer.train()
    slow = trainer.get_trick(LookaheadTrick).slow
    tensors = model_weights(trainer)
    tensors.update({f"slow.{n}": s for n, s in zip(slow.names, slow.slow)})
    return trainer, tensors


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name in settings():
        trainer, tensors = run(out, name, per_device=2)
        save_rank(trainer, out, name, tensors, {"syncs": STEPS // 2})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
