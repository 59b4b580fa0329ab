"""Arrow-backed datasets built from the checked readers: memory flat in the number of rows, cached by file content.

A reader (``iter_csv``, ``iter_conll``, ...) checks a file line by line; :func:`arrow_dataset` writes what it yields
to an Arrow file in the ``datasets`` cache (``HF_DATASETS_CACHE/nlp_tricks_data``) a batch at a time, which the
returned dataset memory-maps (``Dataset.from_file``; ``Dataset.from_generator`` does the same four times slower,
one example at a time). The dataset's fingerprint is the file's path, size and modification time plus the
reading settings, so a rerun on the same file reads the Arrow file back without reading the data again, and the
``map`` calls that tokenize it find their own cached results (``datasets`` keys those by this fingerprint, the
function and its arguments, the tokenizer included). A file that fails a check leaves no cache entry behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from .readers import DataError

__all__ = [
    "arrow_dataset",
    "file_signature",
    "take_rows",
    "iter_rows",
    "as_dataset",
    "first_rows",
    "column_values",
    "distinct_values",
]

# Bump when what a reader yields changes, so that no cached Arrow file of an older reader is read back.
READER_VERSION = "1"


def file_signature(path: str | Path) -> list:
    """``[absolute path, size, modification time in ns]`` of ``path``: what a cached dataset of it is keyed by."""
    try:
        stat = os.stat(path)
    except OSError as err:
        raise DataError(path, None, f"cannot read the file: {err.strerror}") from None
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def arrow_dataset(generate: Callable[[], Iterator[dict]], features, key: Sequence, batch_size: int = 1000):
    """A ``datasets.Dataset`` of the examples ``generate()`` yields, written to an Arrow file with ``features``.

    ``key`` (JSON-like values: a :func:`file_signature`, the reading settings) names the data: the same key reads the
    cached Arrow file back instead of calling ``generate`` (put everything the examples depend on in it). The file is
    written ``batch_size`` examples at a time under a temporary name and renamed when complete, so a
    :class:`DataError` (or any error) while generating leaves nothing in the cache.
    """
    from datasets import Dataset, config
    from datasets.arrow_writer import ArrowWriter
    from datasets.fingerprint import Hasher

    fingerprint = Hasher.hash([READER_VERSION, list(key), str(features)])
    folder = Path(config.HF_DATASETS_CACHE) / "nlp_tricks_data"
    path = folder / f"{fingerprint}.arrow"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{fingerprint}.{os.getpid()}.tmp"
        try:
            with ArrowWriter(features=features, path=str(tmp)) as writer:
                batch = []
                for example in generate():
                    batch.append(example)
                    if len(batch) == batch_size:
                        writer.write_batch({name: [ex.get(name) for ex in batch] for name in features})
                        batch.clear()
                if batch:
                    writer.write_batch({name: [ex.get(name) for ex in batch] for name in features})
                writer.finalize()
            os.replace(tmp, path)  # another process may have written the same file: either copy is the same data
        finally:
            tmp.unlink(missing_ok=True)
    dataset = Dataset.from_file(str(path))
    dataset._fingerprint = fingerprint  # what the cached tokenizations of it are keyed by
    return dataset


def take_rows(dataset, indices: Sequence[int], batch_size: int = 10_000):
    """The rows of ``dataset`` at ``indices``, in that order: the same rows as ``dataset.select(indices)``, written
    in that order to an Arrow file of their own when the dataset is file-backed, so that reading them is reading a
    file front to back.

    ``select`` keeps an indices mapping, and ``datasets`` reads a mapped row as a table slice of its own (a Python
    loop per row, in every ``map``, ``iter`` and label check of a shuffled split: most of the time the recipes spent
    on a large file beyond tokenizing). Here Arrow's own ``take`` copies the rows ``batch_size`` at a time into the
    ``datasets`` cache (``HF_DATASETS_CACHE/nlp_tricks_data``), keyed by the dataset's fingerprint and the indices,
    so a rerun reads the copy back and the tokenizations of it find their cache. An in-memory dataset, a dataset
    that is already a mapping and a contiguous range are ``select``-ed as they are.
    """
    from datasets import Dataset, config
    from datasets.arrow_writer import ArrowWriter
    from datasets.fingerprint import Hasher

    indices = [int(i) for i in indices]
    contiguous = all(b - a == 1 for a, b in zip(indices, indices[1:]))
    if contiguous or not dataset.cache_files or getattr(dataset, "_indices", None) is not None:
        return dataset.select(indices)
    fingerprint = Hasher.hash([READER_VERSION, "take_rows", dataset._fingerprint, indices])
    folder = Path(config.HF_DATASETS_CACHE) / "nlp_tricks_data"
    path = folder / f"{fingerprint}.arrow"
    if not path.is_file():
        import pyarrow as pa

        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{fingerprint}.{os.getpid()}.tmp"
        table = dataset.data.table
        try:
            with ArrowWriter(features=dataset.features, path=str(tmp)) as writer:
                for start in range(0, len(indices), batch_size):
                    writer.write_table(table.take(pa.array(indices[start : start + batch_size], pa.int64())))
                writer.finalize()
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    rows = Dataset.from_file(str(path))
    rows._fingerprint = fingerprint
    return rows


def as_dataset(examples):
    """``examples`` as a ``datasets.Dataset``: a dataset stays itself, a list of dicts becomes one (in memory)."""
    from datasets import Dataset

    if isinstance(examples, Dataset):
        return examples
    return Dataset.from_list(list(examples))


def first_rows(examples, n: int | None):
    """The first ``n`` examples (all with None) of a list or a dataset, without copying a dataset's rows."""
    if n is None or n >= len(examples):
        return examples
    return examples.select(range(n)) if hasattr(examples, "select") else examples[:n]


def iter_rows(examples, batch_size: int = 1000) -> Iterator[dict]:
    """The examples of a list or a dataset one at a time, a dataset's read ``batch_size`` rows at a time (iterating a
    ``Dataset`` itself formats one row per read)."""
    if isinstance(examples, list) or not hasattr(examples, "iter"):
        yield from examples
        return
    for batch in examples.iter(batch_size=batch_size):
        names = list(batch)
        yield from (dict(zip(names, values)) for values in zip(*(batch[name] for name in names)))


def column_values(dataset, column: str, batch_size: int = 10_000) -> Iterator:
    """The values of one column, read batch by batch from the Arrow file (a list column's lists as lists)."""
    for batch in dataset.select_columns([column]).with_format("arrow").iter(batch_size):
        yield from batch.column(column).to_pylist()


def distinct_values(dataset, column: str, batch_size: int = 10_000) -> set:
    """Each value of a column (of a list column: each item of its lists) once, read batch by batch."""
    import pyarrow as pa
    import pyarrow.compute as pc

    seen = set()
    for batch in dataset.select_columns([column]).with_format("arrow").iter(batch_size):
        values = batch.column(column)
        if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            values = pc.list_flatten(values)
        seen.update(pc.unique(values).to_pylist())
    return seen
