"""LoRA (PEFT) in every recipe: the flags and their checks, the adapter built around a model (its head, a CRF and any
token added to the vocabulary trained in full), an adapter folder loaded back, and the adapter merged after training.

The adapter files are PEFT's own (``adapter_config.json``, ``adapter_model.safetensors``): ``peft.PeftModel`` and
``AutoPeftModelFor*`` load them, and the recipes load a folder holding one like a model folder.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nlp_tricks.data import DataError

from .errors import first_sentence

# Every recipe's LoRA defaults (summarization's demo brings --peft lora; the others start with --peft none).
LORA_DEFAULTS = {
    "lora_r": 16,
    "lora_alpha": 32.0,
    "lora_dropout": 0.0,  # PEFT's: dropout masks on every adapted layer's input cost a fifth of a demo step
    "lora_target_modules": ["all-linear"],
    "lora_init": "default",
}
LORA_SWITCHES = ("lora_use_rslora", "lora_use_dora")
# --lora_init: PEFT's `init_lora_weights` values that need nothing but the model (not eva / corda / loftq, which take
# data or a quantization config); "default" is PEFT's True (Kaiming-uniform A, zero B).
LORA_INITS = ("default", "gaussian", "pissa", "pissa_niter_<n>", "olora", "orthogonal")
# These start the adapter from the model's principal directions and subtract them from its own weights.
LORA_INITS_CHANGING_THE_MODEL = ("pissa", "olora")
ADAPTER_CONFIG = "adapter_config.json"
# Set on a PeftModel the recipes wrap with --merge_lora true: merge_trained_adapter merges it when training ends.
MERGE_WHEN_TRAINED = "_recipes_merge_when_trained"
# PEFT's task types of the recipes' model classes, by the transformers Auto class that loads them.
TASK_TYPES = {
    "AutoModelForSequenceClassification": "SEQ_CLS",
    "AutoModelForTokenClassification": "TOKEN_CLS",
    "AutoModelForCausalLM": "CAUSAL_LM",
}


@dataclass
class PeftArguments:
    """Train a low-rank adapter (and the task head in full) instead of every weight."""

    peft: str = field(
        default="none",
        metadata={
            "help": "'lora' trains a LoRA adapter (Hu et al. 2021, https://arxiv.org/abs/2106.09685; the peft "
            "package) on the layers --lora_target_modules names and freezes the model's own weights; the task head "
            "(classifier / score), a CRF and a padding token added to the vocabulary train in full (PEFT's "
            "modules_to_save, trainable_token_indices). 'none' fine-tunes every weight. Works on encoders and on "
            "decoder LMs (Llama, Qwen2, Mistral, Gemma, GPT-2, ...; docs/decoder_only.md).",
            "choices": ["none", "lora"],
        },
    )
    lora_r: int | None = field(
        default=None,
        metadata={"help": f"--peft lora: rank of the adapter matrices (default {LORA_DEFAULTS['lora_r']})."},
    )
    lora_alpha: float | None = field(
        default=None,
        metadata={
            "help": "--peft lora: scaling of the adapter's update, alpha / r "
            f"(default {LORA_DEFAULTS['lora_alpha']:g})."
        },
    )
    lora_dropout: float | None = field(
        default=None,
        metadata={"help": f"--peft lora: dropout on the adapter's input (default {LORA_DEFAULTS['lora_dropout']:g})."},
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "--peft lora: names of the linear layers that get an adapter (e.g. q_proj v_proj), or "
            "'all-linear' (every linear layer but the output head; default "
            f"{' '.join(LORA_DEFAULTS['lora_target_modules'])})."
        },
    )
    lora_use_rslora: bool = field(
        default=False,
        metadata={
            "help": "--peft lora: rank-stabilised LoRA (Kalajdzievski 2023, https://arxiv.org/abs/2312.03732): the "
            "update is scaled by alpha / sqrt(r) instead of alpha / r (PEFT's use_rslora)."
        },
    )
    lora_use_dora: bool = field(
        default=False,
        metadata={
            "help": "--peft lora: DoRA (Liu et al. 2024, https://arxiv.org/abs/2402.09353): the adapted weight is a "
            "trained magnitude per output times the direction W + BA (PEFT's use_dora; slower steps)."
        },
    )
    lora_init: str | None = field(
        default=None,
        metadata={
            "help": "--peft lora: how the adapter starts (PEFT's init_lora_weights): 'default' (Kaiming-uniform A, "
            "zero B: the model unchanged), 'gaussian', 'pissa' (Meng et al. 2024, https://arxiv.org/abs/2404.02948: "
            "A and B from the weights' principal singular vectors, the rest left in the weights), 'pissa_niter_<n>' "
            "(the same by a fast SVD of n iterations), 'olora' (Buyukakyuz 2024: from a QR decomposition) or "
            "'orthogonal'. pissa and olora change the model's own weights, so they need --merge_lora (the default). "
            "Default 'default'."
        },
    )
    merge_lora: bool = field(
        default=True,
        metadata={
            "help": "--peft lora: after training, merge the adapter into the model's weights, so --output_dir holds "
            "a plain model (it reloads with from_pretrained and --model_name_or_path) and evaluation runs without "
            "the adapter's extra products. false: --output_dir holds the adapter alone (adapter_config.json, "
            "adapter_model.safetensors, as PEFT saves them); --model_name_or_path DIR loads it on its base model."
        },
    )

    def __post_init__(self):
        check_peft_arguments(self)


def check_peft_arguments(args: PeftArguments) -> None:
    """Fill in the LoRA defaults under ``--peft lora``; refuse a LoRA flag without it and values out of range
    (``ValueError`` naming the field: the recipes print it as one line)."""
    lora_fields = tuple(LORA_DEFAULTS)
    if args.peft == "none":
        given = [name for name in lora_fields if getattr(args, name) is not None]
        given += [name for name in LORA_SWITCHES if getattr(args, name)]
        if given:
            raise ValueError(f"{given[0]} applies to a LoRA adapter; add --peft lora (it is 'none')")
        return
    for name in lora_fields:
        if getattr(args, name) is None:
            setattr(args, name, copy.copy(LORA_DEFAULTS[name]))
    if args.lora_r < 1:
        raise ValueError(f"lora_r={args.lora_r} is not allowed; it must be >= 1")
    if not args.lora_alpha > 0:
        raise ValueError(f"lora_alpha={args.lora_alpha} is not allowed; it must be > 0")
    if not 0 <= args.lora_dropout < 1:
        raise ValueError(f"lora_dropout={args.lora_dropout} is not allowed; it must be in [0, 1)")
    if not args.lora_target_modules or any(not name.strip() for name in args.lora_target_modules):
        raise ValueError("lora_target_modules: give at least one module name (e.g. q_proj v_proj) or all-linear")
    if not re.fullmatch(r"default|gaussian|pissa|pissa_niter_\d+|olora|orthogonal", args.lora_init):
        raise ValueError(f"lora_init={args.lora_init!r} is not allowed; choose one of {', '.join(LORA_INITS)}")
    if args.lora_init.startswith(LORA_INITS_CHANGING_THE_MODEL) and not args.merge_lora:
        raise ValueError(
            f"lora_init={args.lora_init!r} moves the weights' principal part into the adapter, so an adapter saved "
            "alone (--merge_lora false) would not fit the original model; keep --merge_lora true"
        )


def check_peft_tricks(model_args, training_args) -> None:
    """The tricks that do not combine with ``--peft lora`` in the recipes, refused in one line before anything
    loads: each replaces or restarts weights that a LoRA model keeps frozen or wraps."""
    if getattr(model_args, "peft", "none") != "lora":
        return
    refused = {
        "reinit_layers": "re-initialised layers would stay frozen under the adapter",
        "pooling": "the pooling is added inside the model, which the adapter has wrapped already",
        "span_head": "the span head replaces the classifier that the adapter trains in full (modules_to_save)",
    }
    for name, why in refused.items():
        value = getattr(training_args, name, None)
        if value:
            raise DataError(None, None, f"--{name} {value} does not combine with --peft lora: {why}; give --peft none")


def head_modules(model) -> list[str]:
    """The names of the task head's modules: the model's children with weights outside its ``base_model``
    (``score`` for Llama / Qwen2 / Mistral / Gemma, ``classifier`` for BERT and GPT-2's token classifier,
    ``pooler`` and ``classifier`` for DeBERTa, a ``crf``). They train in full beside the adapter."""
    base = getattr(model, "base_model", model)
    if base is model:
        return []
    return [
        name
        for name, child in model.named_children()
        if child is not base and next(child.parameters(), None) is not None
    ]


def add_lora(model, model_args, task_type: str | None = "CAUSAL_LM", new_tokens: tuple[int, ...] = ()):
    """``model`` wrapped in a LoRA adapter as the ``--lora_*`` flags say (``peft.get_peft_model``): only the adapter
    trains, and for a classifier (``task_type`` ``SEQ_CLS`` / ``TOKEN_CLS``) its head in full
    (:func:`head_modules`, PEFT's ``modules_to_save``), as do the embedding rows of the ``new_tokens`` added to the
    vocabulary (``trainable_token_indices``); ``task_type`` None: no head trains in full and PEFT's plain
    ``PeftModel`` wraps it (recipes/classification.py's label-token classifier, whose head is the frozen LM head).
    With ``--merge_lora`` the model is merged when training ends (:func:`merge_trained_adapter`)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise DataError(None, None, "--peft lora needs the package 'peft': pip install peft") from err
    heads = head_modules(model) if task_type not in ("CAUSAL_LM", None) else []
    if task_type not in ("CAUSAL_LM", None) and not heads:
        raise DataError(None, None, f"--peft lora: {type(model).__name__} has no task head outside its base model")
    _name_base_model(model, model_args)
    targets = model_args.lora_target_modules
    config = LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        # The head trains in full: no adapter inside it (all-linear would put one on its linear layers).
        exclude_modules=f"({'|'.join(map(re.escape, heads))})(\\..*)?" if heads else None,
        modules_to_save=heads or None,
        trainable_token_indices=list(new_tokens) or None,
        use_rslora=model_args.lora_use_rslora,
        use_dora=model_args.lora_use_dora,
        init_lora_weights=True if model_args.lora_init == "default" else model_args.lora_init,
        task_type=task_type,
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as err:  # a target module the model does not have
        raise DataError(None, None, f"--lora_target_modules {' '.join(targets)}: {str(err).splitlines()[0]}") from err
    setattr(peft_model, MERGE_WHEN_TRAINED, bool(model_args.merge_lora))
    return peft_model


def _name_base_model(model, model_args) -> None:
    """Record the base model's folder as an absolute path, so that the saved adapter (its
    ``base_model_name_or_path``) reloads from any working directory; an adapter saved alone needs one."""
    name = getattr(model, "name_or_path", "") or ""
    if name and Path(name).is_dir():
        model.name_or_path = str(Path(name).resolve())
    elif not name and not model_args.merge_lora:
        raise DataError(
            None,
            None,
            f"--merge_lora false saves the adapter alone, which reloads on its base model; "
            f"{model_args.model_name_or_path} is no model folder or Hub id: keep --merge_lora true",
        )


def merge_trained_adapter(trainer) -> None:
    """After training, a LoRA model the recipe built with ``--merge_lora true`` is merged into its weights (the head
    and added token rows trained in full replace the original ones): the run then saves, evaluates and predicts with
    a plain transformers model, with the weights the tricks evaluate with (the EMA's with ``--ema_eval``).
    Checkpoints written during training keep the adapter."""
    if not getattr(trainer.model, MERGE_WHEN_TRAINED, False):
        return
    # The weights the tricks evaluate and save with (the EMA's with --ema_eval) become the weights for good, so that
    # the merge holds them (the adapter's matrices are gone after it, so they could not be swapped in later).
    chosen = trainer.call_tricks("eval_weights") if hasattr(trainer, "call_tricks") else contextlib.nullcontext()
    with chosen:
        values = [(p, p.detach().clone()) for p in trainer.model.parameters() if p.requires_grad]
    with torch.no_grad():
        for param, value in values:
            param.copy_(value)
    merged = trainer.model.merge_and_unload()
    # Prepared for evaluation as Trainer prepares a model it did not train (mixed precision's autocast on its
    # forward): the merged model then predicts as the same folder reloaded with --do_train false does.
    trainer.model = trainer.model_wrapped = trainer.accelerator.prepare_model(merged, evaluation_mode=True)


def adapter_config(path: str | None) -> dict | None:
    """The ``adapter_config.json`` of a folder that holds a PEFT adapter (a run saved with ``--merge_lora false``),
    or None."""
    if not path or not (Path(path) / ADAPTER_CONFIG).is_file():
        return None
    try:
        config = json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(Path(path) / ADAPTER_CONFIG, None, f"cannot read it: {first_sentence(err)}") from err
    if not isinstance(config, dict) or not config.get("base_model_name_or_path"):
        raise DataError(Path(path) / ADAPTER_CONFIG, None, "names no base_model_name_or_path to load the adapter on")
    return config


def load_adapter(model, path: str, model_args, train: bool):
    """The adapter saved in ``path`` on ``model`` (its base model, with the head and any CRF the adapter's
    ``modules_to_save`` names): ``peft.PeftModel.from_pretrained``. Trained with ``--peft lora`` it trains on (merged
    when training ends with ``--merge_lora``); trained with ``--peft none`` it is merged and every weight trains;
    to predict it stays as saved."""
    from peft import PeftModel

    lora = train and model_args.peft == "lora"
    try:
        peft_model = PeftModel.from_pretrained(model, path, is_trainable=lora)
    except (OSError, ValueError, RuntimeError) as err:
        raise DataError(
            None, None, f"--model_name_or_path {path}: cannot load its adapter: {first_sentence(err)}"
        ) from err
    if lora:
        setattr(peft_model, MERGE_WHEN_TRAINED, bool(model_args.merge_lora))
    elif train:
        return peft_model.merge_and_unload()
    return peft_model
