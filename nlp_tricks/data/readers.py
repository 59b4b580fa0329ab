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
import sys
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
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


def _iter_lines(path: str | Path, keep_ends: bool = False) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of the file, read as a stream (the file is never whole in memory), decoded as UTF-8.

    A line ends at ``\\n``, ``\\r\\n`` or a lone ``\\r`` (files from old Mac tools, or mixed ends after an edit), and
    nowhere else: ``U+2028``, ``\\x85`` or ``\\x1c`` inside a line are characters of it (``str.splitlines`` would break
    there). The line end is dropped, or kept as written with ``keep_ends`` (for CSV, whose quoted values keep the
    line breaks inside them). A byte-order mark at the start is dropped; a byte that is not UTF-8 is an error on its
    line (after every line before it has been yielded).
    """
    number = 0
    try:
        f = Path(path).open(encoding="utf-8-sig", newline="" if keep_ends else None)
    except OSError as err:
        raise DataError(path, None, f"cannot read the file: {err.strerror}") from None
    try:
        with f:
            # Universal newlines: "\r\n" and "\r" read as "\n" (newline=None), or are split at but kept (newline="").
            for number, line in enumerate(f, start=1):
                yield number, line if keep_ends or line[-1:] != "\n" else line[:-1]
        return
    except UnicodeDecodeError:
        pass  # the text layer decodes ahead of the lines it gives: find the bad line, byte by byte
    for later, line in _iter_binary_lines(path, keep_ends):
        if later > number:
            yield later, line


def _iter_binary_lines(path: str | Path, keep_ends: bool) -> Iterator[tuple[int, str]]:
    """:func:`_iter_lines` read as bytes, each line decoded on its own: slower, and exact about where a bad byte is."""
    with Path(path).open("rb") as f:
        number = 0
        for raw in f:
            if number == 0 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            end = b"\r\n" if raw.endswith(b"\r\n") else b"\n" if raw.endswith(b"\n") else b""
            parts = raw[: len(raw) - len(end)].split(b"\r")
            ends = [b"\r"] * (len(parts) - 1) + [end]
            if not end and parts[-1] == b"" and len(parts) > 1:  # the file's last line ended in a lone "\r"
                parts, ends = parts[:-1], ends[:-1]
            for part, part_end in zip(parts, ends):
                number += 1
                try:
                    text = part.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        path, number, f"not valid UTF-8 (byte 0x{part[err.start]:02x} at column {err.start + 1})"
                    ) from None
                yield number, text + part_end.decode("ascii") if keep_ends else text


# A tag of the IOB family (IOB1/IOB2, IOE, BIOES, BMES, BILOU): "O" or a one-letter prefix, a hyphen and a type.
_TAG = re.compile(r"O|[BIMESLU]-\S+")
_PREFIXED_TAG = re.compile(r"[BIMESLU]-\S+")


def looks_like_tag(value: str) -> bool:
    """Whether ``value`` reads as an IOB-family tag: ``O`` or ``B-``/``I-``/``M-``/``E-``/``S-``/``L-``/``U-`` and a
    type."""
    return _TAG.fullmatch(value) is not None


# What separates words and columns: ASCII whitespace. Python's str.split() also splits at U+2028, \x85, \x1c-\x1f and
# every Unicode space (a no-break space inside "10\u00a0000"), which are characters of a token here.
_SPACE = " \t\x0b\x0c"
_SPACE_RUN = re.compile(f"[{_SPACE}]+")


def _split_words(text: str) -> list[str]:
    """``text`` split at runs of ASCII whitespace (space, tab, vertical tab, form feed), and only there."""
    if text.isprintable():  # no tab, no Unicode separator: str.split() splits at the ASCII space alone
        return text.split()
    return [word for word in _SPACE_RUN.split(text) if word]


def _columns(text: str) -> list[str]:
    """The columns of a stripped CoNLL line: split on tabs when it has one, else on runs of ASCII whitespace."""
    if "\t" in text:
        return [column.strip(_SPACE) for column in text.split("\t")]
    return _split_words(text)


def _is_comment_candidate(text: str) -> bool:
    return text == "#" or (text.startswith("#") and text[1] in _SPACE)


def read_conll(path: str | Path) -> list[dict]:
    """Read a CoNLL file: token in the first column, tag in the last, a blank line between sentences.

    Columns are separated by tabs (when a line has one) or by ASCII whitespace, so CoNLL-2003's four columns (token
    POS chunk NER) work; a no-break space, ``U+2028`` or ``\\x1c`` inside a token is part of it (``10\\u00a0000``).
    A tab-separated line may have any number of columns between the token and the tag (corpora with optional reading
    or feature columns); every space-separated line of a sentence has the same number of columns, and a sentence of
    one such line has no more than the file's other sentences (unless as many as one of them). Lines that start
    with ``-DOCSTART-`` are skipped, and so are comment lines before a sentence: a line that starts with ``#`` and a
    space and does not read as a token line of the file (``# id 5a3f...  domain=en`` as MultiCoNER writes them,
    CoNLL-U's ``# text = ...``); ``#  O`` stays the token ``#`` with its tag. Each example is ``{"tokens",
    "ner_tags", "line", "tag_lines"}``, the last two being the line of the sentence's first token and of each tag
    (for error messages).

    Raises :class:`DataError` (``file:line``) on a token without a tag, a column holding a space (``New York<TAB>
    B-LOC``: whitespace-separated readers would keep ``New``), a space-separated line with more or fewer columns than
    its sentence's first (``New York B-LOC`` among ``token tag`` lines) or, in a sentence of one such line, more than
    the file's other sentences (``New York B-LOC`` alone in a ``token tag`` file), a comment line inside a sentence,
    a tag-first file, a tag column mixing IOB tags with other words (see :func:`check_tag_columns`) and a file of one
    line of more than 16 columns (text of one sentence per line, too wide to be CoNLL).
    """
    return _read_conll(path, tagged=True)


def read_conll_tokens(path: str | Path) -> list[dict]:
    """Read unlabelled CoNLL-style text: one word per line in the first column (other columns, e.g. a gold tag,
    are ignored), a blank line between sentences, as ``{"tokens", "line"}``.

    The rules of :func:`read_conll` apply: ``-DOCSTART-`` and comment lines skipped (the same lines, whether or not
    the file has a tag column), a column holding a space or a space-separated line with another column count than its
    sentence's (or the file's other sentences') refused, and nothing but :class:`DataError` raised.
    """
    return [{"tokens": ex["tokens"], "line": ex["line"]} for ex in _read_conll(path, tagged=False)]


def _read_conll(path: str | Path, tagged: bool) -> list[dict]:
    return list(iter_conll(path, tagged))


def iter_conll(path: str | Path, tagged: bool = True) -> Iterator[dict]:
    """The examples of :func:`read_conll` (``tagged``) or :func:`read_conll_tokens`, one sentence at a time.

    The file is read twice as a stream (its shape first, then its sentences), so memory does not grow with it; an
    error found only at the end (a tag-first file) is raised after the last sentence.
    """
    shape = _ConllShape(path)
    sentence = _ConllSentence(path, shape, tagged)
    found = False
    for entry in _conll_entries(path):
        if entry is None:
            if sentence.tokens:
                found = True
                yield sentence.finish()
            continue
        number, text = entry
        columns, tabbed = _columns(text), "\t" in text
        if _is_comment_candidate(text) and not shape.reads_as_token_line(columns, tabbed):
            if sentence.tokens:
                raise DataError(
                    path,
                    number,
                    f"comment line {_shorten(text)!r} inside a sentence; a comment goes before a sentence's first "
                    "token (after a blank line)",
                )
            continue
        sentence.add(number, columns, tabbed)
    if sentence.tokens:
        found = True
        yield sentence.finish()
    if not found:
        raise DataError(path, None, "empty file: no sentences")
    if tagged:
        sentence.tag_check.finish()


# A file of one line with more columns than this is not CoNLL (CoNLL-U has 10): it is text, one sentence per line.
_MAX_ONE_LINE_COLUMNS = 16


class _ConllShape:
    """A CoNLL file's shape from its plain token lines (comment lines aside), read once before its sentences: their
    column counts, the tags they use, and the column counts of its sentences of several space-separated lines (each
    line of which has the same count, or is refused), against which a sentence of one such line is checked: alone
    it cannot show that a token holds a space. A file of one line too wide to be CoNLL is refused here."""

    def __init__(self, path: str | Path):
        self.path = path
        self.widths, self.tags_used = set(), set()
        self.sentence_widths, self.single_widths = {}, {}  # count -> first line; count -> (sentences, first line)
        self._space_lines = []  # (line, count) of the current sentence's space-separated lines
        token_lines, first = 0, None
        for entry in _conll_entries(path):
            if entry is None:
                self._end_sentence()
            elif not _is_comment_candidate(entry[1]):
                columns = _columns(entry[1])
                token_lines, first = token_lines + 1, first or (entry[0], len(columns))
                self.widths.add(len(columns))
                if "\t" not in entry[1]:
                    self._space_lines.append((entry[0], len(columns)))
                if len(columns) >= 2:
                    self.tags_used.add(columns[-1])
        self._end_sentence()
        if not self.sentence_widths and self.single_widths:  # every sentence is one line: the count most have
            single = self.single_widths
            width = max(single, key=lambda w: (single[w][0], -single[w][1]))
            self.sentence_widths = {width: single[width][1]}
        if token_lines == 1 and first[1] > _MAX_ONE_LINE_COLUMNS:
            raise DataError(
                path,
                first[0],
                f"the file's one line has {first[1]} columns: too wide to be CoNLL (one token per line, token "
                "first, tag last, a blank line between sentences); text of one sentence per line is a .txt file",
            )

    def _end_sentence(self) -> None:
        if len(self._space_lines) == 1:
            line, width = self._space_lines[0]
            count, first = self.single_widths.get(width, (0, line))
            self.single_widths[width] = (count + 1, first)
        elif self._space_lines:
            self.sentence_widths.setdefault(self._space_lines[0][1], self._space_lines[0][0])
        self._space_lines.clear()

    def reads_as_token_line(self, columns: list[str], tabbed: bool) -> bool:
        """Whether a line that starts like a comment (``# ...``) is a token line of the file: the columns of one,
        and, in a file whose lines have tags (a last column), a tag the file uses or one of the IOB family. The
        same rule whether the tags are read or not."""
        if (not tabbed and len(columns) not in self.widths) or any(_has_space(column) for column in columns):
            return False
        if not self.tags_used:  # one word per line
            return True
        return len(columns) >= 2 and (columns[-1] in self.tags_used or looks_like_tag(columns[-1]))

    def check_one_line_sentence(self, width: int, line: int) -> None:
        """Refuse a sentence of one space-separated line with more columns than a count the file's sentences have:
        a token split at its space (fewer columns cannot be)."""
        widths = self.sentence_widths
        if widths and width not in widths and width > min(widths):
            counts = " or ".join(str(w) for w in sorted(widths))
            raise DataError(
                self.path,
                line,
                f"{width} columns in a sentence of one line, where the file's sentences have {counts} (line "
                f"{min(widths.values())}); a token cannot hold a space",
            )


class _ConllSentence:
    """The sentence being read: its tokens, tags and their lines, checked line by line."""

    def __init__(self, path: str | Path, shape: _ConllShape, tagged: bool):
        self.path, self.shape, self.tagged = path, shape, tagged
        self.tokens, self.tags, self.tag_lines = [], [], []
        self.width, self.width_line, self.space_count = None, None, 0  # of the sentence's space-separated lines
        self.tag_check = _TagColumnCheck(path)

    def add(self, number: int, columns: list[str], tabbed: bool) -> None:
        for k, column in enumerate(columns):
            if _has_space(column):
                what = "token" if k == 0 else "tag" if k == len(columns) - 1 else f"column {k + 1}"
                raise DataError(
                    self.path,
                    number,
                    f"{what} {column!r} holds a space, and whitespace separates the columns of a CoNLL file; write "
                    "one word per line (or use JSON lines)",
                )
        if self.tagged and len(columns) < 2:
            raise DataError(self.path, number, _no_tag_message(columns[0]))
        # Tabs make the columns unambiguous (token first, tag last, any number between, as corpora with optional
        # reading or feature columns write them); with spaces a changing count is a token that holds a space.
        if not tabbed:
            self.space_count += 1
            if self.width is None:
                self.width, self.width_line = len(columns), number
            elif len(columns) != self.width:
                raise DataError(
                    self.path,
                    number,
                    f"{len(columns)} columns where line {self.width_line} has {self.width}; every space-separated "
                    "line of a sentence has the same columns (a token cannot hold a space)",
                )
        self.tokens.append(columns[0])
        self.tags.append(columns[-1])
        self.tag_lines.append(number)

    def finish(self) -> dict:
        """The sentence as an example (checked), and a new one begun."""
        if self.space_count == 1:
            self.shape.check_one_line_sentence(self.width, self.width_line)
        example = {
            "tokens": self.tokens,
            "ner_tags": self.tags,
            "line": self.tag_lines[0],
            "tag_lines": self.tag_lines,
        }
        self.tokens, self.tags, self.tag_lines = [], [], []
        self.width, self.width_line, self.space_count = None, None, 0
        if self.tagged:
            self.tag_check.add(example)
            return example
        return {"tokens": example["tokens"], "line": example["line"]}


def _no_tag_message(column: str) -> str:
    """Why a line of one column has no tag; a Unicode space in it (which does not separate CoNLL columns) named."""
    message = f"token {_shorten(column)!r} has no tag; expected 'token tag' (token first, tag last)"
    space = next((char for char in column if char.isspace()), None)
    if space is not None:
        message += (
            f"; the token holds U+{ord(space):04X} ({unicodedata.name(space, 'a Unicode space')}), which is part of "
            "a CoNLL token: separate the columns with a tab or a space"
        )
    return message


def _conll_entries(path: str | Path) -> Iterator[tuple[int, str] | None]:
    """``(line number, text without ASCII whitespace around it)`` of each line of a CoNLL file; None for a sentence
    break: a blank line (whitespace of any kind alone) or a ``-DOCSTART-`` line."""
    for number, line in _iter_lines(path):
        text = line.strip(_SPACE)
        if not line.strip() or (text.startswith("-DOCSTART-") and text[10:11] in ("", *_SPACE)):
            yield None
        else:
            yield number, text


def _has_space(text: str) -> bool:
    """Whether a column holds ASCII whitespace, which would split it: ``New York`` is what a space-separated line's
    columns look like to every other reader. A no-break or ideographic space (``10\u00a0000``) is part of a token."""
    return _SPACE_RUN.search(text) is not None


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
                "goes last and every tag of an IOB-family file is 'O' or a prefix (B-, I-, M-, E-, S-, L-, U-) and a "
                "type",
            )


def read_jsonl(path: str | Path, fields: Sequence[str]) -> list[dict]:
    """Read JSON lines (one object per line) with the given fields; each example also gets its ``line``.

    Strict JSON: ``NaN`` / ``Infinity`` (which Python's ``json`` accepts), a key twice in one object (where readers
    keep either value), a lone surrogate escape (``"\\ud800"``, not a character), a value nested deeper than Python
    reads, and a number Python cannot hold (an integer over 4,300 digits; ``1e400``, which would be ``inf``) in a field
    are errors on their line.
    """
    return list(iter_jsonl(path, fields))


def iter_jsonl(path: str | Path, fields: Sequence[str]) -> Iterator[dict]:
    """The examples of :func:`read_jsonl`, one line at a time."""
    for ex in _iter_json_records(path, fields):
        for name in fields:
            ex[name] = _python_value(ex[name], path, ex["line"], name)
        yield ex


class _JsonNumber:
    """A JSON number as the text it is written with (``1e30``, ``1.50``, ``12345678901234567890``), which the readers
    keep: Python's float would change ``1e30`` to ``1000000000000000019884624838656`` and ``1e400`` to ``inf``."""

    __slots__ = ("text", "integer")

    def __init__(self, text: str, integer: bool):
        self.text, self.integer = text, integer

    def __repr__(self) -> str:
        return self.text


class _JsonRefusal(Exception):
    """Valid for Python's ``json`` module, not for JSON: raised from inside the parser by its hooks."""


def _json_int(text: str) -> _JsonNumber:
    return _JsonNumber(text, True)


def _json_float(text: str) -> _JsonNumber:
    return _JsonNumber(text, False)


def _json_constant(name: str):
    raise _JsonRefusal(f'{name} is not a JSON value (JSON has no NaN or infinity); write it as a string, "{name}"')


def _json_object(pairs: list[tuple[str, object]]) -> dict:
    record = dict(pairs)
    if len(record) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _JsonRefusal(f"key {key!r} appears twice in one object; readers would keep either value")
            seen.add(key)
    return record


# Where a lone surrogate can come from: a file decoded from UTF-8 holds none, but a \\udXXX escape decodes to one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _iter_json_records(path: str | Path, fields: Sequence[str]) -> Iterator[dict]:
    """``{field: value, ..., "line"}`` of each record of a JSON-lines file, its numbers as :class:`_JsonNumber`."""
    found = False
    for number, line in _iter_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(
                line,
                parse_int=_json_int,
                parse_float=_json_float,
                parse_constant=_json_constant,
                object_pairs_hook=_json_object,
            )
        except json.JSONDecodeError as err:
            raise DataError(path, number, f"not valid JSON ({err.msg}); expected one JSON object per line") from None
        except _JsonRefusal as err:
            raise DataError(path, number, f"not valid JSON: {err}") from None
        except RecursionError:
            raise DataError(
                path, number, f"a value nested too deep to read (Python reads about {sys.getrecursionlimit()} levels)"
            ) from None
        if not isinstance(record, dict):
            what = "a number" if isinstance(record, _JsonNumber) else type(record).__name__
            raise DataError(path, number, f"expected a JSON object, got {what}")
        missing = [name for name in fields if name not in record]
        if missing:
            raise DataError(path, number, f"record has no field {missing[0]!r}; it has {sorted(record)}")
        if _SURROGATE_ESCAPE.search(line):
            for name in fields:
                _refuse_lone_surrogates(record[name], path, number, name)
        found = True
        example = {name: record[name] for name in fields}
        example["line"] = number
        yield example
    if not found:
        raise DataError(path, None, "empty file: no records")


def _refuse_lone_surrogates(value, path, line: int, name: str) -> None:
    """Refuse a string (in ``value``, or a list / object in it) holding half of a UTF-16 surrogate pair: it is no
    character, and no UTF-8 file or Arrow column can hold it."""
    if isinstance(value, str):
        half = next((char for char in value if "\ud800" <= char <= "\udfff"), None)
        if half is not None:
            raise DataError(
                path,
                line,
                f"field {name!r} holds the escape \\u{ord(half):04x}, half of a UTF-16 surrogate pair without the "
                "other half: no character (was a character cut in two?)",
            )
    elif isinstance(value, list):
        for item in value:
            _refuse_lone_surrogates(item, path, line, name)
    elif isinstance(value, dict):
        for item in value.values():
            _refuse_lone_surrogates(item, path, line, name)


def _python_value(value, path, line: int, name: str):
    """A JSON value with its numbers as Python's ``int`` / ``float``; one that Python cannot hold is an error."""
    if isinstance(value, _JsonNumber):
        if value.integer:
            try:
                return int(value.text)
            except ValueError:  # over sys.get_int_max_str_digits()
                raise DataError(
                    path,
                    line,
                    f"field {name!r} holds an integer of {len(value.text.lstrip('-'))} digits, more than Python "
                    f"reads ({sys.get_int_max_str_digits()})",
                ) from None
        number = float(value.text)
        if not math.isfinite(number):
            raise DataError(path, line, f"field {name!r} holds {value.text}, beyond the range of a float")
        return number
    if isinstance(value, list):
        return [_python_value(item, path, line, name) for item in value]
    if isinstance(value, dict):
        return {key: _python_value(item, path, line, name) for key, item in value.items()}
    return value


def read_csv(
    path: str | Path, fields: Sequence[str], delimiter: str = ",", nonempty: Sequence[str] = ()
) -> list[dict]:
    """Read a CSV file with a header row holding the given columns; each example also gets its ``line`` (the line
    its record ends on).

    ``delimiter="\t"`` reads TSV (tab-separated values, Python's ``excel-tab`` dialect: what ``csv.writer`` and
    pandas write). A value may be quoted (needed for a delimiter, a quote or a line break inside it; the line breaks
    of a quoted value are kept as written, ``\\r\\n`` included), and a quote that opens a value must close it:
    ``"Hi," she said,pos`` is an error on its line rather than a text that silently loses its quotes. Every row has as
    many fields as the header (``hello, world,pos`` under ``text,label`` is an error, not the text ``hello``), the
    header names each column once, and a column in ``nonempty`` (e.g. the label) must hold more than whitespace in
    every row. Values of any length are read.
    """
    return list(iter_csv(path, fields, delimiter, nonempty))


def _allow_long_fields() -> None:
    """Raise the csv module's field size limit (131,072 characters) to what a C long holds on every platform."""
    if csv.field_size_limit() < 2**31 - 1:
        csv.field_size_limit(2**31 - 1)


def iter_csv(
    path: str | Path, fields: Sequence[str], delimiter: str = ",", nonempty: Sequence[str] = ()
) -> Iterator[dict]:
    """The examples of :func:`read_csv`, one row at a time."""
    kind = "TSV" if delimiter == "\t" else "CSV"
    _allow_long_fields()
    first_line = []

    def lines():
        for number, line in _iter_lines(path, keep_ends=True):
            if number == 1:
                first_line.append(line)
            yield line

    reader = csv.reader(lines(), delimiter=delimiter, strict=True)
    header, columns = _csv_header(path, reader, kind, delimiter, fields, first_line)
    picks = [(name, columns[name]) for name in fields]
    checks = [columns[name] for name in nonempty]
    found = False
    try:
        for row in reader:
            if not _csv_row_fits(path, reader.line_num, row, header, kind, delimiter, checks):
                continue
            found = True
            example = {name: row[k] for name, k in picks}
            example["line"] = reader.line_num
            yield example
    except csv.Error as err:
        raise DataError(path, reader.line_num, f"not valid {kind} ({err})") from None
    if not found:
        raise DataError(path, None, "empty file: a header row but no records")


def _csv_header(path, reader, kind: str, delimiter: str, fields: Sequence[str], first_line: list[str]):
    """The header row and each column's index, refusing an empty or blank header, a column named twice and a missing
    column (``first_line`` holds the file's first line once read, to hint at a TSV file named ``.csv``)."""
    try:
        header = next(reader, None)
    except csv.Error as err:
        raise DataError(path, reader.line_num, f"not valid {kind} ({err})") from None
    if header is None:
        raise DataError(path, None, "empty file: no header row")
    header_line = reader.line_num
    if not header:
        raise DataError(
            path,
            1,
            f"line 1 is blank; the first line of a {kind} file is its header row, naming the columns "
            f"({delimiter.join(fields)})",
        )
    columns = {}
    for k, name in enumerate(header):
        if name in columns:
            raise DataError(
                path,
                header_line,
                f"column {name!r} is named twice in the header (columns {columns[name] + 1} and {k + 1}); a reader "
                "of the file would keep either one",
            )
        columns[name] = k
    missing = [name for name in fields if name not in columns]
    if missing:
        hint = "; is it tab-separated? name it .tsv" if kind == "CSV" and "\t" in first_line[0] else ""
        raise DataError(path, header_line, f"no column {missing[0]!r}; the header has {header}{hint}")
    return header, columns


def _csv_row_fits(path, number: int, row: list[str], header: list[str], kind: str, delimiter: str, checks) -> bool:
    """Whether ``row`` is a record (False for a blank line); a row of the wrong width or with an empty value in a
    column of ``checks`` is an error on its line."""
    width = len(header)
    if len(row) != width:
        if not row:
            return False
        if len(row) < width:
            raise DataError(path, number, f"row has no value for column {header[len(row)]!r}")
        what = "a comma" if kind == "CSV" else "a tab"
        raise DataError(
            path,
            number,
            f"row has {len(row)} fields where the header has {width} ({delimiter.join(header)}); quote a "
            f'value that holds {what} ("hello{delimiter} world")',
        )
    for k in checks:
        if not row[k].strip():
            raise DataError(path, number, f"empty value in column {header[k]!r}")
    return True


def read_ner_file(
    path: str | Path,
    tokens_field: str = "tokens",
    tags_field: str = "ner_tags",
    tag_names: Sequence[str] | None = None,
) -> list[dict]:
    """Read NER examples from CoNLL or JSON lines (by suffix), as ``{"tokens", "ner_tags", "line", "tag_lines"}``.

    Tags are strings, or with ``tag_names`` (the Hub's ``ClassLabel`` convention) integer ids: id ``i`` is
    ``tag_names[i]`` (JSON integers, or digit strings in CoNLL); a tag that is already one of the names stays, as
    does a prefixed tag of one of the names' entity types (``S-PER`` with ``O B-PER I-PER``: another scheme).
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
            for ex in _iter_json_records(path, [tokens_field, tags_field])
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
    """One JSON-lines NER record checked: tokens a list of strings, tags as many strings (or integer ids). A tag is
    its text without whitespace around it (as every label, see :func:`canonical_label`)."""
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
    tags = [v.strip() if isinstance(v, str) else v for v in tags]
    if any(isinstance(v, str) and not v for v in tags):
        raise DataError(path, line, f"field {tags_field!r} holds an empty tag")
    return {"tokens": tokens, "ner_tags": tags, "line": line, "tag_lines": [line] * len(tags)}


def _is_int(value) -> bool:
    """Whether ``value`` is an integer: a JSON integer (its text) or a Python ``int``."""
    if isinstance(value, _JsonNumber):
        return value.integer
    return isinstance(value, int) and not isinstance(value, bool)


_ID = re.compile(r"-?[0-9]+")


def _of_named_types(tag: str, names: list[str]) -> bool:
    return _PREFIXED_TAG.fullmatch(tag) is not None and any(
        _PREFIXED_TAG.fullmatch(name) and name[2:] == tag[2:] for name in names
    )


def _tag_name(tag, names: list[str], path, line) -> str:
    """The name of an integer id (``3`` or ``"3"``) from ``names``; a tag that is already a name stays, and so does
    a tag of the names' entity types in another scheme (``S-PER`` where the names are ``O B-PER I-PER``)."""
    if isinstance(tag, str) and (tag in names or _of_named_types(tag, names)):
        return tag
    if isinstance(tag, _JsonNumber) and tag.integer:
        text = tag.text
    elif isinstance(tag, str) and _ID.fullmatch(tag):
        text = tag
    elif _is_int(tag):
        if 0 <= tag < len(names):
            return names[tag]
        text = str(tag) if tag.bit_length() < 60 else f"(an integer of {tag.bit_length()} bits)"
    else:
        raise DataError(path, line, f"tag {tag!r} is neither an integer id nor one of --tag_names {names}")
    # An id of more digits than an int64 is out of range (and int() refuses over 4,300 of them).
    if _ID.fullmatch(text) and len(text.lstrip("-").lstrip("0")) <= 18 and 0 <= int(text) < len(names):
        return names[int(text)]
    raise DataError(
        path,
        line,
        f"tag id {_shorten(text)} is out of range: --tag_names has {len(names)} names (ids 0..{len(names) - 1})",
    )


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
        for ex in _iter_json_records(path, fields):
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
    return isinstance(value, str | _JsonNumber)


def _scalar_text(value) -> str:
    """A JSON string as it is; a JSON number as the text it is written with (``1.0`` stays ``"1.0"``, ``1e30``
    ``"1e30"``)."""
    return value if isinstance(value, str) else value.text


# What separates the words of a plain-text sentence: ASCII whitespace and the Unicode space separators (category Zs:
# U+3000, the ideographic space of CJK text, the en / em / thin spaces, ...) except the no-break ones (U+00A0, U+2007,
# U+202F), which keep a number or a name one word ("10\u202f000"). Line and paragraph separators (U+2028, U+2029,
# \x85) and the control separators \x1c-\x1f are characters of a word, as in CoNLL.
_TEXT_SPACE_RUN = re.compile(f"[{_SPACE}\u1680\u2000-\u2006\u2008-\u200a\u205f\u3000]+")


def _split_text_words(text: str) -> list[str]:
    return [word for word in _TEXT_SPACE_RUN.split(text) if word]


def read_text_sentences(path: str | Path) -> list[dict]:
    """Read plain text, one sentence per line, into ``{"tokens", "line"}``: the line's words split at ASCII
    whitespace and the Unicode spaces that separate words (the ideographic space U+3000 of CJK text, U+2000-U+200A
    but U+2007, U+1680, U+205F); a no-break space (U+00A0, U+2007, U+202F), ``U+2028`` or ``\x1c`` inside a word is
    part of it.

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
        ex = {"tokens": _split_text_words(line), "line": number}
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


_NUMBER = re.compile(r"([+-]?)(?:([0-9]+)(?:\.([0-9]*))?|\.([0-9]+))(?:[eE]([+-]?[0-9]+))?")
# Digits mapped so that a longer or larger significand of a negative number sorts first.
_NEGATE_DIGITS = str.maketrans("0123456789", "9876543210")


def canonical_label(value) -> str:
    """A label as the string it is compared, stored and written as: its text, without surrounding whitespace.

    Labels keep their identity: ``"01"`` and ``"1"``, ``"1.1"`` and ``"1.10"``, ``"1.0"`` and ``"1"`` are different
    labels (section codes, zero-padded ids). Only spellings that cannot differ in meaning are merged: surrounding
    whitespace (``" pos "`` is ``"pos"``), and a Python number (a Hub dataset's label) is the text of its value:
    ``1`` and ``1.0`` are ``"1"``, ``0.5`` is ``"0.5"``, and integers keep every digit (``9007199254740993``). The
    readers keep a JSON number as the text it is written with (``1.0``, ``1e30``), as in CSV.
    """
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else repr(value)


def _number_key(label: str) -> tuple | None:
    """A key that orders number labels by value, exactly and at any size (``1e1000000000000000000`` too, where
    ``Decimal`` gives up); None for a label that is not a number (or has an exponent of over 4,300 digits)."""
    match = _NUMBER.fullmatch(label)
    if match is None:
        return None
    sign, whole, fraction, only_fraction, exponent = match.groups()
    whole, fraction = whole or "", fraction or only_fraction or ""
    try:
        exponent = int(exponent) if exponent else 0
    except ValueError:
        return None
    digits = whole + fraction
    significand = digits.lstrip("0")
    # The value is 0.<significand> * 10**magnitude; trailing zeros of the significand do not change it.
    magnitude = len(whole) - (len(digits) - len(significand)) + exponent
    significand = significand.rstrip("0")
    if not significand:
        return (0,)
    if sign == "-":
        return (-1, -magnitude, significand.translate(_NEGATE_DIGITS) + ":")  # ":" sorts after every digit
    return (1, magnitude, significand)


def _natural_key(label: str) -> tuple:
    # Digit runs compare as numbers ("2" before "10", "1.2" before "1.10"), by their length without leading zeros
    # and then their digits (int() refuses over 4,300 digits); equal numbers by their text ("01" < "1").
    parts = re.split(r"([0-9]+)", label)
    return tuple((len(part.lstrip("0")), part.lstrip("0"), part) if i % 2 else part for i, part in enumerate(parts))


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
    keys = {label: _number_key(label) for label in labels}
    if labels and all(key is not None for key in keys.values()):
        return sorted(labels, key=lambda label: (keys[label], label))
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
        value = _number_key(canonical_label(label))
        same_value = [k for k in known if value is not None and _number_key(k) == value]
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

    A ``datasets.Dataset`` is cut into datasets, the same rows in the same order as its list would give (a
    file-backed one's parts copied to files of their own, which read as fast as the file: see
    :func:`~nlp_tricks.data.arrow.take_rows`).
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
    """The examples at ``indices`` in that order: a list, or of a dataset a dataset (the rows of its ``select``,
    in a file of their own: see :func:`~nlp_tricks.data.arrow.take_rows`)."""
    if hasattr(examples, "select") and hasattr(examples, "column_names"):
        from .arrow import take_rows

        return take_rows(examples, indices)
    return [examples[j] for j in indices]
