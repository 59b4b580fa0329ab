"""Abstractive summarization (seq2seq) with every nlp_tricks trick as a flag.

    accelerate launch recipes/summarization.py            # offline demo: ACLSum, BERT2BERT from the MiniLM encoder
    accelerate launch recipes/summarization.py --help     # every data, model, generation and trick flag
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
- Model: a seq2seq model (BART, T5, ...) as it is; an encoder-only model (BERT, the demo's MiniLM) becomes a
  BERT2BERT ``EncoderDecoderModel`` warm-started from it on both sides (Rothe et al. 2020,
  https://arxiv.org/abs/1907.12461).
- Metrics: ROUGE-1 / ROUGE-2 / ROUGE-L of generated summaries (``--predict_with_generate``, on by default) against
  the full reference summaries (``--max_target_length`` cuts them for training only), from the ``evaluate`` module
  shipped in ``nlp_tricks/metrics/rouge``.
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from datasets import Dataset
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    EncoderDecoderConfig,
    EncoderDecoderModel,
    IntervalStrategy,
    set_seed,
)

from nlp_tricks.checkpoint import is_state_dict_file, load_state_dict_portable
from nlp_tricks.data import demo_summarization, read_table_file
from nlp_tricks.metrics import load_metric
from nlp_tricks.seq2seq import Seq2SeqTricksArguments, Seq2SeqTricksTrainer, tie_encoder_decoder

from common import (
    DataArguments,
    ModelArguments,
    data_record,
    eval_splits,
    load_splits,
    own_rows,
    parse_recipe_args,
    prepare_output_dir,
    resolve_model_path,
    resume_argument,
    run_recipe,
    train_evaluate_predict,
    warn,
)

# Tuned on the demo (ACLSum + BERT2BERT MiniLM, 2-core CPU); every one is a flag.
RECIPE_DEFAULTS = {
    "learning_rate": 1e-4,
    "num_train_epochs": 3,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "weight_decay": 0.01,
    "eval_strategy": "epoch",
    "logging_steps": 10,
    "save_strategy": "no",
    "predict_with_generate": True,
    "generation_max_length": 128,
    "generation_num_beams": 1,
}


# The metric the ablation runner reports (all_results.json holds eval_rougeL and test_rougeL).
MAIN_METRIC = "rougeL"
# Configurations the ablation runner (recipes/ablation.py) adds to its common ones for this recipe.
ABLATION_CONFIGURATIONS = {
    "scheduled_sampling": ["--scheduled_sampling", "inverse_sigmoid", "--ss_k", "20"],
    "untied": ["--bert2bert_tying", "none"],
}


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


@dataclass
class SummarizationModelArguments(ModelArguments):
    """Which pretrained model to fine-tune."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A seq2seq or encoder-only model folder or Hub id (encoder-only: BERT2BERT), or a raw "
            "state-dict file (.pt/.bin/.safetensors) of the demo's BERT2BERT. Default: BERT2BERT from the "
            "all-MiniLM-L6-v2 encoder shipped by the demo extra."
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


def load_summarization_splits(data: SummarizationDataArguments) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test; keys text, summary."""
    columns = [data.text_column, data.summary_column]

    def read_file(path):
        return [
            {"text": ex[data.text_column], "summary": ex[data.summary_column]}
            for ex in read_table_file(path, columns, nonempty=[data.summary_column])
        ]

    def hub_converter(features):
        return lambda row: {"text": row[data.text_column], "summary": row[data.summary_column]}

    return load_splits(data, read_file, demo_summarization, "demo (aclsum)", hub_converter)


def load_model_and_tokenizer(model_args: SummarizationModelArguments):
    """A seq2seq model as it is, or BERT2BERT warm-started from an encoder-only model on both sides."""
    path = resolve_model_path(model_args.model_name_or_path)
    state_dict_file = is_state_dict_file(path)
    source = resolve_model_path(None) if state_dict_file else path
    remote = model_args.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or source, trust_remote_code=remote)
    config = AutoConfig.from_pretrained(source, trust_remote_code=remote)
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


def tokenize(
    examples: list[dict], tokenizer, data: SummarizationDataArguments, decoder_start: int | None = None
) -> Dataset:
    """Token ids of the documents and labels of the summaries. ``decoder_start``: the token the decoder starts from
    ([CLS] for BERT2BERT); a label sequence that begins with it ([CLS] summary [SEP]) loses it, or the decoder would
    learn to answer [CLS] with [CLS] and greedy generation would repeat it."""
    encodings = tokenizer(
        [data.source_prefix + ex["text"] for ex in examples], truncation=True, max_length=data.max_source_length
    )
    targets = tokenizer(
        text_target=[ex["summary"] for ex in examples], truncation=True, max_length=data.max_target_length
    )["input_ids"]
    if decoder_start is not None:
        targets = [ids[1:] if ids[:1] == [decoder_start] else ids for ids in targets]
    return Dataset.from_dict({**encodings, "labels": targets})


def summarization_truncation_record(splits: dict[str, list[dict]], tokenizer, data) -> dict:
    """For ``all_results.json``: per split, the documents longer than ``--max_source_length``
    (``<prefix>_truncated_examples``) and the summaries longer than ``--max_target_length``
    (``<prefix>_truncated_summaries``: cut for training only; ROUGE uses the full references). A warning for
    validation / test documents the model sees only in part."""
    record = {}
    for split, examples in splits.items():
        prefix = "eval" if split == "validation" else split
        documents = tokenizer(
            [data.source_prefix + ex["text"] for ex in examples], truncation=False, verbose=False, return_length=True
        )["length"]
        summaries = tokenizer(
            text_target=[ex["summary"] for ex in examples], truncation=False, verbose=False, return_length=True
        )["length"]
        record[f"{prefix}_truncated_examples"] = sum(n > data.max_source_length for n in documents)
        record[f"{prefix}_truncated_summaries"] = sum(n > data.max_target_length for n in summaries)
        if record[f"{prefix}_truncated_examples"] and split != "train":
            warn(
                f"{split}: {record[f'{prefix}_truncated_examples']} of {len(examples)} documents are longer than "
                f"--max_source_length {data.max_source_length} tokens; the model sees their beginning only"
            )
    return record


def main() -> None:
    data_args, model_args, training_args = parse_recipe_args(
        (SummarizationDataArguments, SummarizationModelArguments, Seq2SeqTricksArguments),
        "summarization",
        RECIPE_DEFAULTS,
    )
    set_seed(training_args.seed)
    prepare_output_dir(
        training_args.output_dir,
        data_args.overwrite_output_dir,
        resume_argument(training_args.resume_from_checkpoint),
        reads=(model_args.model_name_or_path, model_args.tokenizer_name),
    )

    # ---- Data: read everything (and fail on bad input) before any training ----
    splits = load_summarization_splits(data_args)
    train_examples = splits["train"][0][: data_args.max_train_samples]
    eval_examples = eval_splits(splits, data_args.max_eval_samples)

    # ---- Model ----
    model, tokenizer = load_model_and_tokenizer(model_args)
    # BERT2BERT starts decoding at [CLS], which BERT's tokenizer also puts first in the labels; BART / T5 keep theirs.
    start = model.config.decoder_start_token_id if isinstance(model, EncoderDecoderModel) else None
    train_dataset = tokenize(train_examples, tokenizer, data_args, start)
    eval_datasets = {split: tokenize(ex, tokenizer, data_args, start) for split, ex in eval_examples.items()}

    rouge = load_metric("rouge")

    def decode(ids: np.ndarray) -> list[str]:
        ids = np.where(ids != -100, ids, tokenizer.pad_token_id)
        return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]

    def split_metrics(examples: list[dict]):
        """ROUGE of the generated summaries against the split's full reference summaries, as read (the labels
        are cut to --max_target_length for training)."""

        def compute_metrics(eval_pred):
            predictions = own_rows(eval_pred.predictions, len(examples))
            references = [ex["summary"] for ex in examples]
            scores = rouge.compute(predictions=decode(predictions), references=references)
            scores = {key: float(value) for key, value in scores.items()}
            scores["gen_len"] = float(np.mean(np.sum(predictions != tokenizer.pad_token_id, axis=-1)))
            return scores

        return compute_metrics

    metrics_for = {split: split_metrics(examples) for split, examples in eval_examples.items()}

    if "validation" not in eval_datasets:
        training_args.eval_strategy = IntervalStrategy.NO  # no validation data: nothing to evaluate during training
    trainer = Seq2SeqTricksTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_datasets.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8),
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
        **summarization_truncation_record({"train": train_examples, **eval_examples}, tokenizer, data_args),
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
