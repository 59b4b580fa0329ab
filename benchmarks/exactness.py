"""What a split of the batch changes, trick by trick: one SGD step on a batch of 4 as 1 micro-batch of 4 against
2 micro-batches of 2 accumulated (and, with ``--ddp``, 2 processes x 2 examples against 1 process x 4).

    python benchmarks/exactness.py               # every trick, one process (1-2 minutes on 2 cores)
    python benchmarks/exactness.py --ddp         # also 2 processes (accelerate launch --multi_gpu, gloo on the CPU)
    python benchmarks/exactness.py --quick       # a few tricks, seconds (benchmarks/run_all.py --quick)
    python benchmarks/exactness.py --only fgm,fgm_example --json

Each case is one optimizer step of ``TricksTrainer`` (``optim="sgd"``, lr 0.5, no weight decay, no clipping, the 4
examples in order) on a model of tests/tiny.py (a 2-layer BERT for token or sequence classification, GPT-2 for the
causal LM, BART for seq2seq), every run built from the same seed. A row reports ``max |w_a - w_b|`` over every weight
(the EMA's average for the EMA case), the step's size ``max |w_a - w_0|`` and their ratio, ``relative``.

``relative`` below :data:`ROUND_OFF` is float round-off: the two runs sum the same terms in another order (one
micro-batch's matmul against two accumulated into ``.grad``; an all-reduce of two halves); a few float32 ulps of a
weight near 1 (a LayerNorm's) over a step of ~0.2 are ~1e-6. Above it, the difference is the method's: each case
names its cause (read from the trick's code), and a row whose measurement contradicts that is printed as UNEXPECTED
(the exit status is then 1).

Dropout: the cases that need it use ``hidden_dropout_prob=0.1`` (attention dropout 0, so every mask goes through
``torch.nn.functional.dropout``). With ``draws="example"`` every dropout mask (multi-sample dropout's K masks, SMART's
random start) is drawn per example from a seed of the example's token ids, its occurrence in the forward (R-Drop's two
copies) and the forwards of the step that saw it before, so every split draws the same masks; the twin case with
``draws="torch"`` keeps torch's own draws (the same seed, but a batch of 4 and two of 2 consume the generator
differently), which is what training does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the tiny models the tests use

from nlp_tricks import TricksArguments, TricksTrainer  # noqa: E402
from nlp_tricks.seq2seq import Seq2SeqTricksArguments, Seq2SeqTricksTrainer  # noqa: E402
from nlp_tricks.tricks.ema import ExponentialMovingAverage  # noqa: E402
from nlp_tricks.tricks.head_dropout import MultiSampleDropoutHead  # noqa: E402
from tiny import ListDataset, bart_lm, bert_seq_cls, bert_token_cls, seq2seq_data, seq_cls_data, token_cls_data  # noqa: E402
from tiny_causal import causal_lm_data, gpt2_lm  # noqa: E402

#: ``relative`` under this is float round-off (see the module docstring); the method differences measured here are
#: 1e-4 and more.
ROUND_OFF = 1e-5
EXAMPLES = 4
DROPOUT = 0.1

EXACT = "exact"
# Causes of a difference, as the code makes it (the trick's file in nlp_tricks/tricks/, its math in functional/).
GLOBAL_NORM = (
    "adv_norm='global': the perturbation is g / ||g|| with the norm over the micro-batch's tokens (per process), "
    "so a split changes every example's perturbation"
)
AWP_ASCENT = (
    "the weights move by gamma * ||w|| * g / ||g|| with g this micro-batch's own gradient (per process): each split "
    "attacks other weights"
)
# One draw per micro-batch, for its shape: torch's CPU generator fills a (4, ...) tensor with the numbers it gives two
# (2, ...) tensors in turn, so with no other draw between the micro-batches a split draws the same values.
CPU_STREAM = (
    "exact here, by the generator: the draw is one per micro-batch, for its shape, and torch's CPU generator gives a "
    "(4, ...) draw the numbers of two (2, ...) draws in turn; a micro-batch that draws more than once (dropout, see "
    "'dropout') or 2 processes (each draws the same numbers for its own examples) break it"
)
EACH_PROCESS = "every process draws the same numbers from the same seed, for its own examples: other values than 1 x 4"
SAM_PROCESS = (
    "the ascent uses each process's own accumulated gradient (every backward but the step's last under no_sync; "
    "m-sharpness, m = the per-process batch), so 2 processes move to other weights than 1"
)
TORCH_DROPOUT = (
    "a fresh dropout draw: torch draws each mask for the micro-batch's shape, so a batch of 4 and two of 2 get other "
    "masks (the same in upstream Trainer)"
)


@dataclass
class Case:
    """One trick setting and what the code says a split does to it (``EXACT`` or the cause of a difference)."""

    name: str
    settings: dict
    accumulation: str = EXACT
    ddp: str = EXACT
    task: str = "token"  # token | sequence | causal | seq2seq
    dropout: float = 0.0
    draws: str = "none"  # none | example (per-example masks) | torch (torch's own draws)
    compare: str = "weights"  # weights | ema
    quick: bool = False
    data: dict = field(default_factory=dict)

    def setting(self) -> str:
        parts = [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in self.settings.items()]
        if self.dropout:
            parts.append(f"dropout {self.dropout}")
        if self.draws != "none":
            parts.append(f"{self.draws} draws")
        return ", ".join(parts) or "(no trick)"


CASES = [
    Case("plain", {}, quick=True),
    Case("focal", {"loss_type": "focal", "focal_gamma": 2.0}),
    Case("focal_alpha", {"loss_type": "focal", "focal_alpha": [0.5, 1.0, 2.0, 1.0, 3.0]}),
    Case("label_smoothing", {"loss_type": "label_smoothing", "label_smoothing_factor": 0.1}),
    Case("class_weights", {"class_weights": ["1", "2", "3", "1", "2"]}, quick=True),
    Case("class_weights_smoothing", {"class_weights": ["1", "2", "3", "1", "2"], "label_smoothing_factor": 0.1}),
    Case("temperature", {"temperature": 2.0}),
    Case("crf", {"crf": True}),
    Case("layer_decay", {"layer_decay": 0.8, "head_lr_scale": 10.0}),
    Case("freeze_layers", {"freeze_layers": 1}),
    Case("ema", {"ema_decay": 0.9}, compare="ema"),
    Case("swa", {"swa_last_k": 1, "save_strategy": "steps", "save_steps": 1}),
    Case("fgm", {"adversarial": "fgm"}, accumulation=GLOBAL_NORM, ddp=GLOBAL_NORM, quick=True),
    Case("fgm_example", {"adversarial": "fgm", "adv_norm": "example"}, quick=True),
    Case("fgm_token", {"adversarial": "fgm", "adv_norm": "token"}),
    Case("pgd", {"adversarial": "pgd"}, accumulation=GLOBAL_NORM, ddp=GLOBAL_NORM),
    Case("pgd_example", {"adversarial": "pgd", "adv_norm": "example"}),
    Case("pgd_token", {"adversarial": "pgd", "adv_norm": "token"}),
    Case("awp", {"adversarial": "awp", "awp_gamma": 0.05}, accumulation=AWP_ASCENT, ddp=AWP_ASCENT),
    Case("freelb", {"adversarial": "freelb", "adv_steps": 2, "adv_epsilon": 0.4}),
    Case(
        "freelb_random_start",
        {"adversarial": "freelb", "adv_steps": 2, "adv_epsilon": 0.4, "adv_init_mag": 0.1},
        accumulation=CPU_STREAM,
        ddp="adv_init_mag > 0: the random start delta_0: " + EACH_PROCESS,
    ),
    Case("sam", {"sam_rho": 0.05}, ddp=SAM_PROCESS, quick=True),
    Case("asam", {"sam_rho": 0.5, "sam_adaptive": True}, ddp=SAM_PROCESS),
    Case("dropout", {}, accumulation=TORCH_DROPOUT, ddp=TORCH_DROPOUT, dropout=DROPOUT, draws="torch"),
    Case("dropout_example", {}, dropout=DROPOUT, draws="example"),
    Case("rdrop", {"rdrop_alpha": 1.0}, accumulation=TORCH_DROPOUT, ddp=TORCH_DROPOUT, dropout=DROPOUT, draws="torch"),
    Case("rdrop_example", {"rdrop_alpha": 1.0}, dropout=DROPOUT, draws="example"),
    Case(
        "multi_sample_dropout",
        {"head_dropout_samples": 4, "head_dropout": 0.5},
        accumulation=TORCH_DROPOUT,
        ddp=TORCH_DROPOUT,
        draws="torch",
    ),
    Case("multi_sample_dropout_example", {"head_dropout_samples": 4, "head_dropout": 0.5}, draws="example"),
    # SMART at the paper's radius moves the embeddings by 1e-5: its term, and any difference in it, is below
    # round-off. A radius of 0.1 makes the term (and its random start) visible.
    Case(
        "smart",
        {"smart_alpha": 1.0, "smart_epsilon": 0.1, "smart_step_size": 0.1},
        accumulation=CPU_STREAM,
        ddp="SMART's random start N(0, 1e-5^2): " + EACH_PROCESS,
        draws="torch",
    ),
    Case("smart_example", {"smart_alpha": 1.0, "smart_epsilon": 0.1, "smart_step_size": 0.1}, draws="example"),
    Case(
        "neftune",
        {"neftune_noise_alpha": 5.0},
        accumulation=CPU_STREAM,
        ddp="NEFTune's noise (upstream's hook): " + EACH_PROCESS,
    ),
    Case("pooling", {"pooling": "mean"}, task="sequence"),
    Case("reinit_layers", {"reinit_layers": 1}, task="sequence"),
    Case("distillation", {"distill_temperature": 2.0, "distill_alpha": 0.5}, task="sequence", data={"teacher": True}),
    Case("causal_lm", {}, task="causal"),
    Case("scheduled_sampling", {"scheduled_sampling": "constant", "ss_k": 0.0}, task="causal"),
    Case(
        "scheduled_sampling_mixed",
        {"scheduled_sampling": "constant", "ss_k": 0.5},
        accumulation=CPU_STREAM,
        ddp="which tokens take the model's prediction (torch.rand): " + EACH_PROCESS,
        task="causal",
    ),
    Case("tie_encoder_decoder", {"tie_encoder_decoder": "all"}, task="seq2seq"),
]


# ---- Draws per example -----------------------------------------------------------------------------------------


def _seed(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class ExampleDraws:
    """Dropout masks, multi-sample dropout's masks and SMART's random start drawn per example (see the module
    docstring): a forward pre-hook on the model names each row; the draws whose first dimension is the forward's rows
    take row ``i``'s values from a generator seeded by its name and the draw's index in the forward. A draw of another
    shape is counted in ``missed`` (the case then fails: its masks would not be the same)."""

    def __init__(self):
        self.rows: list[int] = []
        self.draw = 0
        self.seen: Counter = Counter()
        self.missed = 0

    def before_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            self.rows = []
            return
        occurrence: Counter = Counter()
        rows = []
        for row in ids.detach().cpu():
            content = row.numpy().tobytes()
            k = occurrence[content]
            occurrence[content] += 1
            rows.append(_seed(content, k, self.seen[(content, k)]))
            self.seen[(content, k)] += 1
        self.rows, self.draw = rows, 0

    def _per_row(self, shape, make) -> torch.Tensor:
        draw, self.draw = self.draw, self.draw + 1
        return torch.stack([make(torch.Generator().manual_seed(_seed(row, draw))) for row in self.rows])

    def dropout(self, original):
        def dropout(input, p=0.5, training=True, inplace=False):
            if not training or p == 0:
                return original(input, p, training, inplace)
            if input.shape[0] != len(self.rows):
                self.missed += 1
                return original(input, p, training, inplace)
            keep = self._per_row(input.shape, lambda g: torch.rand(input.shape[1:], generator=g) >= p)
            return input * keep.to(input.device, input.dtype) / (1 - p)

        return dropout

    def randn(self, original):
        def randn(*size, **kwargs):
            shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
            if not shape or shape[0] != len(self.rows) or kwargs.get("generator") is not None:
                return original(*size, **kwargs)
            dtype = kwargs.get("dtype") or torch.float32
            values = self._per_row(shape, lambda g: torch.randn(shape[1:], generator=g, dtype=dtype))
            return values.to(kwargs.get("device") or "cpu")

        return randn

    def head_masks(self, head):
        def masks(features: torch.Tensor) -> torch.Tensor:
            if features.shape[0] != len(self.rows):
                self.missed += 1
                return type(head).masks(head, features)
            shape = (head.samples, *features.shape[1:])
            keep = self._per_row(shape, lambda g: (torch.rand(shape, generator=g) >= head.p).float())
            return (keep.transpose(0, 1) / (1 - head.p)).to(features.device, features.dtype)

        return masks

    @contextlib.contextmanager
    def active(self, model, trainer):
        handle = model.register_forward_pre_hook(self.before_forward, with_kwargs=True)
        functional, original_dropout, original_randn = torch.nn.functional, torch.nn.functional.dropout, torch.randn
        functional.dropout = self.dropout(original_dropout)
        torch.randn = self.randn(original_randn)
        head = trainer.get_trick(MultiSampleDropoutHead)
        if head is not None:
            head.hooks.masks = self.head_masks(head.hooks)
        try:
            yield self
        finally:
            handle.remove()
            functional.dropout, torch.randn = original_dropout, original_randn


# ---- One optimizer step ----------------------------------------------------------------------------------------


def build(case: Case):
    """The model (seeded), its 4 examples and the trainer / arguments classes of ``case``."""
    dropout = dict(hidden_dropout_prob=case.dropout) if case.dropout else {}
    if case.task == "token":
        return bert_token_cls(**dropout), token_cls_data(n=EXAMPLES), TricksTrainer, TricksArguments
    if case.task == "sequence":
        data = seq_cls_data(n=EXAMPLES)
        if case.data.get("teacher"):
            g = torch.Generator().manual_seed(1)
            data = ListDataset([{**item, "teacher_logits": torch.randn(3, generator=g)} for item in data.items])
        return bert_seq_cls(**dropout), data, TricksTrainer, TricksArguments
    if case.task == "causal":
        return gpt2_lm(), causal_lm_data(n=EXAMPLES), TricksTrainer, TricksArguments
    if case.task == "seq2seq":
        return bart_lm(), seq2seq_data(n=EXAMPLES), Seq2SeqTricksTrainer, Seq2SeqTricksArguments
    raise ValueError(f"unknown task {case.task!r}")


def weights(case: Case, trainer) -> dict[str, torch.Tensor]:
    if case.compare == "ema":
        ema = trainer.get_trick(ExponentialMovingAverage).ema
        return {name: t.detach().clone().float().cpu() for name, t in zip(ema.names, ema.shadow)}
    return {k: v.detach().clone().float().cpu() for k, v in trainer.model.state_dict().items()}


def one_step(case: Case, batch_size: int, accumulation: int, output_dir: str):
    """``(w_0, w_1)``: the weights before and after one optimizer step of ``case`` with this batch split."""
    model, data, trainer_cls, arguments_cls = build(case)
    settings = dict(
        output_dir=output_dir,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        weight_decay=0.0,
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
    )
    settings.update(case.settings)
    args = arguments_cls(**settings)
    trainer = trainer_cls(model=model, args=args, train_dataset=data)
    # After the tricks prepared the model (a CRF's scores, a new pooling head, re-initialised layers).
    start = {k: v.detach().clone().float().cpu() for k, v in trainer.model.state_dict().items()}
    draws = ExampleDraws()
    scope = draws.active(model, trainer) if case.draws == "example" else contextlib.nullcontext()
    with scope, contextlib.redirect_stdout(io.StringIO()):  # upstream's PrinterCallback prints the logs
        trainer.train()
    if draws.missed:
        raise RuntimeError(f"{case.name}: {draws.missed} draws were not per example; the comparison would not hold")
    after = weights(case, trainer)
    if case.compare == "ema":
        start = {name: start[name] for name in after}
    return start, after


def compare(start, a, b) -> dict:
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    step = max((a[k] - start[k]).abs().max().item() for k in a)
    return {"max_abs_diff": diff, "step": step, "relative": diff / step if step > 0 else float("inf")}


def row(case: Case, split: str, expected: str, measured: dict) -> dict:
    differs = measured["relative"] >= ROUND_OFF
    same = expected in (EXACT, CPU_STREAM)
    as_expected = differs != same
    return {
        "benchmark": "exactness",
        "case": case.name,
        "setting": case.setting(),
        "split": split,
        **measured,
        "measured": "differs" if differs else "round-off",
        "expected": "round-off" if same else "differs",
        "cause": "float round-off (summation order)" if expected == EXACT else expected,
        "as_expected": as_expected,
    }


# ---- 2 processes -------------------------------------------------------------------------------------------------


def ddp_worker(names: list[str], out: Path) -> None:
    """Run under ``accelerate launch --num_processes 2``: each case with 2 examples per process; rank 0 saves the
    weights (``{case}.pt``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        raise SystemExit("--worker runs under accelerate launch --num_processes 2 (run --ddp instead)")
    for case in (c for c in CASES if c.name in names):
        with tempfile.TemporaryDirectory() as tmp:
            _, after = one_step(case, EXAMPLES // 2, 1, tmp)
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(after, out / f"{case.name}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_ddp(names: list[str], out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(port), __file__, "--worker", str(out), "--only", ",".join(names)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the 2 processes run on the CPU (gloo)
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"the 2-process run failed (exit {proc.returncode})")


# ---- Main ----------------------------------------------------------------------------------------------------------


def quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp", action="store_true", help="also 2 processes x 2 examples against 1 process x 4")
    parser.add_argument("--quick", action="store_true", help="a few cases: seconds")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (one line, last)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the 2-process half of --ddp
    args = parser.parse_args(argv)
    quiet()

    cases = [c for c in CASES if not args.quick or c.quick]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {c.name for c in CASES})
        if unknown:
            parser.error(f"--only names unknown cases {unknown}; the cases are {', '.join(c.name for c in CASES)}")
        cases = [c for c in CASES if c.name in wanted]
    if args.worker is not None:
        ddp_worker([c.name for c in cases], Path(args.worker))
        return 0

    began = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        references = {}
        for case in cases:
            start, whole = one_step(case, EXAMPLES, 1, str(tmp / f"{case.name}_4x1"))
            _, split = one_step(case, EXAMPLES // 2, 2, str(tmp / f"{case.name}_2x2"))
            references[case.name] = (start, whole)
            rows.append(row(case, "accumulation: 2 x 2 vs 4 x 1", case.accumulation, compare(start, whole, split)))
        if args.ddp:
            run_ddp([c.name for c in cases], tmp)
            for case in cases:
                start, whole = references[case.name]
                ddp = torch.load(tmp / f"{case.name}.pt", weights_only=True)
                rows.append(row(case, "ddp: 2 processes x 2 vs 1 x 4", case.ddp, compare(start, whole, ddp)))
    elapsed = time.perf_counter() - began

    threads = f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    print(f"One SGD step (lr 0.5), batch of 4; {threads}; {elapsed:.0f} s")
    print(f"round-off: relative < {ROUND_OFF:g}\n")
    print("| case | setting | split | max abs diff | step | relative | measured | cause |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        flag = "" if r["as_expected"] else " UNEXPECTED"
        print(
            f"| {r['case']} | {r['setting']} | {r['split']} | {r['max_abs_diff']:.1e} | {r['step']:.3f} | "
            f"{r['relative']:.1e} | {r['measured']}{flag} | {r['cause']} |"
        )
    unexpected = [f"{r['case']} ({r['split']})" for r in rows if not r["as_expected"]]
    if unexpected:
        print(f"\nUNEXPECTED: {', '.join(unexpected)}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
