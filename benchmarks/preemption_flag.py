"""The cost of combining the preemption flag across processes: one all-reduce of one number per optimizer step.

    accelerate launch --multi_gpu --num_processes 2 benchmarks/preemption_flag.py           # MiniLM-shaped BERT
    accelerate launch --multi_gpu --num_processes 2 benchmarks/preemption_flag.py --quick   # a tiny BERT, seconds

On CPUs the processes use gloo, on GPUs NCCL. One optimizer step = forward/backward of a BertForTokenClassification
under DDP (batch 8 x 64 a process) + SGD step + zero_grad. Variants, interleaved in rotating rounds
(``_timing.py``): the step alone, the same step again under another label (its ratio to the first is the noise
floor), and the step followed by ``PreemptionCallback``'s combine (what every step boundary runs when
``enable_jit_checkpoint`` or a time budget is set). Printed on rank 0: the median step time of each, the median
per-round ratios, and the combine alone (after a barrier, so no process waits for another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from _timing import paired_ratio, synchronize, time_interleaved
from accelerate import Accelerator
from transformers import BertConfig, BertForTokenClassification

from nlp_tricks.runtime.preemption import PreemptionCallback

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny BERT, vocab 1000, batch 4 x 16, 5 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 20, 5 with --quick)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (benchmarks/run_all.py)")
    cli = parser.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    shape = TINY if cli.quick else MINILM
    vocab, batch, length = (1000, 4, 16) if cli.quick else (30522, 8, 64)
    model = BertForTokenClassification(BertConfig(vocab_size=vocab, num_labels=9, **shape))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs = {
        "input_ids": torch.randint(0, vocab, (batch, length), device=accelerator.device),
        "labels": torch.randint(0, 9, (batch, length), device=accelerator.device),
    }
    callback = PreemptionCallback(signals=())
    args = SimpleNamespace(device=accelerator.device)

    def step():
        loss = model(**inputs).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def step_and_combine():
        step()
        callback._combine(0, args)

    repeats = cli.repeats or (5 if cli.quick else 20)
    # "step again" is the same step under another label: its ratio to "step" is the noise of this machine.
    times = time_interleaved({"step": step, "step again": step, "step + combine": step_and_combine}, repeats)

    combine_alone = []
    for _ in range(repeats * 5):
        torch.distributed.barrier()
        synchronize()
        start = time.perf_counter()
        callback._combine(0, args)
        synchronize()
        combine_alone.append(time.perf_counter() - start)

    results = {
        "processes": accelerator.num_processes,
        "backend": torch.distributed.get_backend(),
        "threads": torch.get_num_threads(),
        "step_ms": 1e3 * statistics.median(times["step"]),
        "step_and_combine_ms": 1e3 * statistics.median(times["step + combine"]),
        "ratio": paired_ratio(times, "step + combine", "step"),
        "noise_ratio": paired_ratio(times, "step again", "step"),
        "combine_alone_ms": 1e3 * statistics.median(combine_alone),
    }
    if accelerator.is_main_process:
        if cli.json:  # rows as benchmarks/run_all.py reads them: each a time against the step alone
            cases = {
                "step + combine": (results["ratio"], results["step_and_combine_ms"]),
                "step again (noise)": (results["noise_ratio"], 1e3 * statistics.median(times["step again"])),
                "combine alone": (results["combine_alone_ms"] / results["step_ms"], results["combine_alone_ms"]),
            }
            rows = [
                dict(benchmark="preemption_flag", case=case, baseline="step", ratio=ratio, median_ms=ms)
                for case, (ratio, ms) in cases.items()
            ]
            print(json.dumps(rows))
        else:
            for key, value in results.items():
                print(f"{key:>22}: {value:.4g}" if isinstance(value, float) else f"{key:>22}: {value}")
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
