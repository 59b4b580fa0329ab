"""Self-training with a teacher: pseudo-labels (hard or soft) for classification and NER, as plain functions.

Xie et al. 2020, "Self-training with Noisy Student improves ImageNet classification", https://arxiv.org/abs/1911.04252;
for NLP, Du et al. 2021, "Self-training Improves Pre-training for Natural Language Understanding",
https://arxiv.org/abs/2010.02194. Soft labels are distilled at a temperature (Hinton et al. 2015,
https://arxiv.org/abs/1503.02531) by :func:`nlp_tricks.losses.distillation_loss`, which ``TricksTrainer`` applies to
any batch that carries ``teacher_logits``.

The pieces, each usable without the recipe:

- :func:`predict_logits`: the teacher's logits for every example, batched under ``torch.no_grad``, the examples split
  across the processes of an Accelerate job and gathered back in their order, with a progress bar on the main
  process.
- :func:`classification_pseudo_labels` / :func:`ner_pseudo_labels`: confidence filtering. A text's confidence is its
  largest softmax probability; a sentence's is the smallest such probability over its words (first sub-tokens), so
  one doubtful word drops the sentence.
- :func:`token_teacher_logits` / :func:`one_hot_logits`: the ``teacher_logits`` a student's example carries.
- :class:`TeacherLogitsCollator`: pads ``teacher_logits`` next to the inputs.
- :func:`read_unlabeled_file`: unlabelled texts / sentences with ``file:line`` errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .data import DataError, read_conll_tokens, read_table_file, read_text_sentences
from .data.readers import JSONL_SUFFIXES, read_jsonl
from .functional.outputs import output_logits

__all__ = [
    "PseudoLabels",
    "predict_logits",
    "classification_pseudo_labels",
    "ner_pseudo_labels",
    "one_hot_logits",
    "token_teacher_logits",
    "TeacherLogitsCollator",
    "read_unlabeled_file",
    "MODEL_INPUTS",
]

# What a token / sequence classifier reads from a tokenized example; labels and teacher_logits stay out.
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")

# Log-probability of the classes a one-hot target rules out: exp(-1e4 / T) is 0 in float32 for any T <= 100, and
# 0 * log(0 / q) is taken as 0 by the KL term, so no NaN appears.
_RULED_OUT = -1e4


@dataclass
class PseudoLabels:
    """A teacher's labels for an unlabelled set.

    Attributes:
        indices (`list[int]`): positions (ascending) of the kept examples in the unlabelled set.
        labels (`list`): per kept example, the class id (classification) or the per-word class ids (NER).
        logits (`list[np.ndarray]`): per kept example, the teacher's logits: ``(C,)``, or ``(W, C)`` per word (NER).
        confidence (`np.ndarray`): ``(N,)`` confidence of every example, kept or not (NaN: a sentence without words).
    """

    indices: list[int]
    labels: list
    logits: list[np.ndarray]
    confidence: np.ndarray


def predict_logits(
    model: torch.nn.Module,
    dataset,
    collate_fn: Callable[[list[dict]], dict],
    *,
    batch_size: int = 64,
    accelerator=None,
    desc: str = "pseudo-labelling",
) -> list[np.ndarray]:
    """The model's float32 logits for every example of ``dataset``, in its order.

    Runs batched under ``torch.no_grad`` in eval mode (dropout off; the mode is restored after). With an Accelerate
    job of several processes, each process predicts a contiguous share (``split_between_processes``) and every
    process gets all the logits back in order (``gather_object``).

    Args:
        model (`torch.nn.Module`): a ``*ForSequenceClassification`` / ``*ForTokenClassification`` model (unwrapped).
        dataset (`datasets.Dataset` or `list[dict]`): tokenized examples; only ``MODEL_INPUTS`` are read.
        collate_fn (`Callable`): pads a list of examples into a batch of tensors (e.g. ``DataCollatorWithPadding``).
        batch_size (`int`, defaults to 64): examples per forward pass on each process.
        accelerator (`accelerate.Accelerator`, *optional*): the job's accelerator; default ``Accelerator()``.
        desc (`str`): label of the progress bar.

    Returns:
        `list[np.ndarray]`: per example ``(C,)``, or ``(L, C)`` over its own ``L`` tokens (padding removed).
    """
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    accelerator = accelerator or Accelerator()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    local_logits = []
    with accelerator.split_between_processes(list(range(len(dataset)))) as local_indices:
        starts = range(0, len(local_indices), batch_size)
        for start in tqdm(starts, desc=desc, disable=not accelerator.is_main_process):
            rows = [dataset[i] for i in local_indices[start : start + batch_size]]
            batch = collate_fn([{k: row[k] for k in MODEL_INPUTS if k in row} for row in rows])
            batch = {k: v.to(device) for k, v in batch.items() if k in MODEL_INPUTS}
            with torch.no_grad():
                outputs = model(**batch)
            logits = output_logits(outputs).float().cpu()
            if logits.dim() == 3:
                # The attention mask marks each example's own tokens, whichever side the collator padded.
                mask = batch["attention_mask"].bool().cpu() if "attention_mask" in batch else None
                for i, row in enumerate(rows):
                    own = logits[i][mask[i]] if mask is not None else logits[i][: len(row["input_ids"])]
                    local_logits.append(own.numpy())
            else:
                local_logits.extend(logits.numpy())
    model.train(was_training)
    if accelerator.num_processes > 1:
        return gather_object(local_logits)
    return local_logits


def _max_probability(logits: np.ndarray) -> np.ndarray:
    """Largest softmax probability along the last axis (float64, stable)."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return 1.0 / np.exp(shifted).sum(axis=-1)


def classification_pseudo_labels(logits: Sequence[np.ndarray], confidence_threshold: float = 0.0) -> PseudoLabels:
    """Keep the texts whose largest softmax probability is at least ``confidence_threshold``; label = argmax.

    Args:
        logits (`Sequence[np.ndarray]`): the teacher's ``(C,)`` logits per text (see :func:`predict_logits`).
        confidence_threshold (`float`, defaults to 0.0): in [0, 1]; 0 keeps every text.
    """
    _check_threshold(confidence_threshold)
    stacked = np.stack([np.asarray(x) for x in logits]) if len(logits) else np.zeros((0, 0))
    confidence = _max_probability(stacked) if len(logits) else np.zeros(0)
    keep = [i for i in range(len(logits)) if confidence[i] >= confidence_threshold]
    return PseudoLabels(
        indices=keep,
        labels=[int(np.argmax(logits[i])) for i in keep],
        logits=[np.asarray(logits[i]) for i in keep],
        confidence=confidence,
    )


def ner_pseudo_labels(
    token_logits: Sequence[np.ndarray],
    word_ids: Sequence[Sequence[int | None]],
    confidence_threshold: float = 0.0,
    crf=None,
) -> PseudoLabels:
    """Word-level pseudo-labels from token logits; a sentence is kept if its least confident word clears the bar.

    A word's prediction is its first sub-token's (as the NER recipe scores words). Words the tokenizer cut off
    (``max_seq_length``) get none: a kept sentence's labels and logits cover words ``0 .. W-1``, the words seen. A
    word with no sub-token at all inside that range gets label ``None`` and a NaN logits row. A sentence without any
    word has confidence NaN and is never kept.

    Args:
        token_logits (`Sequence[np.ndarray]`): ``(L, C)`` logits per sentence over its ``L`` tokens.
        word_ids (`Sequence[Sequence[int | None]]`): per sentence, the word of each token (``None``: special token),
            as ``BatchEncoding.word_ids(i)`` gives it.
        confidence_threshold (`float`, defaults to 0.0): in [0, 1].
        crf (`nlp_tricks.crf.CRF`, *optional*): the teacher's CRF; its Viterbi path over the words seen gives the
            labels (the confidence stays the softmax of the word logits).
    """
    _check_threshold(confidence_threshold)
    confidence = np.full(len(token_logits), np.nan)
    per_sentence = []
    for n, (logits, words) in enumerate(zip(token_logits, word_ids)):
        logits = np.asarray(logits)
        if len(words) != len(logits):
            raise ValueError(f"sentence {n}: {len(words)} word ids for {len(logits)} token logits")
        first = {}
        for position, word in enumerate(words):
            if word is not None and word not in first:
                first[word] = position
        if not first:
            per_sentence.append(None)
            continue
        num_words = max(first) + 1
        word_logits = np.full((num_words, logits.shape[-1]), np.nan, dtype=logits.dtype)
        for word, position in first.items():
            word_logits[word] = logits[position]
        confidence[n] = _max_probability(logits[list(first.values())]).min()
        labels = [int(np.argmax(row)) if word in first else None for word, row in enumerate(word_logits)]
        if crf is not None:
            seen = sorted(first)
            path = crf.decode(torch.as_tensor(word_logits[seen], dtype=torch.float32)[None])[0]
            for word, tag in zip(seen, path):
                labels[word] = tag
        per_sentence.append((labels, word_logits))
    keep = [n for n in range(len(token_logits)) if confidence[n] >= confidence_threshold]  # NaN never passes
    return PseudoLabels(
        indices=keep,
        labels=[per_sentence[n][0] for n in keep],
        logits=[per_sentence[n][1] for n in keep],
        confidence=confidence,
    )


def _check_threshold(value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"confidence_threshold={value} is not allowed; it must be in [0, 1]")


def one_hot_logits(label: int, num_labels: int) -> np.ndarray:
    """Teacher logits whose softmax (at any temperature <= 100) is the one-hot of ``label`` (0 there, -1e4 elsewhere).

    Gold-labelled examples carry these next to pseudo-labelled ones, so a batch always has ``teacher_logits`` and
    the soft term pulls towards the gold label.
    """
    out = np.full(num_labels, _RULED_OUT, dtype=np.float32)
    out[label] = 0.0
    return out


def token_teacher_logits(
    word_ids: Sequence[int | None],
    labels: Sequence[int],
    word_logits: np.ndarray | None,
    num_labels: int,
    ignore_index: int = -100,
) -> np.ndarray:
    """The ``(L, C)`` ``teacher_logits`` of one tokenized NER sentence, aligned to its tokens.

    A word's first sub-token gets the teacher's logits of that word (``word_logits[w]``, from
    :func:`ner_pseudo_labels`; the student may tokenize differently from the teacher). Every other labelled token
    (gold data, ``--label_all_tokens`` continuations, a word without teacher logits) gets the one-hot of its label;
    unlabelled tokens get zeros (the loss ignores them).

    Args:
        word_ids (`Sequence[int | None]`): the word of each token.
        labels (`Sequence[int]`): the token labels of the sentence (``ignore_index`` where none).
        word_logits (`np.ndarray`, *optional*): ``(W, C)`` teacher logits per word; None for a gold sentence.
        num_labels (`int`): C.
    """
    out = np.zeros((len(word_ids), num_labels), dtype=np.float32)
    previous = None
    for position, (word, label) in enumerate(zip(word_ids, labels)):
        first = word is not None and word != previous
        previous = word
        if first and word_logits is not None and word < len(word_logits) and not np.isnan(word_logits[word]).any():
            out[position] = word_logits[word]
        elif label != ignore_index:
            out[position] = one_hot_logits(int(label), num_labels)
    return out


class TeacherLogitsCollator:
    """Wrap a collator: it pads the inputs and labels, this stacks ``teacher_logits`` and pads them to the batch.

    Token-level ``(L, C)`` teacher logits are padded with zeros to the batch's sequence length on the tokenizer's
    padding side (the positions are padding, labelled -100, so the loss ignores them); ``(C,)`` ones are stacked.

    Args:
        collator (`Callable`): e.g. ``DataCollatorForTokenClassification`` or ``DataCollatorWithPadding``.
        padding_side (`str`, defaults to ``"right"``): where the collator pads (``tokenizer.padding_side``).
    """

    def __init__(self, collator: Callable[[list[dict]], dict], padding_side: str = "right"):
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={padding_side!r} is not allowed; use 'right' or 'left'")
        self.collator = collator
        self.padding_side = padding_side

    def __call__(self, features: list[dict]) -> dict:
        if not features or "teacher_logits" not in features[0]:
            return self.collator(features)
        teacher = [torch.as_tensor(np.asarray(f["teacher_logits"], dtype=np.float32)) for f in features]
        batch = self.collator([{k: v for k, v in f.items() if k != "teacher_logits"} for f in features])
        if teacher[0].dim() == 1:
            batch["teacher_logits"] = torch.stack(teacher)
            return batch
        length = batch["input_ids"].shape[1]
        padded = teacher[0].new_zeros((len(teacher), length, teacher[0].shape[-1]))
        for i, t in enumerate(teacher):
            if self.padding_side == "right":
                padded[i, : len(t)] = t
            else:
                padded[i, length - len(t) :] = t
        batch["teacher_logits"] = padded
        return batch


def read_unlabeled_file(path: str | Path, task: str, column: str) -> list[dict]:
    """Read unlabelled data: ``{"text", "line"}`` (classification) or ``{"tokens", "line"}`` (NER).

    Classification: CSV (header row) or JSON lines with the text ``column``. NER, by the file's suffix: ``.txt`` is
    plain text, one sentence per line, its words split on whitespace (:func:`~nlp_tricks.data.read_text_sentences`,
    which refuses a ``.txt`` that reads as CoNLL); ``.jsonl`` / ``.json`` are JSON lines with a ``column`` list of
    words; anything else (``.conll``, ``.tsv``, ...) is CoNLL-style text, one word per line in the first column (any
    other column, e.g. a gold tag, is ignored), a blank line between sentences
    (:func:`~nlp_tricks.data.read_conll_tokens`). Problems raise :class:`~nlp_tricks.data.DataError`
    (``file:line: message``).
    """
    if task == "classification":
        return [{"text": ex[column], "line": ex["line"]} for ex in read_table_file(path, [column])]
    if task != "ner":
        raise ValueError(f"task={task!r} is not allowed; choose 'ner' or 'classification'")
    suffix = Path(path).suffix.lower()
    if suffix == ".txt":
        return read_text_sentences(path)
    if suffix in JSONL_SUFFIXES:
        examples = []
        for ex in read_jsonl(path, [column]):
            tokens = ex[column]
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
                raise DataError(path, ex["line"], f"field {column!r} must be a non-empty list of strings")
            examples.append({"tokens": tokens, "line": ex["line"]})
        return examples
    return read_conll_tokens(path)
