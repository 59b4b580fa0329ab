"""A recipe's data: its splits (files, the demo or a Hub dataset), their labels, and the tokenizing map's options."""

from __future__ import annotations

from collections.abc import Callable

from nlp_tricks.data import DataError, check_labels, kfold_examples, label_list, split_examples
from nlp_tricks.data.arrow import as_dataset, distinct_values, first_rows
from nlp_tricks.functional.crf import bio_constraints
from nlp_tricks.functional.losses import focal_alpha_weights

from .arguments import DataArguments
from .errors import first_sentence


def load_splits(
    data: DataArguments,
    read_file: Callable[[str], object],
    demo: Callable[[], list[dict] | dict[str, list[dict]]],
    demo_source: str,
    hub_converter: Callable,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
) -> dict[str, tuple[object, str]]:
    """``{split: (examples, source name for errors)}`` from the files, the demo or a Hub dataset; the examples of
    each split are a ``datasets.Dataset`` (Arrow, memory-mapped: memory does not grow with the file).

    ``read_file(path)`` returns a file's examples (a dataset, e.g. from :func:`nlp_tricks.data.arrow_dataset`);
    ``demo()`` the built-in examples (one list, or a dict of splits); ``hub_converter(features)`` the function turning
    one Hub row into an example. With neither a validation nor a test split, train is split into train / validation
    / test by ``fractions`` (80/10/10) with ``data.split_seed`` (``select``: no row is copied).
    """
    if data.train_file:
        splits = {"train": (read_file(data.train_file), data.train_file)}
        for split, path in (("validation", data.validation_file), ("test", data.test_file)):
            if path:
                splits[split] = (read_file(path), path)
    elif data.dataset_name == "demo":
        examples = demo()
        if isinstance(examples, dict):
            splits = {split: (as_dataset(rows), f"{demo_source}[{split}]") for split, rows in examples.items()}
        else:
            splits = {"train": (as_dataset(examples), demo_source)}
    else:
        splits = _hub_splits(data, hub_converter)
    if getattr(data, "num_folds", None) is not None:
        return _fold_splits(splits, data)
    if "validation" not in splits and "test" not in splits:
        examples, source = splits["train"]
        train, validation, test = split_examples(examples, fractions, seed=data.split_seed)
        splits = {"train": (train, source), "validation": (validation, source), "test": (test, source)}
    return splits


def _hub_splits(data: DataArguments, hub_converter: Callable) -> dict[str, tuple[object, str]]:
    """The train / validation / test splits of ``--dataset_name`` that exist, each row turned into an example."""
    from datasets import load_dataset

    try:
        raw = load_dataset(data.dataset_name, data.dataset_config_name)
    except (OSError, ValueError, ConnectionError) as err:  # no such dataset, or offline (HF_DATASETS_OFFLINE)
        raise DataError(
            None, None, f"--dataset_name {data.dataset_name}: cannot load it: {first_sentence(err)}"
        ) from err
    splits = {}
    for split in ("train", "validation", "test"):
        if split in raw:
            convert = hub_converter(raw[split].features)
            rows = raw[split].map(
                convert,
                remove_columns=raw[split].column_names,
                num_proc=getattr(data, "preprocessing_num_workers", None),
                desc=f"Reading {data.dataset_name}[{split}]",
            )
            splits[split] = (rows, f"{data.dataset_name}[{split}]")
    return splits


def _fold_splits(splits: dict[str, tuple[object, str]], data: DataArguments) -> dict[str, tuple[object, str]]:
    """``--num_folds N --fold K`` of single-split data: fold K is test, a tenth of the rest validation; "all" keeps
    every example."""
    if "validation" in splits or "test" in splits:
        raise DataError(
            None,
            None,
            "--num_folds needs single-split data (a --train_file alone, or the NER / classification demo)",
        )
    examples, source = splits["train"]
    train, validation, test = kfold_examples(examples, data.num_folds, data.fold, seed=data.split_seed)
    # "all": every fold's model knows every label, even one that occurs only in its test fold.
    return {
        "train": (train, source),
        "validation": (validation, source),
        "test": (test, source),
        "all": (examples, source),
    }


def eval_splits(splits: dict[str, tuple[object, str]], max_samples: int | None) -> dict[str, object]:
    """The validation and test examples that exist, each cut to ``max_samples``."""
    return {
        split: first_rows(splits[split][0], max_samples)
        for split in ("validation", "test")
        if split in splits and len(splits[split][0])
    }


def labels_of(examples, label_key: str) -> list[str]:
    """:func:`~nlp_tricks.data.label_list` of a list of examples or of a dataset (read column by column)."""
    if isinstance(examples, list):
        return label_list(examples, label_key)
    return label_list([{label_key: sorted(distinct_values(examples, label_key))}], label_key)


def check_split_labels(examples, label_key: str, labels: list[str], source: str) -> None:
    """:func:`~nlp_tricks.data.check_labels` of a split; a dataset whose labels are all known (read column by
    column) is not read row by row."""
    if not isinstance(examples, list):
        try:
            check_labels([{label_key: sorted(distinct_values(examples, label_key))}], label_key, labels, source)
            return
        except DataError:
            pass  # read row by row below, for the line of the first unknown label
    check_labels(examples, label_key, labels, source)


def labelled_splits(
    splits: dict[str, tuple[object, str]], label_key: str, data: DataArguments, labels: list[str] | None = None
):
    """``(labels, train_examples, eval_examples)``: the label list (``labels`` when given, else the labels of the
    whole training split, numbers in numeric order), every validation / test label checked against it (an unseen
    one is a ``file:line`` error), and the splits cut to ``--max_train_samples`` / ``--max_eval_samples``."""
    if labels is None:
        labels = labels_of(splits.get("all", splits["train"])[0], label_key)
    if len(labels) < 2:
        raise DataError(
            splits["train"][1], None, f"only one label ({labels[0]!r}) in the training data; a classifier needs two"
        )
    for split in ("validation", "test"):
        if split in splits:
            check_split_labels(splits[split][0], label_key, labels, splits[split][1])
    train = first_rows(splits["train"][0], data.max_train_samples)
    return labels, train, eval_splits(splits, data.max_eval_samples)


def map_options(data: DataArguments, desc: str) -> dict:
    """The keyword arguments of every tokenizing ``Dataset.map``: batched, ``--preprocessing_num_workers``
    processes, the datasets cache unless ``--overwrite_cache``, and a progress bar named ``desc``."""
    return {
        "batched": True,
        "num_proc": getattr(data, "preprocessing_num_workers", None),
        "load_from_cache_file": not getattr(data, "overwrite_cache", False),
        "desc": desc,
    }


def check_label_arguments(training_args, labels: list[str]) -> None:
    """Arguments that depend on the labels (``--focal_alpha``, ``--class_weights``, ``--crf_bio_constraints``)
    checked before any model loads: one line if wrong."""
    if getattr(training_args, "focal_alpha", None) is not None:
        try:
            focal_alpha_weights(training_args.focal_alpha, labels)
        except ValueError as err:
            raise DataError(None, None, f"--focal_alpha: {err}") from err
    weights = getattr(training_args, "class_weights", None)
    if isinstance(weights, list) and len(weights) != len(labels):
        order = ", ".join(f"{i}={name}" for i, name in enumerate(labels))
        raise DataError(
            None,
            None,
            f"--class_weights: {len(weights)} weights for {len(labels)} classes; give one per class in this order: "
            f"{order} (or 'balanced')",
        )
    if getattr(training_args, "crf_bio_constraints", False):
        try:
            bio_constraints(labels)
        except ValueError as err:
            raise DataError(None, None, f"--crf_bio_constraints: {err}") from err


def data_record(splits: dict[str, tuple[list[dict], str]], labels: list[str] | None = None) -> dict:
    """What ``all_results.json`` records about the data: each split's source (file, demo or Hub split) and the
    label list in id order (``labels[i]`` is class ``i``)."""
    record = {"data_files": {split: source for split, (_, source) in splits.items() if split != "all"}}
    if labels is not None:
        record["label_list"] = list(labels)
    return record
