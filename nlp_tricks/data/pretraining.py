"""Masked-LM data for continued pretraining: unlabelled text, documents packed into blocks, (whole-word) masking.

Continued pretraining on in-domain text before fine-tuning: "Don't Stop Pretraining" (Gururangan et al., 2020,
https://arxiv.org/abs/2004.10964). Masking as BERT (Devlin et al., 2019, https://arxiv.org/abs/1810.04805); whole-word
masking as Google's BERT release (all sub-tokens of a chosen word together).

- :func:`read_text_file` reads documents from plain text, CSV or JSON lines, with ``file:line`` errors.
- :func:`pack_documents` tokenizes documents and packs them into blocks of at most ``max_seq_length`` tokens, every
  token once, words never cut (``word_ids`` per token travel with the blocks).
- :class:`MaskedLMCollator` pads blocks and masks them (token by token or whole words, 80/10/10); ``mask_once``
  fixes the masks of an evaluation set so that losses before and after training are measured on the same positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .readers import CSV_SUFFIXES, JSONL_SUFFIXES, DataError, _iter_lines, iter_table_file, split_examples

__all__ = [
    "TEXT_SUFFIXES",
    "read_text_file",
    "iter_text_file",
    "demo_pretraining_texts",
    "pack_words",
    "iter_pack_words",
    "pack_documents",
    "iter_pack_documents",
    "MaskedLMCollator",
]

TEXT_SUFFIXES = (".txt", ".text", ".raw", ".md")


def read_text_file(path: str | Path, text_column: str = "text") -> list[dict]:
    """Read unlabelled documents as ``{"text", "line"}`` (``line``: the document's first line in the file).

    - Plain text (``.txt``, ``.text``, ``.raw``, ``.md``): documents are separated by blank lines; a file without a
      blank line between two text lines has one document per line. Lines of one document are joined with ``\\n``.
    - CSV (header row) or JSON lines (``.csv``, ``.json``, ``.jsonl``): one document per record, in ``text_column``;
      records whose text is empty are skipped.

    Raises :class:`DataError` (``file:line: message``) on a file that is not UTF-8, a record without the column, a
    file with no text, or an unknown suffix.
    """
    return list(iter_text_file(path, text_column))


def iter_text_file(path: str | Path, text_column: str = "text") -> Iterator[dict]:
    """The documents of :func:`read_text_file`, one at a time; a plain-text file is read twice as a stream (whether
    it has blank lines between its documents, then the documents), so memory does not grow with it."""
    suffix = Path(path).suffix.lower()
    if suffix in CSV_SUFFIXES + JSONL_SUFFIXES:
        found = False
        for record in iter_table_file(path, [text_column]):
            if record[text_column].strip():
                found = True
                yield {"text": record[text_column], "line": record["line"]}
        if not found:
            raise DataError(path, None, f"no text: every {text_column!r} is empty")
        return
    if suffix not in TEXT_SUFFIXES:
        allowed = ", ".join(TEXT_SUFFIXES + CSV_SUFFIXES + JSONL_SUFFIXES)
        raise DataError(path, None, f"unknown file type {suffix!r}; use {allowed}")
    # Blank-line separated paragraphs when a blank line lies between two text lines, else one document per line.
    paragraphs, seen_text, blank_after_text = False, False, False
    for _, line in _iter_lines(path):
        if line.strip():
            paragraphs = paragraphs or blank_after_text
            seen_text = True
        elif seen_text:
            blank_after_text = True
    if not seen_text:
        raise DataError(path, None, "empty file: no text")
    current, first = [], None
    for number, line in _iter_lines(path):
        if line.strip():
            current.append(line)
            first = first or number
        if current and (not paragraphs or not line.strip()):
            yield {"text": "\n".join(current), "line": first}
            current, first = [], None
    if current:
        yield {"text": "\n".join(current), "line": first}


def demo_pretraining_texts(split_seed: int = 42) -> dict[str, list[dict]]:
    """The BBC News articles of the classification demo without the ones its test split holds out.

    ``{"train", "validation"}`` lists of ``{"text", "line"}``: the classification demo's 80/10/10 split
    (:func:`~nlp_tricks.data.split_examples` with ``split_seed``, as ``recipes/classification.py``) keeps its training
    and validation articles here; its test articles are left out, and so are the training and validation articles
    whose text is a test article's (BBC News holds 100 duplicated articles; 13 of them cross the split at seed 42),
    so a classifier fine-tuned after this pretraining is tested on text the masked LM never saw.
    """
    from .demo import demo_classification

    train, validation, test = split_examples(demo_classification(), (0.8, 0.1, 0.1), seed=split_seed)
    held_out = {ex["text"] for ex in test}
    return {
        split: [{"text": ex["text"], "line": ex["line"]} for ex in examples if ex["text"] not in held_out]
        for split, examples in (("train", train), ("validation", validation))
    }


def pack_words(
    documents: Sequence[Sequence[Sequence[int]]],
    max_seq_length: int,
    prefix: Sequence[int] = (),
    suffix: Sequence[int] = (),
    separator: Sequence[int] = (),
) -> list[dict]:
    """Pack tokenized documents into blocks ``prefix + content + suffix`` of at most ``max_seq_length`` tokens.

    Args:
        documents: each document a list of words, each word a list of token ids.
        max_seq_length: tokens per block, specials included.
        prefix, suffix: the tokens that open and close every block (BERT: ``[CLS]`` and ``[SEP]``).
        separator: the tokens put between two documents that share a block (BERT: ``[SEP]``).

    Every token of every document lands in exactly one block, in order. Blocks are filled greedily with whole
    words: a word that does not fit in what is left of a block starts the next one; only a word longer than a whole
    block is cut into block-sized pieces (each piece then counts as a word). A document that starts a block gets no
    separator (the prefix already marks the start). Returns ``{"input_ids", "word_ids"}`` per block; ``word_ids``
    numbers the block's words from 0 and is -1 at prefix, suffix and separator tokens.
    """
    return list(iter_pack_words(documents, max_seq_length, prefix, suffix, separator))


def iter_pack_words(
    documents: Iterable[Sequence[Sequence[int]]],
    max_seq_length: int,
    prefix: Sequence[int] = (),
    suffix: Sequence[int] = (),
    separator: Sequence[int] = (),
) -> Iterator[dict]:
    """The blocks of :func:`pack_words`, each yielded as soon as it is full: ``documents`` may be a stream."""
    prefix, suffix, separator = list(prefix), list(suffix), list(separator)
    capacity = max_seq_length - len(prefix) - len(suffix)
    if capacity < 1:
        raise ValueError(
            f"max_seq_length={max_seq_length} is not allowed; it must leave room for at least one token besides the "
            f"{len(prefix) + len(suffix)} special tokens of each block"
        )
    ids, word_ids = [], []

    def block():
        return {"input_ids": prefix + ids + suffix, "word_ids": [-1] * len(prefix) + word_ids + [-1] * len(suffix)}

    for document in documents:
        pieces = [list(word[i : i + capacity]) for word in document for i in range(0, len(word), capacity)]
        for k, piece in enumerate(pieces):
            gap = separator if k == 0 and ids else []
            if len(ids) + len(gap) + len(piece) > capacity:
                if ids:
                    yield block()
                ids, word_ids = [], []
                gap = []
            word = word_ids[-1] + 1 if word_ids else 0  # the separator is never last: a word follows it
            ids.extend(gap + piece)
            word_ids.extend([-1] * len(gap) + [word] * len(piece))
    if ids:
        yield block()


def _special_template(tokenizer) -> tuple[list[int], list[int]]:
    """The tokens the tokenizer puts before and after one text (BERT: ``[CLS]``, ``[SEP]``; RoBERTa: ``<s>``,
    ``</s>``)."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    raise ValueError(f"cannot find where {type(tokenizer).__name__} puts its special tokens around a text")


def pack_documents(texts: Sequence[str], tokenizer, max_seq_length: int, batch_size: int = 1000) -> list[dict]:
    """Tokenize documents and pack them with :func:`pack_words` into blocks of at most ``max_seq_length`` tokens.

    Each block is wrapped in the tokenizer's own single-text template (BERT: ``[CLS] ... [SEP]``); documents that share
    a block are separated by the tokenizer's ``sep_token`` (or ``eos_token``; nothing if it has neither), so a BERT
    block reads ``[CLS] end of doc 1 [SEP] doc 2 [SEP] start of doc 3 [SEP]``. Words are the fast tokenizer's
    pre-tokenizer words (BERT: split at spaces and punctuation; ``token ##ization`` is one word); with a slow
    tokenizer every token is its own word.
    """
    return list(iter_pack_documents(texts, tokenizer, max_seq_length, batch_size))


def iter_pack_documents(
    texts: Iterable[str], tokenizer, max_seq_length: int, batch_size: int = 1000
) -> Iterator[dict]:
    """The blocks of :func:`pack_documents`, from a stream of texts (tokenized ``batch_size`` at a time), each
    yielded as soon as it is full: memory holds a batch of documents, not the corpus."""
    prefix, suffix = _special_template(tokenizer)
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    yield from iter_pack_words(
        _tokenized_words(texts, tokenizer, batch_size), max_seq_length, prefix, suffix, [] if sep is None else [sep]
    )


def _tokenized_words(texts: Iterable[str], tokenizer, batch_size: int) -> Iterator[list[list[int]]]:
    """Each non-empty document as its words' token ids (see :func:`pack_documents` for what a word is)."""
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield from _words_of(batch, tokenizer)
            batch = []
    if batch:
        yield from _words_of(batch, tokenizer)


def _words_of(texts: list[str], tokenizer) -> Iterator[list[list[int]]]:
    # verbose=False: documents are longer than the model's maximum length on purpose (packing cuts them).
    encoding = tokenizer(texts, add_special_tokens=False, verbose=False)
    for i, ids in enumerate(encoding["input_ids"]):
        if not ids:
            continue
        word_ids = encoding.word_ids(i) if tokenizer.is_fast else list(range(len(ids)))
        words, previous = [], None
        for token, word in zip(ids, word_ids):
            if words and word is not None and word == previous:
                words[-1].append(token)
            else:
                words.append([token])
            previous = word
        yield words


@dataclass
class MaskedLMCollator:
    """Pad blocks and mask them for masked-LM training: each word (or token) is chosen with ``mlm_probability``.

    Features are ``{"input_ids", "word_ids"}`` as :func:`pack_documents` makes them (``word_ids`` -1 where nothing may
    be masked: special tokens). Of the chosen tokens, ``mask_replace_prob`` (0.8) become the mask token,
    ``random_replace_prob`` (0.1) a random non-special token, the rest stay as they are, drawn per token as in BERT;
    the labels are the original ids at chosen tokens and -100 everywhere else (padding included).

    - ``whole_word_mask=True`` chooses words: every sub-token of a chosen word is chosen, no other token is. Each
      word is chosen independently, so each token is still chosen with ``mlm_probability``.
    - A block with nothing chosen gets one word (token) chosen, uniformly among its words, so that no batch is without
      a label (BERT too predicts at least one token per sequence). This adds ``(1 - mlm_probability) ** words`` of a
      word per block: nothing in blocks of hundreds of tokens, a little in a short last block.
    - Features that already carry ``labels`` (from :meth:`mask_once`) are only padded, labels with -100.
    - Without ``word_ids`` the features' ``special_tokens_mask`` (or the tokenizer's special ids) mark what is never
      masked; whole-word masking then has no words and is an error.

    With the ``Trainer``, set ``remove_unused_columns=False`` so that ``word_ids`` reach the collator. ``generator``
    (a ``torch.Generator``) makes the draws reproducible apart from the global torch seed.

    transformers' ``DataCollatorForLanguageModeling(whole_word_mask=True)`` is not used: it replaces every chosen token
    with the mask token (no 80/10/10) and finds words from character offsets, which packed blocks do not have.
    """

    tokenizer: object
    mlm_probability: float = 0.15
    whole_word_mask: bool = False
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    pad_to_multiple_of: int | None = None
    generator: torch.Generator | None = None

    def __post_init__(self):
        if not 0 < self.mlm_probability <= 1:
            raise ValueError(f"mlm_probability={self.mlm_probability} is not allowed; it must be in (0, 1]")
        for name in ("mask_replace_prob", "random_replace_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)} is not allowed; it must be in [0, 1]")
        if self.mask_replace_prob + self.random_replace_prob > 1:
            raise ValueError(
                f"mask_replace_prob + random_replace_prob = {self.mask_replace_prob + self.random_replace_prob} is "
                "not allowed; the sum must be <= 1 (the rest keeps the original token)"
            )
        for name in ("mask_token_id", "pad_token_id"):
            if getattr(self.tokenizer, name) is None:
                raise ValueError(f"masked-LM training needs a tokenizer with a {name[:-3]}; this one has none")
        special = set(self.tokenizer.all_special_ids)
        self._special_ids = torch.tensor(sorted(special), dtype=torch.long)
        self._random_ids = torch.tensor([i for i in range(len(self.tokenizer)) if i not in special], dtype=torch.long)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        input_ids, attention_mask, word_ids, labels = self._pad(features)
        if labels is None:
            input_ids, labels = self.mask_tokens(input_ids, word_ids)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def _pad(self, features: list[dict]):
        """Padded ``input_ids``, ``attention_mask``, ``word_ids`` (-1: never masked), ``labels`` (None if absent)."""
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(features), length), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(features), length), dtype=torch.long)
        word_ids = torch.full((len(features), length), -1, dtype=torch.long)
        labels = torch.full((len(features), length), -100, dtype=torch.long) if "labels" in features[0] else None
        for row, feature in enumerate(features):
            ids = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            n = len(ids)
            input_ids[row, :n] = ids
            attention_mask[row, :n] = 1
            if labels is not None:
                labels[row, :n] = torch.as_tensor(feature["labels"], dtype=torch.long)
            elif "word_ids" in feature:
                word_ids[row, :n] = torch.as_tensor(feature["word_ids"], dtype=torch.long)
            elif self.whole_word_mask:
                raise ValueError(
                    "whole-word masking needs 'word_ids' in the features (pack_documents gives them; with the "
                    "Trainer set remove_unused_columns=False so that they reach the collator)"
                )
            else:
                if "special_tokens_mask" in feature:
                    special = torch.as_tensor(feature["special_tokens_mask"], dtype=torch.bool)
                else:
                    special = torch.isin(ids, self._special_ids)
                word_ids[row, :n] = torch.where(special, -1, torch.arange(n))
        return input_ids, attention_mask, word_ids, labels

    def mask_tokens(
        self, input_ids: torch.Tensor, word_ids: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(masked input_ids, labels)`` of a ``(batch, length)`` batch; ``word_ids`` -1 where nothing is masked."""
        generator = generator or self.generator
        maskable = word_ids >= 0
        if not self.whole_word_mask:
            word_ids = torch.where(maskable, torch.arange(word_ids.shape[1]).expand_as(word_ids), -1)
        # One id per (row, word) across the batch, so that one draw decides a whole word.
        key = torch.arange(len(word_ids)).unsqueeze(1) * (int(word_ids.max()) + 2) + word_ids + 1
        _, unit = torch.unique(key, return_inverse=True)
        chosen = (torch.rand(int(unit.max()) + 1, generator=generator) < self.mlm_probability)[unit] & maskable
        needy = maskable.any(dim=1) & ~chosen.any(dim=1)
        if needy.any():
            # One word drawn uniformly among the block's words: the token with the highest score of its word.
            scores = torch.rand(int(unit.max()) + 1, generator=generator)[unit].masked_fill(~maskable, -1.0)
            forced = unit[needy, scores[needy].argmax(dim=1)]
            chosen |= torch.isin(unit, forced) & maskable
        labels = torch.where(chosen, input_ids, -100)
        draw = torch.rand(input_ids.shape, generator=generator)
        to_mask = chosen & (draw < self.mask_replace_prob)
        to_random = chosen & ~to_mask & (draw < self.mask_replace_prob + self.random_replace_prob)
        masked = input_ids.clone()
        masked[to_mask] = self.tokenizer.mask_token_id
        picks = torch.randint(len(self._random_ids), (int(to_random.sum()),), generator=generator)
        masked[to_random] = self._random_ids[picks]
        return masked, labels

    def mask_once(self, blocks: Sequence[dict], seed: int = 0) -> list[dict]:
        """Masked copies ``{"input_ids", "labels"}`` of ``blocks`` (lists, unpadded), drawn from ``seed`` alone.

        For evaluation: the same positions are masked in every evaluation, so that the held-out loss before and after
        training compares like with like (the collator pads such features without masking them again).
        """
        generator = torch.Generator().manual_seed(seed)
        out = []
        for block in blocks:
            input_ids, _, word_ids, _ = self._pad([{k: v for k, v in block.items() if k != "labels"}])
            masked, labels = self.mask_tokens(input_ids, word_ids, generator)
            out.append({"input_ids": masked[0].tolist(), "labels": labels[0].tolist()})
        return out
