"""What the k-fold ensembles need of a recipe (:class:`EnsembleTask`): parsing, reading, one member's predictions
(:class:`MemberOutput`), the rule that combines members, the predictions file and its scores; classification's here,
NER's in recipes/ensemble_ner.py, the ensemble folder itself in recipes/ensemble_folder.py."""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nlp_tricks.ensemble import mean_probabilities, softmax


@dataclass
class MemberOutput:
    """What one member predicted for one list of examples.

    Attributes:
        logits (`np.ndarray`, *optional*): classification, ``(N, C)`` float32.
        word_logits (`list[np.ndarray]`, *optional*): NER, per sentence ``(W, C)`` float32: each word's first
            sub-token's logits (its CRF emissions), NaN rows for the words the member could not see.
        potentials (`tuple`, *optional*): NER with a CRF, its ``(start, transitions, end)`` scores.
        span_scores (`list[np.ndarray]`, *optional*): NER with a span head, per sentence ``(T, W, W)`` float32 over
            its own words: ``[t, i, j]`` the raw score of words ``i..j`` as type ``t``, ``-inf`` below the diagonal,
            NaN where the member could not see word ``i`` or ``j``.
    """

    logits: np.ndarray | None = None
    word_logits: list[np.ndarray] | None = None
    potentials: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    span_scores: list[np.ndarray] | None = None


def member_logits(model, tokenizer, dataset, collator, args):
    """The raw logits and label ids of ``dataset`` by upstream ``Trainer.predict`` (no trick changes them: a CRF's
    emissions stay emissions), with the recipe's collator and batch size, on every process of the job."""
    from transformers import Trainer

    from common import own_rows

    trainer = Trainer(model=model, args=args, data_collator=collator, processing_class=tokenizer)
    output = trainer.predict(dataset, metric_key_prefix="ensemble")
    n = len(dataset)
    predictions = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
    labels = None if output.label_ids is None else own_rows(output.label_ids, n)
    return own_rows(predictions, n), labels


def check_member_labels(folder: Path, labels: list[str]) -> None:
    """Refuse a member whose saved labels (``config.json``'s ``id2label``, in id order) are not the ensemble's:
    loading it over the ensemble's labels would rename its outputs. One ``DataError`` line naming the member and
    both label lists."""
    import json

    from nlp_tricks.data import DataError

    path = Path(folder) / "config.json"
    if not path.is_file() and (Path(folder) / "adapter_config.json").is_file():
        # A LoRA adapter (--merge_lora false): its head's labels are the run's label_list in all_results.json.
        path = Path(folder) / "all_results.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(path, None, f"cannot read the member's {path.name} ({err})") from None
    saved = record.get("id2label") if path.name == "config.json" else dict(enumerate(record.get("label_list") or []))
    if not saved:
        return  # no labels saved: nothing to contradict (the ensemble's are given to it)
    ordered = [saved[key] for key in sorted(saved, key=int)]
    if ordered != list(labels):
        raise DataError(path, None, f"member {Path(folder).name}: its labels {ordered} are not the ensemble's "
                        f"{list(labels)}; train every member over the same labels")  # fmt: skip


def _predict_only(data_cls):
    """``data_cls`` without its "validation_file / test_file need a train_file" check: an ensemble predicts files
    without training data."""

    def __post_init__(self):
        train_file = self.train_file
        if train_file is None and (self.validation_file or self.test_file):
            self.train_file = self.validation_file or self.test_file
        data_cls.__post_init__(self)
        self.train_file = train_file

    return type(data_cls.__name__, (data_cls,), {"__post_init__": __post_init__, "__module__": data_cls.__module__})


class EnsembleTask:
    """What the ensemble and the k-fold runner need of a recipe: parsing, reading, one member's predictions, the
    rule that combines members, the predictions file and its scores."""

    name: str
    predictions_file: str
    metrics: tuple[str, ...]
    label_key: str

    @property
    def recipe(self):
        import importlib

        return importlib.import_module(self.name)

    def parse(self, argv: list[str], predict_only: bool = False):
        """``(data_args, model_args, training_args)`` of recipe flags, as the recipe parses them."""
        from common import parse_recipe_args

        recipe = self.recipe
        types = list(recipe.RECIPE_ARGUMENT_TYPES)
        if predict_only:
            types[0] = _predict_only(types[0])
        return parse_recipe_args(
            tuple(types),
            self.name,
            recipe.RECIPE_DEFAULTS,
            argv=argv,
            description=recipe.__doc__,
            **self.parse_options(),
        )

    def parse_options(self) -> dict:
        return {}

    def read_eval_splits(self, data_args, labels: list[str]) -> tuple[dict[str, list[dict]], dict[str, str]]:
        """``({split: examples}, {split: source})`` of validation and test: the files given (no training file is
        needed), else the recipe's own split of its data; every gold label checked against ``labels``."""
        from common import eval_splits

        files = {s: getattr(data_args, f"{s}_file") for s in ("validation", "test") if getattr(data_args, f"{s}_file")}
        if data_args.train_file is None and files:
            splits = {}
            for split, path in files.items():
                # The recipe's reader of a validation file, for any one file (train is the same file: no split).
                one = dataclasses.replace(data_args, train_file=path, validation_file=path, test_file=None)
                splits[split] = (self.load_splits(one)["validation"][0], path)
        else:
            splits = self.load_splits(data_args)
        self.check_splits(splits, labels, data_args)
        examples = {split: list(rows) for split, rows in eval_splits(splits, data_args.max_eval_samples).items()}
        return examples, {split: splits[split][1] for split in examples}

    def check_splits(self, splits: dict, labels: list[str], data_args) -> None:
        """Refuse a gold label of validation or test outside ``labels`` (one ``file:line`` error)."""
        for split in ("validation", "test"):
            if split in splits:
                self.check_labels(splits[split][0], labels, splits[split][1])

    def check_labels(self, examples, labels: list[str], source: str) -> None:
        """Refuse a gold label outside ``labels`` (one ``file:line`` error)."""
        from common import check_split_labels

        check_split_labels(examples, self.label_key, labels, source)


class ClassificationEnsembleTask(EnsembleTask):
    name = "classification"
    predictions_file = "test_predictions.csv"
    metrics = ("accuracy", "f1")
    label_key = "label"

    def parse_options(self) -> dict:
        return {"evidence_defaults": self.recipe.EVIDENCE_DEFAULTS, "evidence_unless": "multi_label"}

    def load_splits(self, data_args):
        return self.recipe.load_classification_splits(data_args)

    def load_member(self, folder: Path, model_args, labels: list[str]):
        from classification_heads import load_member

        check_member_labels(folder, labels)
        return load_member(folder, model_args, labels)

    def predict(self, model, tokenizer, examples: list[dict], labels: list[str], data_args, args) -> MemberOutput:
        from classification_heads import member_inputs

        if not examples:
            return MemberOutput(logits=np.zeros((0, len(labels)), dtype=np.float32))
        rows = [ex if "label" in ex else {**ex, "label": labels[0]} for ex in examples]  # placeholder, never scored
        # The member's own prompt (a label-token member), --truncation_side, --pair_swap_predict.
        dataset, collator, args = member_inputs(self.recipe, model, tokenizer, rows, labels, data_args, args)
        logits, _ = member_logits(model, tokenizer, dataset, collator, args)
        return MemberOutput(logits=np.asarray(logits, dtype=np.float32))

    @staticmethod
    def probabilities(outputs: list[MemberOutput]) -> np.ndarray:
        """``(N, C)`` float32: the mean of the members' softmax probabilities (one member: its own)."""
        return mean_probabilities([softmax(o.logits) for o in outputs]).astype(np.float32)

    def combine(self, outputs: list[MemberOutput], labels: list[str], vote: float | None = None) -> list[str]:
        """The argmax of :meth:`probabilities` (as written to ``test_probabilities.npy``)."""
        return [labels[int(j)] for j in self.probabilities(outputs).argmax(axis=-1)]

    def member_predictions(self, output: MemberOutput, labels: list[str]) -> list[str]:
        return self.combine([output], labels)

    def soft_targets(self, outputs: list[MemberOutput]) -> list[np.ndarray]:
        return list(self.probabilities(outputs))

    def write(self, path: Path, examples: list[dict], predictions: list[str], data_args) -> None:
        labels = sorted(set(predictions))
        index = {label: i for i, label in enumerate(labels)}
        self.recipe.write_predictions(
            path, examples, [index[p] for p in predictions], dict(enumerate(labels)), data_args.label_delimiter
        )

    def score(self, gold: list[str], predicted: list[str], labels: list[str], data_args=None) -> dict[str, float]:
        """The recipe's metrics (accuracy, macro-F1 over every label)."""
        from nlp_tricks.metrics import load_metric

        label2id = {label: i for i, label in enumerate(labels)}
        scores = load_metric("accuracy_f1").compute(
            predictions=[label2id[p] for p in predicted],
            references=[label2id[g] for g in gold],
            labels=list(range(len(labels))),
        )
        return {key: float(value) for key, value in scores.items()}

    def gold(self, examples: list[dict]) -> list[str]:
        return [ex["label"] for ex in examples]

    def read(self, path: Path) -> tuple[list, list]:
        with Path(path).open(encoding="utf-8", newline="") as f:
            records = [(r["label"], r["predicted"]) for r in csv.DictReader(f)]
        return [g for g, _ in records], [p for _, p in records]
