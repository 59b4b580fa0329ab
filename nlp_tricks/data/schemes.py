"""NER tag schemes: IOB1, IOB2, BIOES (IOBES), BMES and BILOU, read as entity spans by one rule and written back.

Every scheme tags a word ``O`` or a prefix, a hyphen and the entity type (``B-PER``). A prefix has one of four roles:

======  =====  =====  ======  =====
role    IOB2   BIOES  BMES    BILOU
======  =====  =====  ======  =====
begin   B-     B-     B-      B-
inside  I-     I-     M-      I-
end     (I-)   E-     E-      L-
single  (B-)   S-     S-      U-
======  =====  =====  ======  =====

IOB1 (the original CoNLL-2003 files) has IOB2's prefixes but opens an entity with ``I-``, keeping ``B-`` for an
entity that directly follows one of the same type.

One rule reads them all (:func:`tags_to_spans`), conlleval's lenient reading as seqeval applies it in its default
mode: an entity ends before ``O``, a begin or single tag, or a change of type, and after an end or single tag; an
inside or end tag with no open entity of its type starts one (``I-PER`` after ``O`` in IOB2, ``M-ORG`` after ``O``
in BMES, an ``E-LOC`` with no opening: a one-word entity), and an entity never closed by its end tag ends where the
next of those comes. On well-formed tags of each scheme this is its strict reading; IOB1 and IOB2 read alike.
:func:`spans_to_tags` writes entities back in any scheme; :func:`resolve_scheme` names a file's scheme from its
prefixes (:func:`detect_scheme`) or checks the one given, refusing a tag the scheme does not have. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .readers import DataError

__all__ = [
    "SCHEMES",
    "SCHEME_NAMES",
    "SCHEME_PREFIXES",
    "split_tag",
    "tags_to_spans",
    "spans_to_tags",
    "convert_tags",
    "SchemeScan",
    "SchemeError",
    "detect_scheme",
    "check_scheme",
    "scan_examples",
    "resolve_scheme",
]

SCHEMES = ("iob1", "iob2", "bioes", "bmes", "bilou")
SCHEME_NAMES = {"iob1": "IOB1", "iob2": "IOB2", "bioes": "BIOES", "bmes": "BMES", "bilou": "BILOU"}
SCHEME_PREFIXES = {"iob1": "BI", "iob2": "BI", "bioes": "BIES", "bmes": "BMES", "bilou": "BILU"}
# Each prefix's role: begin, inside, end, single.
_ROLES = {"B": "B", "I": "I", "M": "I", "E": "E", "L": "E", "S": "S", "U": "S"}
# The prefix of each role (inside, end, single) when a scheme writes it.
_WRITTEN = {
    "iob1": ("I", "I", "B"),
    "iob2": ("I", "I", "B"),
    "bioes": ("I", "E", "S"),
    "bmes": ("M", "E", "S"),
    "bilou": ("I", "L", "U"),
}


def split_tag(tag: str) -> tuple[str, str]:
    """``(prefix, type)`` of a tag: ``B-PER`` -> ``("B", "PER")``, ``O`` -> ``("O", "")``; ``ValueError`` for a
    tag that is neither ``O`` nor one of the prefixes (B, I, M, E, S, L, U), a hyphen and a type."""
    if tag == "O":
        return "O", ""
    if isinstance(tag, str) and len(tag) > 2 and tag[1] == "-" and tag[0] in _ROLES:
        return tag[0], tag[2:]
    raise ValueError(f"tag {tag!r} is neither 'O' nor a prefixed tag (B-, I-, M-, E-, S-, L- or U- and a type)")


def tags_to_spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """The entities ``(type, start, end exclusive)`` of one sentence's tags in any scheme, in order (the module's
    rule: conlleval's lenient reading). A tag that is not ``O`` or a prefix and a type raises ``ValueError``."""
    spans = []
    previous, open_type, begin = "O", "", 0
    for i, (prefix, kind) in enumerate([*map(split_tag, tags), ("O", "")]):
        role = _ROLES.get(prefix, "O")
        ends = previous in ("E", "S") or (previous in ("B", "I") and role in ("B", "S", "O"))
        if previous != "O" and open_type != kind:
            ends = True
        if ends:
            spans.append((open_type, begin, i))
        if role in ("B", "S") or (role in ("I", "E") and (ends or previous in ("E", "S", "O"))):
            begin = i
        previous, open_type = role, kind
    return spans


def spans_to_tags(spans: Iterable[tuple[str, int, int]], length: int, scheme: str = "iob2") -> list[str]:
    """The tags of ``length`` words holding the non-overlapping entities ``(type, start, end exclusive)`` in
    ``scheme`` (one of :data:`SCHEMES`); ``O`` elsewhere. Overlapping or out-of-range spans raise ``ValueError``."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not allowed; choose one of {', '.join(SCHEMES)}")
    inside, end_prefix, single = _WRITTEN[scheme]
    tags = ["O"] * length
    ends = {}  # end -> type of the entity ending there (IOB1 writes B- only right after one of its type)
    for kind, start, end in sorted(spans, key=lambda s: (s[1], s[2])):
        if not 0 <= start < end <= length:
            raise ValueError(f"span ({kind!r}, {start}, {end}) is not within {length} words (end exclusive)")
        if any(tag != "O" for tag in tags[start:end]):
            raise ValueError(f"span ({kind!r}, {start}, {end}) overlaps another: tags hold flat entities only")
        first = "B"
        if scheme == "iob1":
            first = "B" if ends.get(start) == kind else "I"
        elif end - start == 1:
            first = single
        tags[start] = f"{first}-{kind}"
        if end - start > 1:
            tags[start + 1 : end - 1] = [f"{inside}-{kind}"] * (end - start - 2)
            tags[end - 1] = f"{end_prefix}-{kind}"
        ends[end] = kind
    return tags


def convert_tags(tags: Sequence[str], scheme: str = "iob2") -> list[str]:
    """One sentence's tags (any scheme, read by :func:`tags_to_spans`) written in ``scheme``."""
    return spans_to_tags(tags_to_spans(tags), len(tags), scheme)


class SchemeScan:
    """What :func:`detect_scheme` and :func:`check_scheme` need of a file's tags, gathered one sentence at a time:
    the first tag (and line) of each prefix, the first tag without one, where IOB1 and IOB2 show, and the IOB2 tags
    the sentences convert to (:func:`convert_tags`), each with the first tag and line it comes from.

    ``add(tags, lines)`` takes one sentence's tags and the line of each (None where unknown).
    """

    def __init__(self):
        self.first = {}  # prefix -> (tag, line) of its first tag
        self.bare = None  # (tag, line) of the first tag that is neither O nor prefixed
        self.i_opens = None  # (tag, line) of the first I- that opens an entity (IOB1's way, ill-formed in IOB2)
        self.b_opens = None  # (tag, line) of the first B- after O or another type (IOB2's way, ill-formed in IOB1)
        self.iob2 = {}  # IOB2 tag -> (tag, line) of the first tag converted to it

    def add(self, tags: Sequence[str], lines: Sequence[int | None]) -> None:
        previous = ("O", "")
        for tag, line in zip(tags, lines):
            try:
                prefix, kind = split_tag(tag)
            except ValueError:
                self.bare = self.bare or (tag, line)
                return
            if prefix != "O":
                self.first.setdefault(prefix, (tag, line))
            continues = previous[0] != "O" and previous[1] == kind
            if prefix == "I" and not continues:
                self.i_opens = self.i_opens or (tag, line)
            elif prefix == "B" and not continues:
                self.b_opens = self.b_opens or (tag, line)
            previous = (prefix, kind)
        for tag, line, iob2 in zip(tags, lines, convert_tags(tags)):
            self.iob2.setdefault(iob2, (tag, line))


def _where(found: tuple[str, int | None]) -> str:
    tag, line = found
    return f"{tag!r}" if line is None else f"{tag!r} (line {line})"


class SchemeError(ValueError):
    """Tags no scheme reads: the message, and ``line``, the line of the tag it names (None where unknown)."""

    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.line = line


def detect_scheme(scan: SchemeScan) -> tuple[str, str]:
    """``(scheme, why)``: the scheme a file's tags are in, from their prefixes: ``M-`` is BMES, ``L-`` / ``U-``
    BILOU, ``E-`` / ``S-`` BIOES; ``B-`` / ``I-`` alone IOB1 when an ``I-`` opens an entity and no ``B-`` does,
    else IOB2. :class:`SchemeError` (naming the tag; its ``line``) for a tag without a prefix or prefixes no one
    scheme has."""
    if scan.bare is not None:
        raise SchemeError(
            f"tag {scan.bare[0]!r} is neither 'O' nor a prefix and a type; entities are read from IOB1, IOB2, "
            "BIOES, BMES or BILOU tags (B-PER, I-PER, M-PER, E-PER, S-PER, L-PER, U-PER)",
            scan.bare[1],
        )
    prefixes = set(scan.first)
    for marks, scheme in (("M", "bmes"), ("LU", "bilou"), ("ES", "bioes")):
        if prefixes & set(marks):
            outside = sorted(prefixes - set(SCHEME_PREFIXES[scheme]))
            if outside:
                mark = next(p for p in scan.first if p in marks)
                tag, line = scan.first[outside[0]]
                raise SchemeError(
                    f"tag {tag!r} is not a {SCHEME_NAMES[scheme]} tag, the scheme of the file's "
                    f"{_where(scan.first[mark])}: one file holds one scheme",
                    line,
                )
            used = ", ".join(f"{p}-" for p in SCHEME_PREFIXES[scheme] if p in prefixes)
            return scheme, f"{SCHEME_NAMES[scheme]} (its tags' prefixes: {used})"
    if not prefixes:
        return "iob2", "IOB2 (no entity tags)"
    if scan.i_opens is not None and scan.b_opens is None:
        return (
            "iob1",
            f"IOB1 (an I- tag opens an entity, as {_where(scan.i_opens)}, and B- only follows one of its type)",
        )
    why = "IOB2 (B- opens each entity"
    if scan.i_opens is not None:
        why += f"; an I- tag that opens one, as {_where(scan.i_opens)}, is read as B-"
    return "iob2", why + ")"


def check_scheme(scan: SchemeScan, scheme: str) -> tuple[str, int | None] | None:
    """The first ``(tag, line)`` of a file whose prefix ``scheme`` does not have (a tag without a prefix counts),
    or None."""
    allowed = SCHEME_PREFIXES[scheme]
    found = [scan.bare] if scan.bare is not None else []
    found += [first for prefix, first in scan.first.items() if prefix not in allowed]
    if not found:
        return None
    return min(found, key=lambda f: (f[1] is None, f[1] or 0))


def scan_examples(examples: Iterable[dict], key: str = "ner_tags") -> SchemeScan:
    """A :class:`SchemeScan` of examples as the readers give them (``key``'s tags, ``tag_lines`` or ``line``)."""
    scan = SchemeScan()
    for ex in examples:
        tags = ex[key]
        scan.add(tags, ex.get("tag_lines") or [ex.get("line")] * len(tags))
    return scan


def resolve_scheme(scan: SchemeScan, scheme: str, source, detected_from: str | None = None) -> tuple[str, str]:
    """``(scheme, why)`` of a file's tags under ``--tag_scheme`` ``scheme``: ``"auto"`` detects it
    (:func:`detect_scheme`); a named scheme is checked. With ``detected_from`` (the training file, when ``scheme``
    was detected there) the message says so. Raises :class:`~nlp_tricks.data.DataError` (``source:line``) at the
    first tag the scheme does not have."""
    if scheme == "auto":
        try:
            return detect_scheme(scan)
        except SchemeError as err:
            raise DataError(source, err.line, f"--tag_scheme auto: {err}") from None
    if scheme not in SCHEMES:
        raise ValueError(f"tag_scheme={scheme!r} is not allowed; choose auto or one of {', '.join(SCHEMES)}")
    bad = check_scheme(scan, scheme)
    if bad is not None:
        raise DataError(source, bad[1], _refusal(scan, scheme, bad[0], detected_from))
    return scheme, f"{SCHEME_NAMES[scheme]} (--tag_scheme {scheme})"


def _refusal(scan: SchemeScan, scheme: str, tag: str, detected_from: str | None) -> str:
    """Why ``tag`` is refused under ``scheme``, with the scheme the file's tags read as, when they read as one."""
    prefixes = ", ".join(p + "-" for p in SCHEME_PREFIXES[scheme])
    named = f"detected in {detected_from}" if detected_from else f"--tag_scheme {scheme}"
    article = "an" if scheme.startswith("iob") else "a"
    message = f"tag {tag!r} is not {article} {SCHEME_NAMES[scheme]} tag ({named}: 'O' and {prefixes} and a type)"
    try:
        other = detect_scheme(scan)[0]
    except SchemeError:
        other = None
    if detected_from:
        message += "; the files of one run share its training file's scheme"
        return message + (f", and this one's tags read as {SCHEME_NAMES[other]}" if other else "")
    if other:
        message += f"; the file's tags read as {SCHEME_NAMES[other]}: name it with --tag_scheme {other}, or leave "
        message += "--tag_scheme auto"
    return message
