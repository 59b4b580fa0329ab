"""Line-numbered readers for CoNLL, JSON lines, CSV, TSV and plain-text files, and label checks across splits.

A reader refuses what it cannot read correctly (``DataError``, ``file:line: message``) rather than guess: an empty
label, a CoNLL token holding a space, a CoNLL file with the tag first, a tag column that mixes ``B-``/``I-`` tags
with words. Comment lines of CoNLL files (``# id ...`` as MultiCoNER and CoNLL-U write them) are skipped.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from decimal import Decimal
from pathlib import Path

__all__ = [
    "DataError",
    "read_conll",
    "read_jsonl",
    "read_csv",
    "read_ner_file",
    "read_table_file",
    "read_text_sentences",
    "read_conll_tokens",
    "iter_conll",
    "iter_jsonl",
    "iter_csv",
    "iter_ner_file",
    "iter_table_file",
    "iter_text_sentences",
    "canonical_label",
    "check_labels",
    "label_list",
    "split_examples",
    "looks_like_tag",
    "check_tag_columns",
    "subtoken_tags",
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
    return [line for _, line in _iter_lines(path)]


def _iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, line without its line end)`` of the file, read as a stream (the file is never whole in
    memory), decoded as UTF-8; a byte that is not UTF-8 is an error on its line."""
    try:
        f = Path(path).open("rb")
    except OSError as err:
        raise DataError(path, None, f"cannot read the file: {err.strerror}") from None
    with f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if raw.endswith(b"\n"):
                raw = raw[:-1]
            try:
                yield number, raw.decode("utf-8").rstrip("\r")
            except UnicodeDecodeError as err:
                raise DataError(
                    path, number, f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
                ) from None


# A tag of the IOB family (IOB1/IOB2, IOE, BIOES, BILOU): "O" or a one-letter prefix, a hyphen and a type.
_TAG = re.compile(r"O|[BIESLU]-\S+")
_PREFIXED_TAG = re.compile(r"[BIESLU]-\S+")


def looks_like_tag(value: str) -> bool:
    """Whether ``value`` reads as an IOB-family tag: ``O`` or ``B-``/``I-``/``E-``/``S-``/``L-``/``U-`` and a type."""
    return _TAG.fullmatch(value) is not None


def _columns(text: str) -> list[str]:
    """The columns of a stripped CoNLL line: split on tabs when it has one, else on runs of whitespace."""
    if "\t" in text:
        return [column.strip() for column in text.split("\t")]
    return text.split()


def _is_comment_candidate(text: str) -> bool:
    return text == "#" or (text.startswith("#") and text[1].isspace())


def read_conll(path: str | Path) -> list[dict]:
    """Read a CoNLL file: token in the first column, tag in the last, a blank line between sentences.

    Columns are separated by tabs (when a line has one) or by whitespace, so CoNLL-2003's four columns (token POS
    chunk NER) work. A tab-separated line may have any number of columns between the token and the tag (corpora with
    optional reading or feature columns), and a no-break space inside one is part of it (``10\u00a0000``); every
    space-separated line of a sentence has the same number of columns. Lines that start with ``-DOCSTART-`` are
    skipped, and so are comment lines before a sentence: a line that starts with ``#`` and a space and does not read
    as a token line of the file (``# id 5a3f...  domain=en`` as MultiCoNER writes them, CoNLL-U's ``# text = ...``);
    ``#  O`` stays the token ``#`` with its tag. Each example is ``{"tokens", "ner_tags", "line", "tag_lines"}``, the
    last two being the line of the sentence's first token and of each tag (for error messages).

    Raises :class:`DataError` (``file:line``) on a token without a tag, a column holding a space (``New York<TAB>
    B-LOC``: whitespace-separated readers would keep ``New``), a space-separated line with more or fewer columns than
    its sentence's first (``New York B-LOC`` among ``token tag`` lines), a comment line inside a sentence, a
    tag-first file and a tag column mixing IOB tags with other words (see :func:`check_tag_columns`).
    """
    return _read_conll(path, tagged=True)


def read_conll_tokens(path: str | Path) -> list[dict]:
    """Read unlabelled CoNLL-style text: one word per line in the first column (other columns, e.g. a gold tag,
    are ignored), a blank line between sentences, as ``{"tokens", "line"}``.

    The rules of :func:`read_conll` apply: ``-DOCSTART-`` and comment lines skipped, a column holding a space or a
    space-separated line with another column count than its sentence's refused.
    """
    return [{"tokens": ex["tokens"], "line": ex["line"]} for ex in _read_conll(path, tagged=False)]


def _read_conll(path: str | Path, tagged: bool) -> list[dict]:
    return list(iter_conll(path, tagged))


def iter_conll(path: str | Path, tagged: bool = True) -> Iterator[dict]:
    """The examples of :func:`read_conll` (``tagged``) or :func:`read_conll_tokens`, one sentence at a time.

    The file is read twice as a stream (its shape first, then its sentences), so memory does not grow with it; an
    error found only at the end (a tag-first file) is raised after the last sentence.
    """
    # The file's shape from its plain token lines: their column counts and the tags they use.
    widths, tags_used = set(), set()
    for entry in _conll_entries(path):
        if entry is not None and not _is_comment_candidate(entry[1]):
            columns = _columns(entry[1])
            widths.add(len(columns))
            if len(columns) >= 2:
                tags_used.add(columns[-1])

    def reads_as_token_line(columns: list[str], tabbed: bool) -> bool:
        if (not tabbed and len(columns) not in widths) or any(_has_space(column, tabbed) for column in columns):
            return False
        if not tagged:
            return True
        return len(columns) >= 2 and (columns[-1] in tags_used or looks_like_tag(columns[-1]))

    tokens, tags, tag_lines = [], [], []
    sentence_width, width_line = None, None  # the column count of the sentence's first space-separated line
    found = False
    tag_check = _TagColumnCheck(path)

    def sentence():
        nonlocal sentence_width
        sentence_width = None
        example = {"tokens": list(tokens), "ner_tags": list(tags), "line": tag_lines[0], "tag_lines": list(tag_lines)}
        tokens.clear(), tags.clear(), tag_lines.clear()
        if tagged:
            tag_check.add(example)
            return example
        return {"tokens": example["tokens"], "line": example["line"]}

    for entry in _conll_entries(path):
        if entry is None:
            if tokens:
                found = True
                yield sentence()
            continue
        number, text = entry
        columns, tabbed = _columns(text), "\t" in text
        if _is_comment_candidate(text) and not reads_as_token_line(columns, tabbed):
            if tokens:
                raise DataError(
                    path,
                    number,
                    f"comment line {_shorten(text)!r} inside a sentence; a comment goes before a sentence's first "
                    "token (after a blank line)",
                )
            continue
        for k, column in enumerate(columns):
            if _has_space(column, tabbed):
                what = "token" if k == 0 else "tag" if k == len(columns) - 1 else f"column {k + 1}"
                raise DataError(
                    path,
                    number,
                    f"{what} {column!r} holds a space, and whitespace separates the columns of a CoNLL file; write "
                    "one word per line (or use JSON lines)",
                )
        if tagged and len(columns) < 2:
            raise DataError(
                path, number, f"token {columns[0]!r} has no tag; expected 'token tag' (token first, tag last)"
            )
        # Tabs make the columns unambiguous (token first, tag last, any number between, as corpora with optional
        # reading or feature columns write them); with spaces a changing count is a token that holds a space.
        if not tabbed:
            if sentence_width is None:
                sentence_width, width_line = len(columns), number
            elif len(columns) != sentence_width:
                raise DataError(
                    path,
                    number,
                    f"{len(columns)} columns where line {width_line} has {sentence_width}; every space-separated line "
                    "of a sentence has the same columns (a token cannot hold a space)",
                )
        tokens.append(columns[0])
        tags.append(columns[-1])
        tag_lines.append(number)
    if tokens:
        found = True
        yield sentence()
    if not found:
        raise DataError(path, None, "empty file: no sentences")
    if tagged:
        tag_check.finish()


def _conll_entries(path: str | Path) -> Iterator[tuple[int, str] | None]:
    """``(line number, stripped text)`` of each line of a CoNLL file; None for a sentence break."""
    for number, line in _iter_lines(path):
        text = line.strip()
        yield None if not text or text.split()[0] == "-DOCSTART-" else (number, text)


def _has_space(text: str, tabbed: bool = False) -> bool:
    """Whether a column holds whitespace that would split it. Between tabs only the ASCII space counts: a no-break or
    ideographic space (``10\u00a0000``) is part of the token there, while ``New York`` is what a space-separated line's
    columns look like to every other reader."""
    if tabbed:
        return any(char.isspace() and char.isascii() for char in text)
    return any(char.isspace() for char in text)


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_tag_columns(examples: Iterable[dict], path: str | Path) -> None:
    """Refuse NER examples whose tags are not tags: a tag-first file, or IOB tags mixed with other words.

    - Tag-first (``B-PER John``): every token reads as an IOB tag (:func:`looks_like_tag`) while some tag does not.
    - A tag column with ``B-``/``I-``/... tags and a value that is neither ``O`` nor such a tag (a word, a stray
      column): seqeval would score it as an entity type made of its letters.

    Tag sets without prefixes (``PER``, ``O``) pass. Raises :class:`DataError` at the first offending tag's line.
    """
    check = _TagColumnCheck(path)
    for ex in examples:
        check.add(ex)
    check.finish()


class _TagColumnCheck:
    """:func:`check_tag_columns` one example at a time: what it needs of the file is kept, not the file."""

    def __init__(self, path: str | Path):
        self.path = path
        self.all_tokens_tags = True  # so far every token reads as a tag
        self.first_word_tag = None  # (token, tag, line) of the first tag that does not read as a tag
        self.prefixed_example = None  # the first B-/I-/... tag

    def add(self, ex: dict) -> None:
        lines = ex.get("tag_lines") or [ex.get("line")] * len(ex["ner_tags"])
        for token, tag, line in zip(ex["tokens"], ex["ner_tags"], lines):
            if self.all_tokens_tags and not looks_like_tag(token):
                self.all_tokens_tags = False
            if self.first_word_tag is None and not looks_like_tag(tag):
                self.first_word_tag = (token, tag, line)
            if self.prefixed_example is None and _PREFIXED_TAG.fullmatch(tag):
                self.prefixed_example = tag

    def finish(self) -> None:
        if self.first_word_tag is None:
            return
        token, tag, line = self.first_word_tag
        if self.all_tokens_tags:
            raise DataError(
                self.path,
                line,
                f"the tag {tag!r} reads as a word and its token {token!r} as a tag, as on every line: is the tag "
                "first? NER data has the token first and the tag last",
            )
        if self.prefixed_example is not None:
            raise DataError(
                self.path,
                line,
                f"tag {tag!r} is neither 'O' nor a prefixed tag like the file's {self.prefixed_example!r}; the tag "
                "goes last and every tag of an IOB file is 'O' or 'B-TYPE' / 'I-TYPE' / 'E-TYPE' / 'S-TYPE'",
            )


def read_jsonl(path: str | Path, fields: Sequence[str]) -> list[dict]:
    """Read JSON lines (one object per line) with the given fields; each example also gets its ``line``."""
    return list(iter_jsonl(path, fields))


def iter_jsonl(path: str | Path, fields: Sequence[str]) -> Iterator[dict]:
    """The examples of :func:`read_jsonl`, one line at a time."""
    found = False
    for number, line in _iter_lines(path):
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
        found = True
        yield {**{name: record[name] for name in fields}, "line": number}
    if not found:
        raise DataError(path, None, "empty file: no records")


def read_csv(
    path: str | Path, fields: Sequence[str], delimiter: str = ",", nonempty: Sequence[str] = ()
) -> list[dict]:
    """Read a CSV file with a header row holding the given columns; each example also gets its ``line``.

    ``delimiter="\t"`` reads TSV (tab-separated values, Python's ``excel-tab`` dialect: what ``csv.writer`` and
    pandas write). A TSV value may be quoted as in CSV (needed only for a tab or a line break inside it), and a quote
    that opens a value must close it: ``"Hi," she said<TAB>pos`` is an error on its line rather than a text that
    silently loses its quotes. A column in ``nonempty`` (e.g. the label) must hold more than whitespace in every row.
    """
    return list(iter_csv(path, fields, delimiter, nonempty))


def iter_csv(
    path: str | Path, fields: Sequence[str], delimiter: str = ",", nonempty: Sequence[str] = ()
) -> Iterator[dict]:
    """The examples of :func:`read_csv`, one row at a time."""
    kind = "TSV" if delimiter == "\t" else "CSV"
    first_line = []

    def lines():
        for number, line in _iter_lines(path):
            if number == 1:
                first_line.append(line)
            yield line + "\n"

    reader = csv.DictReader(lines(), delimiter=delimiter, strict=kind == "TSV")
    try:
        header = reader.fieldnames
    except csv.Error as err:
        raise DataError(path, 1, f"not valid {kind} ({err})") from None
    if header is None and not first_line:
        raise DataError(path, None, "empty file: no header row")
    header = header or []
    missing = [name for name in fields if name not in header]
    if missing:
        hint = "; is it tab-separated? name it .tsv" if kind == "CSV" and "\t" in first_line[0] else ""
        raise DataError(path, 1, f"no column {missing[0]!r}; the header has {header}{hint}")
    found = False
    try:
        for row in reader:
            number = reader.line_num
            empty = [name for name in fields if row.get(name) is None]
            if empty:
                raise DataError(path, number, f"row has no value for column {empty[0]!r}")
            blank = [name for name in nonempty if not row[name].strip()]
            if blank:
                raise DataError(path, number, f"empty value in column {blank[0]!r}")
            found = True
            yield {**{name: row[name] for name in fields}, "line": number}
    except csv.Error as err:
        # DictReader's own line_num is that of the last good row; its csv.reader's is the failing line's.
        raise DataError(path, reader.reader.line_num, f"not valid {kind} ({err})") from None
    if not found:
        raise DataError(path, None, "empty file: a header row but no records")


def read_ner_file(
    path: str | Path,
    tokens_field: str = "tokens",
    tags_field: str = "ner_tags",
    tag_names: Sequence[str] | None = None,
) -> list[dict]:
    """Read NER examples from CoNLL or JSON lines (by suffix), as ``{"tokens", "ner_tags", "line", "tag_lines"}``.

    Tags are strings, or with ``tag_names`` (the Hub's ``ClassLabel`` convention) integer ids: id ``i`` is
    ``tag_names[i]`` (JSON integers, or digit strings in CoNLL); a tag that is already one of the names stays.
    JSON integer tags without ``tag_names``, an id out of range and an empty tag raise :class:`DataError`.
    """
    return list(iter_ner_file(path, tokens_field, tags_field, tag_names))


def iter_ner_file(
    path: str | Path,
    tokens_field: str = "tokens",
    tags_field: str = "ner_tags",
    tag_names: Sequence[str] | None = None,
) -> Iterator[dict]:
    """The examples of :func:`read_ner_file`, one sentence at a time."""
    suffix = Path(path).suffix.lower()
    names = None if tag_names is None else list(tag_names)
    tag_check = _TagColumnCheck(path)
    if suffix not in JSONL_SUFFIXES:
        examples = iter_conll(path)
    else:
        examples = (
            _ner_record(path, ex, tokens_field, tags_field, tag_names)
            for ex in iter_jsonl(path, [tokens_field, tags_field])
        )
    for ex in examples:
        if names is not None:
            ex["ner_tags"] = [_tag_name(tag, names, path, line) for tag, line in zip(ex["ner_tags"], ex["tag_lines"])]
        if suffix in JSONL_SUFFIXES:
            tag_check.add(ex)
        yield ex
    if suffix in JSONL_SUFFIXES:
        tag_check.finish()


def _ner_record(path, ex: dict, tokens_field: str, tags_field: str, tag_names) -> dict:
    """One JSON-lines NER record checked: tokens a list of strings, tags as many strings (or integer ids)."""
    tokens, tags, line = ex[tokens_field], ex[tags_field], ex["line"]
    if not isinstance(tokens, list) or not all(isinstance(v, str) for v in tokens):
        raise DataError(path, line, f"field {tokens_field!r} must be a list of strings")
    if not isinstance(tags, list) or not all(isinstance(v, str) or _is_int(v) for v in tags):
        raise DataError(path, line, f"field {tags_field!r} must be a list of strings (or of integer ids)")
    if len(tokens) != len(tags):
        raise DataError(
            path,
            line,
            f"{len(tokens)} {tokens_field} but {len(tags)} {tags_field}; they must be the same length",
        )
    if not tokens:
        raise DataError(path, line, f"field {tokens_field!r} is empty")
    if tag_names is None and any(_is_int(v) for v in tags):
        raise DataError(
            path,
            line,
            f"field {tags_field!r} holds integer ids; give the tag of each id in order with --tag_names "
            "(e.g. O,B-PER,I-PER: the dataset's ClassLabel names)",
        )
    if any(isinstance(v, str) and not v.strip() for v in tags):
        raise DataError(path, line, f"field {tags_field!r} holds an empty tag")
    return {"tokens": tokens, "ner_tags": tags, "line": line, "tag_lines": [line] * len(tags)}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tag_name(tag, names: list[str], path, line) -> str:
    """The name of an integer id (``3`` or ``"3"``) from ``names``; a tag that is already a name stays."""
    if isinstance(tag, str) and tag in names:
        return tag
    if _is_int(tag) or (isinstance(tag, str) and tag.isdigit() and tag.isascii()):
        if 0 <= int(tag) < len(names):
            return names[int(tag)]
        raise DataError(
            path, line, f"tag id {tag} is out of range: --tag_names has {len(names)} names (ids 0..{len(names) - 1})"
        )
    raise DataError(path, line, f"tag {tag!r} is neither an integer id nor one of --tag_names {names}")


def read_table_file(
    path: str | Path, fields: Sequence[str], list_fields: Sequence[str] = (), nonempty: Sequence[str] = ()
) -> list[dict]:
    """Read CSV, TSV or JSON lines (by suffix) with the given fields; values become strings.

    A JSON field named in ``list_fields`` may also hold a list of strings / numbers, kept as a list of strings
    (multi-label classification's ``["pos", "funny"]``); in CSV / TSV every value is a string. A field in
    ``nonempty`` (e.g. a single label) must hold more than whitespace in every record.
    """
    return list(iter_table_file(path, fields, list_fields, nonempty))


def iter_table_file(
    path: str | Path, fields: Sequence[str], list_fields: Sequence[str] = (), nonempty: Sequence[str] = ()
) -> Iterator[dict]:
    """The examples of :func:`read_table_file`, one record at a time."""
    suffix = Path(path).suffix.lower()
    if suffix in CSV_SUFFIXES:
        yield from iter_csv(path, fields, nonempty=nonempty)
    elif suffix in TSV_SUFFIXES:
        yield from iter_csv(path, fields, delimiter="\t", nonempty=nonempty)
    elif suffix in JSONL_SUFFIXES:
        for ex in iter_jsonl(path, fields):
            for name in fields:
                value = ex[name]
                if name in list_fields and isinstance(value, list):
                    if not all(_is_scalar(item) for item in value):
                        raise DataError(
                            path, ex["line"], f"field {name!r} must be a list of strings or numbers, got {value!r}"
                        )
                    ex[name] = [_scalar_text(item) for item in value]
                    continue
                if not _is_scalar(value):
                    what = "a string, a number or a list of them" if name in list_fields else "a string or a number"
                    raise DataError(path, ex["line"], f"field {name!r} must be {what}, got {value!r}")
                ex[name] = _scalar_text(value)
                if name in nonempty and not ex[name].strip():
                    raise DataError(path, ex["line"], f"field {name!r} is empty")
            yield ex
    else:
        raise DataError(path, None, f"unknown file type {suffix!r}; use .csv, .tsv, .json or .jsonl (JSON lines)")


def _is_scalar(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, str | int | float)


def _scalar_text(value) -> str:
    """A JSON string as it is; a JSON number as the text of its value (``1.0`` is ``"1"``, see canonical_label)."""
    return value if isinstance(value, str) else canonical_label(value)


def read_text_sentences(path: str | Path) -> list[dict]:
    """Read plain text, one sentence per line, into ``{"tokens", "line"}``: the line's words split on whitespace.

    Blank lines are skipped. A file that reads as CoNLL instead (every line a single word, as in one word per line;
    or every line ending in a tag such as ``O`` / ``B-PER``) raises :class:`DataError`: name such a file ``.conll``.
    """
    return list(iter_text_sentences(path))


def iter_text_sentences(path: str | Path) -> Iterator[dict]:
    """The examples of :func:`read_text_sentences`, one line at a time; the checks of the whole file's shape are
    raised after its last line."""
    count, all_single, all_tagged, first = 0, True, True, None
    for number, line in _iter_lines(path):
        if not line.strip():
            continue
        ex = {"tokens": line.split(), "line": number}
        count += 1
        first = first or ex
        all_single = all_single and len(ex["tokens"]) == 1
        all_tagged = all_tagged and len(ex["tokens"]) >= 2 and looks_like_tag(ex["tokens"][-1])
        yield ex
    if not count:
        raise DataError(path, None, "empty file: no sentences")
    if count > 1 and all_single:
        raise DataError(
            path,
            None,
            "every line holds a single word, as in one word per line (CoNLL); a .txt file holds one sentence per "
            "line: rename a one-word-per-line file to .conll",
        )
    if all_tagged:
        raise DataError(
            path,
            first["line"],
            f"every line ends in a tag ({first['tokens'][-1]!r}), as in CoNLL 'token tag'; a .txt file holds "
            "one sentence per line: rename a CoNLL file to .conll",
        )


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def canonical_label(value) -> str:
    """A label as the string it is compared, stored and written as: its text, without surrounding whitespace.

    Labels keep their identity: ``"01"`` and ``"1"``, ``"1.1"`` and ``"1.10"``, ``"1.0"`` and ``"1"`` are different
    labels (section codes, zero-padded ids). Only spellings that cannot differ in meaning are merged: surrounding
    whitespace (``" pos "`` is ``"pos"``), and a number that is not text (a JSON or Hub number) is the text of its
    value: ``1`` and ``1.0`` are ``"1"`` (JSON has one number type), ``0.5`` is ``"0.5"``, and integers keep every
    digit (``9007199254740993``).
    """
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else repr(value)


def _is_number(label: str) -> bool:
    return _NUMBER.fullmatch(label) is not None


def _natural_key(label: str) -> tuple:
    # Digit runs compare as numbers ("2" before "10", "1.2" before "1.10"); equal numbers by their text ("01" < "1").
    parts = re.split(r"([0-9]+)", label)
    return tuple((int(part), part) if i % 2 else part for i, part in enumerate(parts))


def label_list(examples: Iterable[dict], key: str) -> list[str]:
    """The labels under ``key`` (a label or a list of tags per example), each once, in :func:`canonical_label` form.

    Sorted so that ids follow the numbers in the labels: a set of numbers by value (labels ``0..K-1`` give label
    ``i`` the id ``i``; ``-1`` before ``0.5`` before ``2`` before ``10``; equal values such as ``1`` and ``1.0`` by
    their text), any other set with its digit runs compared as numbers (``01``, ``02``, ``10``, ``n/a``; ``class2``
    before ``class10``; ``B-LOC``, ``I-LOC``, ``O`` as strings).
    """
    labels = set()
    for ex in examples:
        value = ex[key]
        labels.update(canonical_label(v) for v in (value if isinstance(value, list) else [value]))
    if labels and all(_is_number(label) for label in labels):
        return sorted(labels, key=lambda label: (Decimal(label), label))
    return sorted(labels, key=_natural_key)


def check_labels(examples: Iterable[dict], key: str, known: Iterable[str], path: str | Path) -> None:
    """Raise a :class:`DataError` at the first label under ``key`` that is not in ``known`` (the training labels).

    Labels are compared in :func:`canonical_label` form (as text): ``1`` in a test file does not match ``1.0`` in
    training, and the error says which training label has the same value.
    """
    known = list(known)
    canonical = {canonical_label(label) for label in known}

    def refuse(label, line):
        message = f"label {label!r} does not occur in the training data {known}"
        text = canonical_label(label)
        same_value = [k for k in known if _is_number(text) and _is_number(k) and Decimal(k) == Decimal(text)]
        if same_value:
            message += f"; labels are compared as text, and training spells this value {same_value[0]!r}"
        raise DataError(path, line, message)

    for ex in examples:
        value = ex[key]
        if isinstance(value, list):
            for tag, line in zip(value, ex.get("tag_lines") or [ex.get("line")] * len(value)):
                if canonical_label(tag) not in canonical:
                    refuse(tag, line)
        elif canonical_label(value) not in canonical:
            refuse(value, ex.get("line"))


def subtoken_tags(tag: str, n: int) -> list[str]:
    """The tags of a word's ``n`` sub-tokens that keep its tag's scheme (for ``--label_all_tokens``).

    The word's span stays one entity with the same boundaries: ``B-X`` gives ``B-X I-X ...``; ``I-X`` gives ``I-X``
    everywhere; BIOES ``S-X`` gives ``B-X I-X ... E-X`` and ``E-X`` gives ``I-X ... E-X``; BILOU ``U-X`` gives
    ``B-X I-X ... L-X`` and ``L-X`` gives ``I-X ... L-X``. ``O`` and tags without a prefix repeat. One sub-token keeps
    the tag itself.
    """
    if n < 1:
        return []
    if n == 1 or not _PREFIXED_TAG.fullmatch(tag):
        return [tag] * n
    prefix, kind = tag[0], tag[2:]
    inside = f"I-{kind}"
    if prefix == "B":
        return [tag] + [inside] * (n - 1)
    if prefix in "SU":
        return [f"B-{kind}"] + [inside] * (n - 2) + [f"{'E' if prefix == 'S' else 'L'}-{kind}"]
    if prefix in "EL":
        return [inside] * (n - 1) + [tag]
    return [tag] * n  # I-


def split_examples(
    examples: Sequence, fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 42
) -> tuple[list, ...]:
    """Shuffle with a fixed ``seed`` and cut into consecutive parts of the given fractions (deterministic).

    A ``datasets.Dataset`` is cut into datasets (``select``: no row is copied), the same rows as its list would give.
    """
    if abs(sum(fractions) - 1.0) > 1e-9 or any(f < 0 for f in fractions):
        raise ValueError(f"fractions={tuple(fractions)} is not allowed; they must be >= 0 and sum to 1")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    parts, start = [], 0
    for i, fraction in enumerate(fractions):
        end = len(order) if i == len(fractions) - 1 else start + round(fraction * len(order))
        parts.append(_take(examples, order[start:end]))
        start = end
    return tuple(parts)


def kfold_examples(
    examples: Sequence, num_folds: int, fold: int, seed: int = 42, validation_fraction: float = 0.1
) -> tuple[list, list, list]:
    """``(train, validation, test)`` of fold ``fold`` in a ``num_folds``-fold cross-validation, deterministic.

    The examples are shuffled once with ``seed`` (so every fold of every configuration cuts the same folds); example
    ``i`` of that order is in fold ``i % num_folds``. The test part is the fold; ``validation_fraction`` of the rest
    is held out for validation (choosing a learning rate, early stopping), never the test fold. A
    ``datasets.Dataset`` is cut into datasets, as :func:`split_examples` does.
    """
    if int(num_folds) != num_folds or num_folds < 2:
        raise ValueError(f"num_folds={num_folds} is not allowed; it must be an integer >= 2")
    if not 0 <= fold < num_folds:
        raise ValueError(f"fold={fold} is not allowed; it must be in [0, {num_folds - 1}]")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    test = [j for i, j in enumerate(order) if i % num_folds == fold]
    rest = [j for i, j in enumerate(order) if i % num_folds != fold]
    n_validation = round(validation_fraction * len(rest))
    return _take(examples, rest[n_validation:]), _take(examples, rest[:n_validation]), _take(examples, test)


def kfold_assignment(num_examples: int, num_folds: int, seed: int = 42, stratify: Sequence | None = None) -> list[int]:
    """The fold (0 .. ``num_folds`` - 1) of each of ``num_examples`` examples, deterministic: every example is in
    exactly one fold, and the folds differ in size by at most one.

    The examples are shuffled once with ``seed``. Without ``stratify``, example ``i`` of that order is in fold
    ``i % num_folds`` (the folds of :func:`kfold_examples`). With ``stratify`` (one label per example), the shuffled
    examples are dealt to the folds class by class (classes in sorted order, one counter across them), so each fold
    holds each class's share to within one example. Raises ``ValueError`` when there are fewer examples than folds,
    or (stratified) a class with fewer examples than folds, naming it.
    """
    if int(num_folds) != num_folds or num_folds < 2:
        raise ValueError(f"num_folds={num_folds} is not allowed; it must be an integer >= 2")
    if num_examples < num_folds:
        raise ValueError(f"{num_examples} examples for {num_folds} folds; every fold needs at least one example")
    order = list(range(num_examples))
    random.Random(seed).shuffle(order)
    folds = [0] * num_examples
    if stratify is None:
        for i, j in enumerate(order):
            folds[j] = i % num_folds
        return folds
    if len(stratify) != num_examples:
        raise ValueError(f"{len(stratify)} labels to stratify by for {num_examples} examples")
    by_class: dict = {}
    for j in order:
        by_class.setdefault(stratify[j], []).append(j)
    for label in sorted(by_class, key=str):
        if len(by_class[label]) < num_folds:
            raise ValueError(
                f"class {label!r} has {len(by_class[label])} examples, fewer than the {num_folds} folds; every fold "
                "needs one to stratify"
            )
    counter = 0
    for label in sorted(by_class, key=str):
        for j in by_class[label]:
            folds[j] = counter % num_folds
            counter += 1
    return folds


def _take(examples: Sequence, indices: list[int]):
    """The examples at ``indices`` in that order: a list, or of a dataset a dataset (its ``select``)."""
    if hasattr(examples, "select") and hasattr(examples, "column_names"):
        return examples.select(indices)
    return [examples[j] for j in indices]
