"""Frozen and thawed layers under 2-process DDP (gloo on CPU): each rank's weights and optimizer state saved.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/layers_ddp.py OUT_DIR

``freeze``: embeddings + layer 0 frozen before DDP wraps the model. ``thaw``: the same, thawed at step 2 (DDP's
reducer holds them from the start; find_unused_parameters, on by default, lets them produce no gradient until
then). Each rank trains on its own half of every batch, so ranks only agree if every trained gradient was
all-reduced. ``refused``: unfreeze_at_step with ddp_find_unused_parameters=False is refused when the trainer is
built. tests/test_layers_ddp.py launches it and reads ``{name}_rank{r}.safetensors``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from ddp_helpers import save_rank  # noqa: E402
from nlp_tricks import TricksTrainer  # noqa: E402
from tiny import bert_seq_cls, seq_cls_data, tricks_args  # noqa: E402

SETTINGS = {
    "freeze": dict(freeze_layers=1),
    "thaw": dict(freeze_layers=1, unfreeze_at_step=2),
}
MAX_STEPS = 4


class AtStep(TrainerCallback):
    """The weights after optimizer step ``step``, and which parameters had optimizer state then."""

    def __init__(self, step: int):
        self.step, self.saved = step, {}

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.step:
            inner = getattr(optimizer, "optimizer", optimizer)
            held = {id(p) for p in inner.state}
            for name, param in model.named_parameters():
                self.saved[f"at_step.{name}"] = param.detach().clone()
                self.saved[f"state_at_step.{name}"] = torch.tensor(id(param) in held)


def run(out: Path, name: str, **settings) -> TricksTrainer:
    args = tricks_args(out / name, per_device_train_batch_size=2, max_steps=MAX_STEPS, **settings)
    return TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=16))


def main(out_dir: str) -> None:
    out = Path(out_dir)
    for name, setting in SETTINGS.items():
        trainer = run(out, name, **setting)
        assert trainer.accelerator.num_processes == 2, "launch with --num_processes 2"
        at_step = AtStep(2)
        trainer.add_callback(at_step)
        trainer.train()
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        saved = {f"final.{n}": p.detach().contiguous() for n, p in trainer.model.named_parameters()}
        for n, p in trainer.model.named_parameters():
            state = inner.state.get(p, {})
            saved[f"steps.{n}"] = torch.tensor(int(state["step"]) if "step" in state else 0)
        saved.update(at_step.saved)
        save_rank(trainer, out, name, saved)
    try:
        run(out, "refused", freeze_layers=1, unfreeze_at_step=2, ddp_find_unused_parameters=False)
        message = "not refused"
    except ValueError as err:
        message = str(err)
    (out / "refused.txt").write_text(message)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
