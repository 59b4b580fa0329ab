"""Line-numbered readers for CoNLL, JSON lines, CSV and TSV files, and label checks across splits."""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "DataError",
    "read_conll",
    "read_jsonl",
    "read_csv",
    "read_ner_file",
    "read_table_file",
    "check_labels",
    "label_list",
    "split_examples",
]

CONLL_SUFFIXES = (".conll", ".conllu", ".txt", ".tsv", ".iob", ".bio")
JSONL_SUFFIXES = (".jsonl", ".json")
CSV_SUFFIXES = (".csv",)
TSV_SUFFIXES = (".tsv",)


class DataError(ValueError):
    """Input data the recipes cannot use; ``str()`` is ``file:line: message`` (``file: message`` without a line)."""

    def __init__(self, path: str | Path | None, line: int | None, message: str):
        self.path = None if path is None else str(path)
        self.line = line
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.path is None:
            return self.message
        if self.line is None:
            return f"{self.path}: {self.message}"
        return f"{self.path}:{self.line}: {self.message}"


def _read_lines(path: str | Path) -> list[str]:
    """The file's lines (without line ends), decoded as UTF-8; a byte that is not UTF-8 is an error on its line."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise DataError(path, None, f"cannot read the file: {err.strerror}") from None
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    decoded = []
    for number, raw in enumerate(lines, start=1):
        try:
            decoded.append(raw.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as err:
            raise DataError(
                path, number, f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
            ) from None
    return decoded


def read_conll(path: str | Path) -> list[dict]:
    """Read a CoNLL file: token in the first column, tag in the last, a blank line between sentences.

    Columns are separated by whitespace or tabs, so CoNLL-2003's four columns (token POS chunk NER) work. Lines that
    start with ``-DOCSTART-`` are skipped. Each example is ``{"tokens", "ner_tags", "line", "tag_lines"}``, the last
    two being the line of the sentence's first token and of each tag (for error messages).
    """
    examples, tokens, tags, tag_lines = [], [], [], []

    def flush():
        if tokens:
            examples.append(
                {"tokens": list(tokens), "ner_tags": list(tags), "line": tag_lines[0], "tag_lines": list(tag_lines)}
            )
            tokens.clear(), tags.clear(), tag_lines.clear()

    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            flush()
            continue
        columns = line.split()
        if columns[0] == "-DOCSTART-":
            flush()
            continue
        if len(columns) < 2:
            raise DataError(
                path, number, f"token {columns[0]!r} has no tag; expected 'token tag' (token first, tag last)"
            )
        tokens.append(columns[0])
        tags.append(columns[-1])
        tag_lines.append(number)
    flush()
    if not examples:
        raise DataError(path, None, "empty file: no sentences")
    return examples


def read_jsonl(path: str | Path, fields: Sequence[str]) -> list[dict]:
    """Read JSON lines (one object per line) with the given fields; each example also gets its ``line``."""
    examples = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(path, number, f"not valid JSON ({err.msg}); expected one JSON object per line") from None
        if not isinstance(record, dict):
            raise DataError(path, number, f"expected a JSON object, got {type(record).__name__}")
        missing = [name for name in fields if name not in record]
        if missing:
            raise DataError(path, number, f"record has no field {missing[0]!r}; it has {sorted(record)}")
        examples.append({**{name: record[name] for name in fields}, "line": number})
    if not examples:
        raise DataError(path, None, "empty file: no records")
    return examples


def read_csv(path: str | Path, fields: Sequence[str], delimiter: str = ",") -> list[dict]:
    """Read a CSV file with a header row holding the given columns; each example also gets its ``line``.

    ``delimiter="\t"`` reads TSV (tab-separated values, Python's ``excel-tab`` dialect: what ``csv.writer`` and
    pandas write). A TSV value may be quoted as in CSV (needed only for a tab or a line break inside it), and a quote
    that opens a value must close it: ``"Hi," she said<TAB>pos`` is an error on its line rather than a text that
    silently loses its quotes.
    """
    kind = "TSV" if delimiter == "\t" else "CSV"
    lines = _read_lines(path)
    if not lines:
        raise DataError(path, None, "empty file: no header row")
    reader = csv.DictReader(io.StringIO("\n".join(lines) + "\n"), delimiter=delimiter, strict=kind == "TSV")
    try:
        header = reader.fieldnames or []
    except csv.Error as err:
        raise DataError(path, 1, f"not valid {kind} ({err})") from None
    missing = [name for name in fields if name not in header]
    if missing:
        hint = "; is it tab-separated? name it .tsv" if kind == "CSV" and "\t" in lines[0] else ""
        raise DataError(path, 1, f"no column {missing[0]!r}; the header has {header}{hint}")
    examples = []
    try:
        for row in reader:
            number = reader.line_num
            empty = [name for name in fields if row.get(name) is None]
            if empty:
                raise DataError(path, number, f"row has no value for column {empty[0]!r}")
            examples.append({**{name: row[name] for name in fields}, "line": number})
    except csv.Error as err:
        # DictReader's own line_num is that of the last good row; its csv.reader's is the failing line's.
        raise DataError(path, reader.reader.line_num, f"not valid {kind} ({err})") from None
    if not examples:
        raise DataError(path, None, "empty file: a header row but no records")
    return examples


def read_ner_file(path: str | Path, tokens_field: str = "tokens", tags_field: str = "ner_tags") -> list[dict]:
    """Read NER examples from CoNLL or JSON lines (by suffix), as ``{"tokens", "ner_tags", "line", "tag_lines"}``."""
    suffix = Path(path).suffix.lower()
    if suffix not in JSONL_SUFFIXES:
        return read_conll(path)
    examples = read_jsonl(path, [tokens_field, tags_field])
    out = []
    for ex in examples:
        tokens, tags, line = ex[tokens_field], ex[tags_field], ex["line"]
        for name, value in ((tokens_field, tokens), (tags_field, tags)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise DataError(path, line, f"field {name!r} must be a list of strings")
        if len(tokens) != len(tags):
            raise DataError(
                path, line, f"{len(tokens)} {tokens_field} but {len(tags)} {tags_field}; they must be the same length"
            )
        if not tokens:
            raise DataError(path, line, f"field {tokens_field!r} is empty")
        out.append({"tokens": tokens, "ner_tags": tags, "line": line, "tag_lines": [line] * len(tags)})
    return out


def read_table_file(path: str | Path, fields: Sequence[str], list_fields: Sequence[str] = ()) -> list[dict]:
    """Read CSV, TSV or JSON lines (by suffix) with the given fields; values become strings.

    A JSON field named in ``list_fields`` may also hold a list of strings / numbers, kept as a list of strings
    (multi-label classification's ``["pos", "funny"]``); in CSV / TSV every value is a string.
    """
    suffix = Path(path).suffix.lower()
    if suffix in CSV_SUFFIXES:
        return read_csv(path, fields)
    if suffix in TSV_SUFFIXES:
        return read_csv(path, fields, delimiter="\t")
    if suffix in JSONL_SUFFIXES:
        examples = read_jsonl(path, fields)
        for ex in examples:
            for name in fields:
                value = ex[name]
                if name in list_fields and isinstance(value, list):
                    if not all(_is_scalar(item) for item in value):
                        raise DataError(
                            path, ex["line"], f"field {name!r} must be a list of strings or numbers, got {value!r}"
                        )
                    ex[name] = [str(item) for item in value]
                    continue
                if not _is_scalar(value):
                    what = "a string, a number or a list of them" if name in list_fields else "a string or a number"
                    raise DataError(path, ex["line"], f"field {name!r} must be {what}, got {value!r}")
                ex[name] = str(value)
        return examples
    raise DataError(path, None, f"unknown file type {suffix!r}; use .csv, .tsv, .json or .jsonl (JSON lines)")


def _is_scalar(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, str | int | float)


def label_list(examples: Iterable[dict], key: str) -> list[str]:
    """The sorted set of labels under ``key`` (a label or a list of tags per example)."""
    labels = set()
    for ex in examples:
        value = ex[key]
        labels.update(value if isinstance(value, list) else [value])
    return sorted(labels)


def check_labels(examples: Iterable[dict], key: str, known: Iterable[str], path: str | Path) -> None:
    """Raise a :class:`DataError` at the first label under ``key`` that is not in ``known`` (the training labels)."""
    known = set(known)
    for ex in examples:
        value = ex[key]
        if isinstance(value, list):
            for tag, line in zip(value, ex.get("tag_lines") or [ex.get("line")] * len(value)):
                if tag not in known:
                    raise DataError(path, line, f"label {tag!r} does not occur in the training data {sorted(known)}")
        elif value not in known:
            raise DataError(
                path, ex.get("line"), f"label {value!r} does not occur in the training data {sorted(known)}"
            )


def split_examples(
    examples: Sequence, fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 42
) -> tuple[list, ...]:
    """Shuffle with a fixed ``seed`` and cut into consecutive parts of the given fractions (deterministic)."""
    if abs(sum(fractions) - 1.0) > 1e-9 or any(f < 0 for f in fractions):
        raise ValueError(f"fractions={tuple(fractions)} is not allowed; they must be >= 0 and sum to 1")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    parts, start = [], 0
    for i, fraction in enumerate(fractions):
        end = len(order) if i == len(fractions) - 1 else start + round(fraction * len(order))
        parts.append([examples[j] for j in order[start:end]])
        start = end
    return tuple(parts)


def kfold_examples(
    examples: Sequence, num_folds: int, fold: int, seed: int = 42, validation_fraction: float = 0.1
) -> tuple[list, list, list]:
    """``(train, validation, test)`` of fold ``fold`` in a ``num_folds``-fold cross-validation, deterministic.

    The examples are shuffled once with ``seed`` (so every fold of every configuration cuts the same folds); example
    ``i`` of that order is in fold ``i % num_folds``. The test part is the fold; ``validation_fraction`` of the rest
    is held out for validation (choosing a learning rate, early stopping), never the test fold.
    """
    if int(num_folds) != num_folds or num_folds < 2:
        raise ValueError(f"num_folds={num_folds} is not allowed; it must be an integer >= 2")
    if not 0 <= fold < num_folds:
        raise ValueError(f"fold={fold} is not allowed; it must be in [0, {num_folds - 1}]")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    test = [examples[j] for i, j in enumerate(order) if i % num_folds == fold]
    rest = [examples[j] for i, j in enumerate(order) if i % num_folds != fold]
    n_validation = round(validation_fraction * len(rest))
    return rest[n_validation:], rest[:n_validation], test
