"""What a checkpoint's checksum manifest costs: CRC-32 of a ~500 MB weights file against writing it, and the other
checksums of the standard library that were candidates.

    python benchmarks/checkpoint_checksum.py            # a 500 MB safetensors file (125M float32): docs/checkpoints.md
    python benchmarks/checkpoint_checksum.py --quick    # 5 MB, seconds

Cases, each timed in interleaved rounds (the order rotates; ``_timing.py``):

- save: ``safetensors.torch.save_file`` of the state dict (what a checkpoint's model file costs), the baseline;
- crc32: :func:`nlp_tricks.runtime.integrity.file_crc32` of that file (what the manifest adds per file at save time,
  and what resume reads once per file), its cache cleared each time;
- read: the file read in the same 8 MiB chunks without a checksum (the part of crc32 that is I/O);
- blake2b, sha256: ``hashlib`` over the same chunks (the alternatives).

The file was just written, so it is read from the page cache, as the manifest reads it at save time; a resume in a
new process may read it from the disk instead, at the disk's speed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile

import torch
from _timing import paired_ratio, time_interleaved
from safetensors.torch import save_file

from nlp_tricks.runtime import integrity

CHUNK = 8 << 20


def _hash_file(path: str, name: str | None) -> None:
    digest = hashlib.new(name) if name else None
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            if digest is not None:
                digest.update(chunk)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 5 MB file, 2 rounds")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON on the last line")
    parser.add_argument("--dir", default=None, help="where to write the file (default: the system's temp folder)")
    args = parser.parse_args(argv)
    numel = (5 if args.quick else 500) * 1_000_000 // 4
    repeats = 2 if args.quick else 5
    # A few tensors, as a model's state dict holds many; the sizes do not matter to the file's bytes.
    state = {f"w{i}": torch.randn(numel // 4) for i in range(4)}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = os.path.join(folder, "model.safetensors")
        save_file(state, path)

        def crc32():
            integrity._crc_cache.clear()
            integrity.file_crc32(path)

        steps = {
            "save": lambda: save_file(state, path),
            "crc32": crc32,
            "read": lambda: _hash_file(path, None),
            "blake2b": lambda: _hash_file(path, "blake2b"),
            "sha256": lambda: _hash_file(path, "sha256"),
        }
        times = time_interleaved(steps, repeats)
        size_mb = os.path.getsize(path) / 1e6
    rows = []
    for case in steps:
        median = statistics.median(times[case])
        rows.append(
            {
                "benchmark": "checkpoint_checksum",
                "case": f"{case} ({size_mb:.0f} MB, {size_mb / median:.0f} MB/s)",
                "baseline": "save",
                "ratio": paired_ratio(times, case, "save"),
                "median_ms": 1e3 * median,
            }
        )
    for r in rows:
        print(f"{r['case']:<32} {r['median_ms']:9.1f} ms  {r['ratio']:.2f}x the save")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
