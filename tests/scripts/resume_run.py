"""Train a tiny BERT with checkpoints, for tests/test_resume.py: optionally SIGKILL itself right after a chosen save,
or resume from the newest complete checkpoint.

    python tests/scripts/resume_run.py --out DIR --config '{"loss_type": "focal"}' [--kill_after_save 6] [--resume]
        [--max_steps 8]

At the end it writes DIR/final.safetensors (the weights) and DIR/final_trick_state.json (and DIR/final_ema.safetensors,
the EMA state, with --ema_decay).
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from nlp_tricks import TricksTrainer  # noqa: E402
from nlp_tricks.seq2seq import Seq2SeqTricksTrainer  # noqa: E402
from tiny import (  # noqa: E402
    bart_lm,
    bert_token_cls,
    ema_of,  # noqa: E402
    seq2seq_data,
    token_cls_data,
    tricks_args,
)
from tiny_seq2seq import seq2seq_args  # noqa: E402

# The schedule the test relies on: 12 examples / batch 4 = 3 steps per epoch, a checkpoint every 2 steps.
MAX_STEPS, SAVE_STEPS = 8, 2


class CountingTrainer(TricksTrainer):
    """Keeps cumulative counters in trick_state, as the tricks do (attack skips, sampling steps)."""

    def compute_tricks_loss(self, logits, labels, num_items_in_batch=None):
        self.trick_state["loss_calls"] = self.trick_state.get("loss_calls", 0) + 1
        self.trick_state["labels_seen"] = self.trick_state.get("labels_seen", 0) + int(labels.ne(-100).sum())
        return super().compute_tricks_loss(logits, labels, num_items_in_batch=num_items_in_batch)


class CountingSeq2SeqTrainer(CountingTrainer, Seq2SeqTricksTrainer):
    """The same counters on the seq2seq trainer (scheduled sampling)."""


def is_seq2seq(config: dict) -> bool:
    return "scheduled_sampling" in config


def make_model(config: dict):
    """The tiny model a config trains, with dropout on (so a resumed run also needs the RNG state back)."""
    return bart_lm(dropout=0.1) if is_seq2seq(config) else bert_token_cls(hidden_dropout_prob=0.1)


class KillAfterSave(TrainerCallback):
    """SIGKILL this process right after the checkpoint of ``step`` is written: a crash at a known point."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class ReportStart(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print(f"start_step={state.global_step}", flush=True)


def run(out, config, kill_after_save=None, resume=False, max_steps=MAX_STEPS):
    model = make_model(config)
    kwargs = dict(max_steps=max_steps, save_strategy="steps", save_steps=SAVE_STEPS, logging_steps=1, **config)
    callbacks = [ReportStart()] + ([KillAfterSave(kill_after_save)] if kill_after_save else [])
    if is_seq2seq(config):
        args, trainer_cls, data = seq2seq_args(out, **kwargs), CountingSeq2SeqTrainer, seq2seq_data(n=12)
    else:
        args, trainer_cls, data = tricks_args(out, **kwargs), CountingTrainer, token_cls_data(n=12)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if resume else None)
    # Cloned: tied weights (BART) share storage, which safetensors refuses to write twice.
    save_file({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, "final.safetensors"))
    with open(os.path.join(out, "final_trick_state.json"), "w") as f:
        json.dump(trainer.trick_state, f)
    if ema_of(trainer) is not None:  # --ema_decay: the average, to compare as well
        ema_of(trainer).save(os.path.join(out, "final_ema.safetensors"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="{}", help="TricksArguments overrides as JSON")
    parser.add_argument("--reference_out", help="first train uninterrupted into this folder")
    parser.add_argument("--kill_after_save", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max_steps", type=int, default=MAX_STEPS)
    cli = parser.parse_args()
    torch.set_num_threads(1)  # the same kernels in every process: results comparable across processes
    config = json.loads(cli.config)
    if cli.reference_out:
        run(cli.reference_out, config, max_steps=cli.max_steps)
    run(cli.out, config, kill_after_save=cli.kill_after_save, resume=cli.resume, max_steps=cli.max_steps)


if __name__ == "__main__":
    main()
