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
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from nlp_tricks.data import DataError, demo_causal_lm_path, demo_model_path
from nlp_tricks.functional.crf import add_crf, load_crf_model
from nlp_tricks.functional.pooling import load_pooled_model
from nlp_tricks.runtime.checkpoint import is_state_dict_file, load_state_dict_portable, read_state_dict

from .arguments import ModelArguments
from .errors import one_line_load_errors
from .pad_token import choose_pad_token, fit_model_to_tokenizer
from .peft import TASK_TYPES, adapter_config, add_lora, load_adapter

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


def load_classifier(
    auto_cls, model_args: ModelArguments, labels: list[str], model_path: str | None = None, training_args=None
):
    """``(model, tokenizer, config)``: ``auto_cls`` (a token / sequence classification class) from
    ``model_path`` (default ``--model_name_or_path``) with a fresh head over ``labels``, ready to train with
    ``training_args`` (``--do_train``, ``--crf``), or to predict (``training_args`` None).

    The tokenizer gets a padding token if it has none (``--pad_token``; :func:`choose_pad_token`) and the model's
    config its id. A folder holding a PEFT adapter (a run saved with ``--merge_lora false``) loads on its base model,
    trained head and CRF included; trained with ``--peft none`` it is merged and every weight trains. Trained with
    ``--peft lora``, a model without an adapter gets a new one (:func:`add_lora`), a ``--crf`` inside it.
    """
    train = training_args is not None and training_args.do_train
    path = resolve_model_path(model_path or model_args.model_name_or_path)
    adapter, base, config, tokenizer = load_labelled_config(path, model_args, labels)
    check_task_class(auto_cls, config, base)
    model = load_weights(
        auto_cls,
        base,
        config,
        model_args.trust_remote_code,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    check_head_dropout(auto_cls, config, training_args)
    new_token = choose_pad_token(tokenizer, model_args.pad_token, f"--model_name_or_path {path}")
    fit_model_to_tokenizer(model, tokenizer)
    if adapter:
        if "crf" in (adapter.get("modules_to_save") or []):
            add_crf(model)  # the adapter holds the trained CRF's weights
        model = load_adapter(model, path, model_args, train)
    elif train and model_args.peft == "lora":
        task_type = TASK_TYPES.get(auto_cls.__name__, "SEQ_CLS")
        if getattr(training_args, "crf", False) and task_type == "TOKEN_CLS":
            add_crf(model, bio_constraints=training_args.crf_bio_constraints)  # trains in full beside the adapter
        model = add_lora(model, model_args, task_type, () if new_token is None else (new_token,))
    return model, tokenizer, config


def load_labelled_config(path: str, model_args: ModelArguments, labels: list[str]):
    """``(adapter config or None, base model, config, tokenizer)`` of the model folder or Hub id ``path``: a folder
    holding a PEFT adapter reads its base model's config and its own tokenizer (the run saved it beside the
    adapter); the config gets ``labels`` (``num_labels``, ``id2label``, ``label2id``)."""
    adapter = adapter_config(path)
    base = adapter["base_model_name_or_path"] if adapter else path
    config, tokenizer = load_config_and_tokenizer(
        base,
        model_args.tokenizer_name or (path if adapter else None),
        model_args.trust_remote_code,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    return adapter, base, config, tokenizer


def is_causal_lm(config) -> bool:
    """Whether a checkpoint is a decoder-only causal LM: not encoder-decoder, and its architecture is one of
    transformers' causal LMs (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...), or, without a recorded architecture,
    its model type has a causal LM and no masked LM (BERT has both: it is an encoder, for BERT2BERT)."""
    if getattr(config, "is_encoder_decoder", False):
        return False
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if any(name in causal_classes for name in getattr(config, "architectures", None) or []):
        return True
    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.model_type not in (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )


def check_head_dropout(auto_cls, config, training_args) -> None:
    """Multi-sample dropout (``--head_dropout_samples``) on a decoder's sequence classifier, refused in one line: its
    head runs at every position before the last token's logits are taken, so the K head samples are not logits."""
    samples, p = getattr(training_args, "head_dropout_samples", 1), getattr(training_args, "head_dropout", 0.0)
    if (samples > 1 or p > 0) and auto_cls is AutoModelForSequenceClassification and is_causal_lm(config):
        raise DataError(
            None,
            None,
            f"--head_dropout_samples {samples} --head_dropout {p:g}: a decoder's sequence classifier "
            f"({config.model_type}) runs its head at every position and then keeps the last token's logits; "
            "multi-sample dropout needs a head whose output is the logits (an encoder's, or token classification)",
        )


def check_task_class(auto_cls, config, model_name_or_path: str) -> None:
    """A model whose architecture transformers has no class for this task (``--model_name_or_path`` a decoder
    without ``*ForTokenClassification``, such as GPT-J) is refused in one line naming it."""
    if type(config) in auto_cls._model_mapping or auto_cls.__name__ in (getattr(config, "auto_map", None) or {}):
        return
    task = auto_cls.__name__.removeprefix("AutoModelFor")
    names = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
    raise DataError(
        None,
        None,
        f"--model_name_or_path {model_name_or_path}: transformers has no {task} class for the architecture "
        f"{config.model_type!r} ({names}); this recipe needs one (Llama, Qwen2, Mistral, GPT-2 and most encoders "
        "have it)",
    )


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
    a ``crf`` among the ``modules_to_save`` of the adapter it holds, or ``crf.*`` weights in a state-dict file. Such
    a model is only right as a CRF (Viterbi over its emissions)."""
    if not model_name_or_path or model_name_or_path in DEMO_MODELS:
        return False
    if is_state_dict_file(model_name_or_path):
        try:
            keys = read_state_dict(model_name_or_path).keys()
        except Exception:  # an unreadable file is reported, in one line, where the model loads
            return False
        return any(key == "crf.transitions" or key.endswith(".crf.transitions") for key in keys)
    adapter = adapter_config(model_name_or_path)
    if adapter is not None:  # an adapter saved alone (--merge_lora false) holds its CRF in modules_to_save
        return "crf" in (adapter.get("modules_to_save") or [])
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
