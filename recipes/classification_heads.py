"""recipes/classification.py's heads and how the texts reach them: ``--head label_token`` (a causal LM scored on
label tokens, with its prompts), ``--pair_swap`` / ``--pair_swap_predict`` (pair order), ``--truncation_side`` (where
long texts are cut), class probabilities (``test_probabilities.npy``) and prediction in length-sorted batches.

See docs/llm_classifiers.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    TrainerCallback,
)

from nlp_tricks.data import DataError
from nlp_tricks.data.prompts import PromptTemplate, default_prompt_template, encode_prompts
from nlp_tricks.data.truncation import TRUNCATION_SIDES, encode_cut
from nlp_tricks.functional.pair_swap import PairSwapAverage, parse_label_map, swap_permutation
from nlp_tricks.label_token import (
    LabelTokenClassifier,
    is_label_token_folder,
    label_token_ids,
    read_label_token_file,
)
from nlp_tricks.runtime.checkpoint import is_state_dict_file

from common import ModelArguments, load_classifier, load_weights, resolve_model_path, warn
from common.models import load_labelled_config
from common.pad_token import choose_pad_token, fit_model_to_tokenizer
from common.peft import add_lora, load_adapter

HEADS = ("classifier", "label_token")


# ---- Flags --------------------------------------------------------------------------------------------------------


@dataclass
class ClassificationModelArguments(ModelArguments):
    """Which pretrained model, and the head that classifies with it."""

    head: str = field(
        default="classifier",
        metadata={
            "choices": list(HEADS),
            "help": "'classifier': a fresh classification head (AutoModelForSequenceClassification). 'label_token': "
            "a causal LM scored on label tokens: the prompt (--prompt_template) ends where the answer goes, and the "
            "class logits are the LM head's logits of the label words' first tokens there (--label_words); the "
            "loss is the cross-entropy over those C logits only. Default for a model folder saved with it "
            "(label_token.json). See docs/llm_classifiers.md.",
        },
    )
    label_words: str | None = field(
        default=None,
        metadata={
            "help": "With --head label_token: the word of each label, 'label=Word,...' (sport=Sport,tech=Technology); "
            "a label not named is its own word. The token scored is the word's first token as the tokenizer reads "
            "it after a space; words sharing it are refused. Default: the saved model's words, else the labels."
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "With --head label_token: a file holding the template, or the template itself: a Python format "
            "string with {text} (and {text_pair} for pairs), used exactly as written; its last token is the answer "
            "position. Default: the saved model's, else a question in the tokenizer's chat template (a plain one "
            "ending in 'Answer:' without one)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.head != "label_token" and (self.label_words or self.prompt_template):
            raise ValueError("label_words and prompt_template go with head=label_token")


@dataclass
class TextArguments:
    """How each text (pair) is presented to the model: where a long one is cut, and pair order."""

    truncation_side: str = field(
        default="right",
        metadata={
            "choices": list(TRUNCATION_SIDES),
            "help": "Where a text longer than --max_seq_length is cut: 'right' keeps its beginning, 'left' its end, "
            "'head_tail' its first --head_tokens and its last tokens, 'middle' its first and last halves. Pairs: "
            "each text gets its own budget (the longer one gives up tokens first); texts that fit are untouched; "
            "with --head label_token the text is cut inside the prompt, never the template.",
        },
    )
    head_tokens: int | None = field(
        default=None,
        metadata={"help": "With --truncation_side head_tail: the head's tokens K (default: a quarter of the budget)."},
    )
    pair_swap: str | None = field(
        default=None,
        metadata={
            "help": "With --text_pair_column: train each pair in both orders in the same batch, the swapped pair "
            "with its label mapped: 'a=b,b=a,tie=tie', or 'symmetric' (every label maps to itself). A batch of N "
            "pairs is 2N rows."
        },
    )
    pair_swap_predict: bool = field(
        default=False,
        metadata={
            "help": "With --pair_swap: predict each pair as the mean of p(a, b) and the label-mapped p(b, a) (two "
            "forwards; metrics, test_probabilities.npy and test_predictions.csv are the averaged ones)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.head_tokens is not None and (self.truncation_side != "head_tail" or self.head_tokens < 0):
            raise ValueError("head_tokens goes with truncation_side=head_tail and must be >= 0")
        if self.pair_swap is not None and getattr(self, "text_pair_column", None) is None:
            raise ValueError("pair_swap needs text_pair_column (it swaps the two texts of a pair)")
        if self.pair_swap_predict and self.pair_swap is None:
            raise ValueError("pair_swap_predict needs pair_swap (the label map of a swapped pair)")
        if self.pair_swap is not None and getattr(self, "teacher", None) is not None:
            raise ValueError("pair_swap with teacher: the swapped pairs would have no soft targets of their own")


def head_defaults(namespace) -> bool:
    """``dependent_defaults`` key: whether the label-token head is used (given, or a saved label-token model)."""
    return namespace.head == "label_token" or is_label_token_folder(namespace.model_name_or_path)


# The label-token head has no new head to train faster, and a saved label-token model keeps its head.
HEAD_DEFAULTS = (head_defaults, {True: {"head": "label_token", "head_lr_scale": 1.0}})


def pair_swap_permutation(data_args, labels: list[str]) -> list[int] | None:
    """The class map of a swapped pair (``--pair_swap``), or None; a bad map is one line naming the flag."""
    if getattr(data_args, "pair_swap", None) is None:
        return None
    try:
        return swap_permutation(parse_label_map(data_args.pair_swap, labels), labels)
    except ValueError as err:
        raise DataError(None, None, f"--pair_swap {data_args.pair_swap}: {err}") from err


# ---- The model ----------------------------------------------------------------------------------------------------


def load_model(model_args, data_args, labels: list[str], model_path: str | None = None, training_args=None):
    """``(model, tokenizer, prompt)``: the classifier of ``--head`` over ``labels`` (``prompt``: the label-token
    head's :class:`PromptTemplate`, else None), set up for multi-label data, ready to train with ``training_args``
    (``--peft lora``: an adapter) or to predict (``training_args`` None)."""
    if getattr(model_args, "head", "classifier") == "label_token":
        pairs = getattr(data_args, "text_pair_column", None) is not None
        model, tokenizer, prompt = load_label_token_classifier(model_args, labels, pairs, model_path, training_args)
    else:
        model, tokenizer, _ = load_classifier(
            AutoModelForSequenceClassification, model_args, labels, model_path, training_args
        )
        prompt = None
    if getattr(data_args, "multi_label", False):
        model.config.problem_type = "multi_label_classification"  # the model's loss: BCE with logits
    return model, tokenizer, prompt


def load_label_token_classifier(
    model_args, labels: list[str], pairs: bool, model_path: str | None = None, training_args=None
):
    """``(LabelTokenClassifier, tokenizer, PromptTemplate)`` over ``labels`` from a causal LM, a saved label-token
    model or a LoRA adapter folder trained as one; every mistake is one :class:`DataError` line naming its flag.
    The tokenizer gets a padding token if it has none (``--pad_token``); with ``--peft lora`` the classifier trains
    a LoRA adapter, the LM head frozen (its rows are the label tokens' scores)."""
    path = resolve_model_path(model_path or model_args.model_name_or_path)
    if is_state_dict_file(path):
        raise DataError(None, None, f"--model_name_or_path {path}: --head label_token needs a causal LM folder")
    saved = _saved_record(path)
    adapter, source, config, tokenizer = load_labelled_config(path, model_args, labels)
    new_token = choose_pad_token(tokenizer, getattr(model_args, "pad_token", None), f"--model_name_or_path {path}")
    words = label_word_list(model_args.label_words, labels, saved)
    template = prompt_of(model_args.prompt_template, saved, tokenizer, words, pairs)
    try:
        token_ids = label_token_ids(tokenizer, words)
    except ValueError as err:
        raise DataError(None, None, f"--label_words: {err}") from err
    lm = load_weights(AutoModelForCausalLM, source, config, model_args.trust_remote_code)
    fit_model_to_tokenizer(lm, tokenizer)
    model = LabelTokenClassifier(lm, token_ids, words, template.template)
    train = training_args is not None and training_args.do_train
    if adapter:
        model = load_adapter(model, path, model_args, train)
    elif train and getattr(model_args, "peft", "none") == "lora":
        # No task type: the classifier has no head of its own to train in full, and the LM head stays frozen.
        model = add_lora(model, model_args, None, () if new_token is None else (new_token,))
    return model, tokenizer, template


def _saved_record(path: str) -> dict | None:
    if not is_label_token_folder(path):
        return None
    try:
        return read_label_token_file(path)
    except ValueError as err:
        raise DataError(None, None, f"--model_name_or_path {path}: {err}") from err


def label_word_list(spec: str | None, labels: list[str], saved: dict | None) -> list[str]:
    """The word of each label: ``--label_words`` (``label=word,...``), else the saved model's, else the label."""
    words = dict(zip(saved["labels"], saved["label_words"])) if saved else {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        label, sep, word = (piece.strip() for piece in part.partition("="))
        if not sep or not label or not word:
            raise DataError(None, None, f"--label_words: {part.strip()!r} is not label=word")
        if label not in labels:
            raise DataError(None, None, f"--label_words: {label!r} is not a label of the data ({', '.join(labels)})")
        words[label] = word
    return [words.get(label, label) for label in labels]


def prompt_of(value: str | None, saved: dict | None, tokenizer, words: list[str], pairs: bool) -> PromptTemplate:
    """``--prompt_template`` (a file's text, exactly, or the string), else the saved model's, else the default."""
    source = "--prompt_template"
    try:
        if value is not None:
            text = Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
            template = PromptTemplate(text)
        elif saved and saved.get("prompt_template"):
            source, template = "label_token.json", PromptTemplate(saved["prompt_template"])
        else:
            source, template = "the default prompt", default_prompt_template(tokenizer, words, pairs)
    except (ValueError, OSError) as err:
        raise DataError(None, None, f"{source}: {err}") from err
    if template.pairs != pairs:
        need = "needs {text_pair} for --text_pair_column" if pairs else "has {text_pair} but the data has one text"
        raise DataError(None, None, f"{source}: the template {need}")
    if value is not None and template.template != template.template.rstrip():
        warn(f"{source} ends with white space: the answer position is that token, the label word follows it")
    return template


class LabelTokenFile(TrainerCallback):
    """``label_token.json`` beside the final model when what is saved is a PEFT adapter (the classifier's own
    ``save_pretrained`` writes it in every other case, checkpoints included, before their manifest)."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        if state.is_world_process_zero and isinstance(inner, LabelTokenClassifier) and inner is not model:
            inner.save_label_token_file(args.output_dir)


# ---- Tokenizing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Presentation:
    """How a split's examples become inputs: the length, where to cut, the prompt, and the swapped twin of each pair
    (``swap``: the class map; ``swap_labels``: training rows carry the swapped labels too)."""

    max_seq_length: int
    side: str = "right"
    head_tokens: int | None = None
    prompt: PromptTemplate | None = None
    swap: tuple[int, ...] | None = None
    swap_labels: bool = False


def encode_texts(tokenizer, texts: list[str], pairs: list[str] | None, how: Presentation) -> tuple[dict, list[bool]]:
    """The encodings of one batch of texts (pairs) and whether each was cut."""
    if how.prompt is not None:
        try:
            encodings, cut, _ = encode_prompts(
                tokenizer, how.prompt, texts, pairs, how.max_seq_length, how.side, how.head_tokens
            )
        except ValueError as err:
            raise DataError(None, None, str(err)) from err
        return encodings, cut
    if how.side != "right":
        return encode_cut(tokenizer, texts, pairs, how.max_seq_length, how.side, how.head_tokens)
    encodings = dict(tokenizer(texts, pairs, truncation=True, max_length=how.max_seq_length))
    cut = [False] * len(texts)
    # Only an encoding that fills max_seq_length can have been cut: only those are tokenized again to tell.
    full = [i for i, ids in enumerate(encodings["input_ids"]) if len(ids) >= how.max_seq_length]
    if full:
        lengths = tokenizer(
            [texts[i] for i in full],
            [pairs[i] for i in full] if pairs is not None else None,
            truncation=False,
            verbose=False,
            return_length=True,
        )["length"]
        for i, length in zip(full, lengths):
            cut[i] = length > how.max_seq_length
    return encodings, cut


def encode_batch(batch: dict, tokenizer, label2id: dict, multi_label: bool, how: Presentation) -> dict:
    """One ``map`` batch: the encodings, ``labels``, whether each text was cut, and with ``how.swap`` the swapped
    pair's encodings as ``swap_*`` (and, for training, its mapped labels as ``swap_labels``)."""
    texts, pairs = batch["text"], batch.get("text_pair")
    encodings, cut = encode_texts(tokenizer, texts, pairs, how)
    if multi_label:
        labels = [multi_hot(label, label2id) for label in batch["label"]]
    else:
        labels = [label2id[label] for label in batch["label"]]
    out = {**encodings, "labels": labels, "truncated": cut}
    if how.swap is not None and pairs is not None:
        swapped, _ = encode_texts(tokenizer, pairs, texts, how)
        out.update({f"swap_{key}": value for key, value in swapped.items()})
        if how.swap_labels:
            out["swap_labels"] = [swap_label(label, how.swap) for label in labels]
    return out


def multi_hot(labels, label2id: dict) -> list[float]:
    """The 0/1 row of a label set (floats: BCE's targets, and the model's multi-label loss reads float labels)."""
    row = [0.0] * len(label2id)
    for label in labels:
        row[label2id[label]] = 1.0
    return row


def swap_label(label, permutation) -> int | list[float]:
    """The label of the swapped pair: a class id mapped, or a 0/1 row with each label moved to its image."""
    if isinstance(label, list):
        row = [0.0] * len(label)
        for i, value in enumerate(label):
            row[permutation[i]] = value
        return row
    return permutation[label]


class ClassificationCollator:
    """Pads like ``DataCollatorWithPadding``; rows with their swapped pair (``swap_*``) become, in training (rows with
    ``swap_labels``), two rows each in the same batch (both orders in one micro-batch, so the step's loss is the
    mean over both), and in evaluation a second padded batch under ``swap_*`` for :class:`PairSwapAverage`."""

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = 8):
        self.pad = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)

    def __call__(self, features: list[dict]) -> dict:
        if "swap_input_ids" not in features[0]:
            return self.pad(features)
        main = [{k: v for k, v in f.items() if not k.startswith("swap_")} for f in features]
        swapped = [{k[len("swap_") :]: v for k, v in f.items() if k.startswith("swap_")} for f in features]
        if "swap_labels" in features[0]:
            return self.pad(main + swapped)
        batch = self.pad(main)
        batch.update({f"swap_{key}": value for key, value in self.pad(swapped).items()})
        return batch


# ---- Predictions --------------------------------------------------------------------------------------------------


def attach_pair_swap(model, data_args, permutation: list[int] | None) -> None:
    """With ``--pair_swap_predict``: the model's evaluation forwards average both orders (:class:`PairSwapAverage`)."""
    if permutation is None or not getattr(data_args, "pair_swap_predict", False):
        return
    if getattr(model, "pair_swap_average", None) is None:  # once per model (an ensemble member predicts each split)
        multi_label = getattr(data_args, "multi_label", False)
        model.pair_swap_average = PairSwapAverage(permutation, multi_label=multi_label).attach(model)


def probabilities(multi_label: bool):
    """``preprocess_logits_for_metrics``: float32 class probabilities (softmax, or a sigmoid per label)."""
    if multi_label:
        return lambda logits, labels: torch.sigmoid(logits.float())
    return lambda logits, labels: torch.softmax(logits.float(), dim=-1)


def sort_by_length(dataset):
    """``(dataset in order of length, order)``: prediction batches of similar lengths pad less; ``order[k]`` is the
    original row of sorted row ``k`` (see :func:`restore_order`)."""
    if len(dataset) == 0:
        return dataset, np.arange(0)
    lengths = np.fromiter((len(ids) for ids in dataset["input_ids"]), dtype=np.int64, count=len(dataset))
    order = np.argsort(-lengths, kind="stable")
    return dataset.select(order.tolist()), order


def restore_order(rows, order: np.ndarray):
    """The rows of a sorted split's predictions back in the split's own order."""
    restored = np.empty_like(np.asarray(rows))
    restored[order] = np.asarray(rows)[: len(order)]
    return restored


def write_prompts(path: Path, dataset, tokenizer, order: np.ndarray) -> None:
    """One JSON line per example, in the split's order: the prompt as the model read it (its tokens decoded, cut as
    it was), and the swapped pair's with ``--pair_swap_predict``."""
    restored = np.empty(len(order), dtype=np.int64)
    restored[order] = np.arange(len(order))
    swapped = "swap_input_ids" in dataset.column_names
    with path.open("w", encoding="utf-8") as f:
        for k in restored.tolist():
            row = dataset[k]
            record = {"prompt": tokenizer.decode(row["input_ids"])}
            if swapped:
                record["prompt_swapped"] = tokenizer.decode(row["swap_input_ids"])
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


# ---- Ensemble members (recipes/ensemble_folder.py, recipes/kfold.py) ----------------------------------------------


def load_member(folder: Path, model_args, labels: list[str]):
    """``(model, tokenizer)`` of one saved member: its own head (a label-token member with its own words and
    prompt, kept as ``model.prompt_template``), its own tokenizer."""
    member_args = replace(model_args, tokenizer_name=None, ignore_mismatched_sizes=False)
    if not is_label_token_folder(folder):
        member_args = replace(member_args, head="classifier", label_words=None, prompt_template=None)
        model, tokenizer, _ = load_classifier(AutoModelForSequenceClassification, member_args, labels, str(folder))
        return model, tokenizer
    saved = _saved_record(str(folder))
    pairs = PromptTemplate(saved["prompt_template"]).pairs if saved.get("prompt_template") else False
    member_args = replace(member_args, head="label_token", label_words=None, prompt_template=None)
    model, tokenizer, _ = load_label_token_classifier(member_args, labels, pairs, str(folder))
    return model, tokenizer


def member_inputs(recipe, model, tokenizer, rows: list[dict], labels: list[str], data_args, args):
    """``(dataset, collator, args)`` to predict ``rows`` with one member: inside its prompt, cut on
    ``--truncation_side``, with both orders averaged under ``--pair_swap_predict`` (the model's forwards hooked)."""
    template = getattr(model, "prompt_template", None)
    swap = pair_swap_permutation(data_args, labels) if getattr(data_args, "pair_swap_predict", False) else None
    label2id = {label: i for i, label in enumerate(labels)}
    dataset, _ = recipe.tokenize_and_count(
        rows,
        tokenizer,
        label2id,
        data_args.max_seq_length,
        data=data_args,
        prompt=PromptTemplate(template) if template else None,
        swap=swap,
    )
    if swap is not None:
        args.remove_unused_columns = False
        attach_pair_swap(model, data_args, swap)
    return dataset, ClassificationCollator(tokenizer), args
