"""A recipe's model: which one to start from, its config and tokenizer, its weights, and a saved CRF kept."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from nlp_tricks.data import DataError, demo_causal_lm_path, demo_model_path
from nlp_tricks.functional.crf import add_crf, load_crf_model
from nlp_tricks.functional.pooling import load_pooled_model
from nlp_tricks.runtime.checkpoint import is_state_dict_file, load_state_dict_portable, read_state_dict

from .arguments import ModelArguments
from .errors import one_line_load_errors

# Names of built-in demo models that --model_name_or_path takes, and the function giving each one's folder.
DEMO_MODELS = {"smollm2-demo": demo_causal_lm_path, "minilm-demo": demo_model_path}


def resolve_model_path(model_name_or_path: str | None) -> str:
    """The model to start from: the given path or hub id, a built-in demo model's folder (``smollm2-demo``:
    SmolLM2-135M-Instruct, converted on first use; ``minilm-demo``: the demo's MiniLM encoder), or that MiniLM encoder
    when none is given."""
    if model_name_or_path in DEMO_MODELS:
        return DEMO_MODELS[model_name_or_path]()
    return model_name_or_path or demo_model_path()


def load_config_and_tokenizer(
    model_name_or_path: str,
    tokenizer_name: str | None = None,
    trust_remote_code: bool = False,
    **config_kwargs,
):
    """The config and tokenizer of ``model_name_or_path``.

    A raw state-dict file (``.pt`` / ``.pth`` / ``.bin`` / ``.safetensors``) has neither: its architecture and
    tokenizer are the demo model's (or ``tokenizer_name``'s), and :func:`load_weights` loads the file into it.
    """
    source = demo_model_path() if is_state_dict_file(model_name_or_path) else model_name_or_path
    with one_line_load_errors(f"--model_name_or_path {model_name_or_path}", source):
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **config_kwargs)
    with one_line_load_errors(f"--tokenizer_name {tokenizer_name or source}"):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or source, trust_remote_code=trust_remote_code)
    return config, tokenizer


def load_classifier(auto_cls, model_args: ModelArguments, labels: list[str], model_path: str | None = None):
    """``(model, tokenizer, config)``: ``auto_cls`` (a token / sequence classification class) from
    ``model_path`` (default ``--model_name_or_path``) with a fresh head over ``labels``."""
    path = resolve_model_path(model_path or model_args.model_name_or_path)
    config, tokenizer = load_config_and_tokenizer(
        path,
        model_args.tokenizer_name,
        model_args.trust_remote_code,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    model = load_weights(
        auto_cls,
        path,
        config,
        model_args.trust_remote_code,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    return model, tokenizer, config


def load_weights(
    auto_cls, model_name_or_path: str, config, trust_remote_code: bool = False, ignore_mismatched_sizes: bool = False
):
    """``auto_cls.from_pretrained``; for a raw state-dict file, the model built from ``config`` with its weights.

    A model saved with a CRF (``--crf``: ``config.crf``, or ``crf.*`` keys in a state-dict file) comes back with it;
    one saved with ``--pooling`` (``config.pooling``) with its pooling. Weights that do not load are one line naming
    the file (:func:`one_line_load_errors`).
    """
    with one_line_load_errors(f"--model_name_or_path {model_name_or_path}", model_name_or_path):
        return _load_weights(auto_cls, model_name_or_path, config, trust_remote_code, ignore_mismatched_sizes)


def _load_weights(auto_cls, model_name_or_path: str, config, trust_remote_code: bool, ignore_mismatched_sizes: bool):
    if is_state_dict_file(model_name_or_path):
        # Any checkpoint (DataParallel / DDP / compiled prefixes), any device, strict, with clear errors.
        model = auto_cls.from_config(config, trust_remote_code=trust_remote_code)
        state = read_state_dict(model_name_or_path)
        if any(key == "crf.transitions" or key.endswith(".crf.transitions") for key in state):
            add_crf(model)
        load_state_dict_portable(model, state)
        return model
    if getattr(config, "crf", False) and auto_cls is AutoModelForTokenClassification:
        return load_crf_model(
            model_name_or_path,
            config=config,
            trust_remote_code=trust_remote_code,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
        )
    if getattr(config, "pooling", None) is not None and auto_cls is AutoModelForSequenceClassification:
        return load_pooled_model(
            model_name_or_path,
            config=config,
            trust_remote_code=trust_remote_code,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
        )
    return auto_cls.from_pretrained(
        model_name_or_path,
        config=config,
        trust_remote_code=trust_remote_code,
        ignore_mismatched_sizes=ignore_mismatched_sizes,
    )


def model_holds_crf(model_name_or_path: str | None) -> bool:
    """Whether ``--model_name_or_path`` is a model saved with its CRF (``--crf true``): ``config.crf`` in its folder,
    or ``crf.*`` weights in a state-dict file. Such a model is only right as a CRF (Viterbi over its emissions)."""
    if not model_name_or_path or model_name_or_path in DEMO_MODELS:
        return False
    if is_state_dict_file(model_name_or_path):
        try:
            keys = read_state_dict(model_name_or_path).keys()
        except Exception:  # an unreadable file is reported, in one line, where the model loads
            return False
        return any(key == "crf.transitions" or key.endswith(".crf.transitions") for key in keys)
    config_file = Path(model_name_or_path) / "config.json"
    if config_file.is_file():
        try:
            return json.loads(config_file.read_text(encoding="utf-8")).get("crf") is True
        except (OSError, ValueError, AttributeError):
            return False
    return False  # a Hub id: load_weights still loads a saved CRF with it (config.crf)


def saved_crf_defaults(*model_fields: str) -> tuple[Callable, dict]:
    """``dependent_defaults`` of the NER recipes: ``--crf true`` unless given when a model they load holds a CRF."""
    return (
        lambda namespace: any(model_holds_crf(getattr(namespace, name, None)) for name in model_fields),
        {True: {"crf": True}},
    )


def check_saved_crf(training_args, model_args) -> None:
    """A model saved with a CRF used without it (``--crf false`` given) would predict the emissions' argmax: refused
    in one line. (Without the flag the recipes turn ``--crf`` on for it, see :func:`saved_crf_defaults`.)"""
    for name in ("model_name_or_path", "student_model_name_or_path"):
        path = getattr(model_args, name, None)
        if not training_args.crf and model_holds_crf(path):
            raise DataError(
                None, None, f"--{name} {path} was trained with a CRF and predicts with it (Viterbi); drop --crf false"
            )
