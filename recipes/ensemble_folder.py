"""A k-fold ensemble folder (written by ``recipes/kfold.py``) that predicts like one model through the recipes.

    python recipes/ner.py --model_name_or_path outputs/kfold_ner --do_train false --test_file new.conll
    python recipes/classification.py --model_name_or_path outputs/kfold_cls --do_train false \\
        --train_file train.csv --test_file new.csv --output_dir outputs/predicted

The folder holds its fold models (``fold0/`` ...) and a small manifest, ``kfold_ensemble.json``, naming them, the
label list and the rule that combines them (``nlp_tricks.ensemble``):

- classification: the mean of the members' class probabilities; the prediction is its argmax
  (``test_probabilities.npy`` holds the mean, float32, columns in the label order);
- NER: per word (its first sub-token's logits, so members with different tokenizers agree on the words), the mean
  of the members' softmax probabilities; members with a CRF: their mean word emissions and mean start / transition /
  end scores, decoded once by Viterbi; with ``--ensemble_vote T`` at k-fold time: the entities at least a share T of
  the members predict.
- NER with a span head (``--span_head``): per span of words and type, the mean of the members' raw span scores
  (word-level, first sub-tokens), decoded once as the members were trained (every span with mean score > 0, or with
  ``span_flat`` the non-overlapping set with the highest total); ``--ensemble_vote T`` votes on their spans.

Each member is loaded with its own tokenizer and predicts each split in turn (one model in memory at a time), with
the recipe's collator and ``--per_device_eval_batch_size``, so a member predicts exactly what it predicts alone. The
output folder gets ``test_predictions.*`` in the recipe's format and ``all_results.json`` with the ``eval_`` /
``test_`` metrics of the ensemble (recomputed from those predictions).
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from nlp_tricks.data import DataError
from nlp_tricks.ensemble import (
    crf_marginals,
    mean_crf,
    mean_probabilities,
    mean_span_scores,
    mean_word_probabilities,
    softmax,
    tag_scheme,
    viterbi,
    vote_entities,
    vote_spans,
)

MANIFEST = "kfold_ensemble.json"
MANIFEST_KIND = "nlp_tricks k-fold ensemble"


# ---- The manifest -------------------------------------------------------------------------------------------------


def is_ensemble_folder(path: str | Path | None) -> bool:
    """Whether ``path`` is a folder holding a k-fold ensemble manifest (``kfold_ensemble.json``)."""
    return bool(path) and (Path(path) / MANIFEST).is_file()


def write_manifest(folder: Path, recipe: str, members: list[str], labels: list[str], vote: float | None) -> None:
    """The manifest of an ensemble folder: its recipe, its members (folders relative to it), labels and rule."""
    from common import write_json_atomic

    write_json_atomic(
        folder / MANIFEST,
        {
            "kind": MANIFEST_KIND,
            "recipe": recipe,
            "members": members,
            "labels": list(labels),
            "ensemble_vote": vote,
        },
    )


def read_manifest(folder: str | Path, recipe: str) -> dict:
    """The manifest of ``folder``, checked: the recipe it was trained with, every member folder present."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(path, None, f"cannot read the ensemble manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise DataError(path, None, f'not a k-fold ensemble manifest (no "kind": {MANIFEST_KIND!r})')
    for key in ("recipe", "members", "labels"):
        if key not in manifest:
            raise DataError(path, None, f"the manifest has no {key!r}")
    if manifest["recipe"] != recipe:
        raise DataError(
            path, None, f"an ensemble of the {manifest['recipe']} recipe; predict with recipes/{manifest['recipe']}.py"
        )
    if not manifest["members"]:
        raise DataError(path, None, "the manifest names no members")
    for member in manifest["members"]:
        if not (Path(folder) / member / "config.json").is_file():
            raise DataError(path, None, f"member {member!r}: no model in {Path(folder) / member}")
    return manifest


# ---- What one member predicts -------------------------------------------------------------------------------------


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


def prediction_args(training_args, output_dir: str | Path):
    """A copy of the recipe's arguments for prediction only: no signal handlers, nothing saved."""
    from transformers import IntervalStrategy

    args = copy.deepcopy(training_args)
    args.output_dir = str(output_dir)
    args.enable_jit_checkpoint = False
    args.eval_strategy = IntervalStrategy.NO
    args.load_best_model_at_end = False
    return args


def _predict(model, tokenizer, dataset, collator, args):
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


# ---- Tasks --------------------------------------------------------------------------------------------------------


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

    # Per task: load_splits, load_member, predict, combine, member_predictions, soft_targets, write, score, read.


class NerEnsembleTask(EnsembleTask):
    name = "ner"
    predictions_file = "test_predictions.txt"
    metrics = ("f1", "precision", "recall", "accuracy")
    label_key = "ner_tags"

    def parse_options(self) -> dict:
        from common import saved_crf_defaults

        recipe = self.recipe
        return {
            # As the recipe parses them: a saved span model keeps its span settings, a saved CRF model its CRF.
            "dependent_defaults": [
                recipe.saved_span_defaults("model_name_or_path"),
                saved_crf_defaults("model_name_or_path"),
            ],
            "evidence_defaults": recipe.EVIDENCE_DEFAULTS,
        }

    def load_splits(self, data_args):
        return self.recipe.load_ner_splits(data_args)

    def check_splits(self, splits: dict, labels: list[str], data_args) -> None:
        """The recipe's checks: the tag scheme resolved (into ``data_args.tag_scheme``), every tag known."""
        self.recipe.check_ner_splits(splits, data_args, labels)

    def load_member(self, folder: Path, model_args, labels: list[str]):
        from transformers import AutoModelForTokenClassification

        from common import load_classifier

        member_args = dataclasses.replace(model_args, tokenizer_name=None, ignore_mismatched_sizes=False)
        model, tokenizer, config = load_classifier(AutoModelForTokenClassification, member_args, labels, str(folder))
        self.recipe.prepare_ner_tokenizer(config, tokenizer)
        return model, tokenizer

    def predict(self, model, tokenizer, examples: list[dict], labels: list[str], data_args, args) -> MemberOutput:
        """Each word's first sub-token's logits (the recipe's scoring positions) and the member's CRF scores."""
        from transformers import DataCollatorForTokenClassification

        recipe = self.recipe
        label2id = {label: i for i, label in enumerate(labels)}
        # Examples without tags (unlabelled text) get a placeholder tag: it only marks the first sub-tokens.
        rows = [ex if "ner_tags" in ex else {**ex, "ner_tags": [labels[0]] * len(ex["tokens"])} for ex in examples]
        eval_set = recipe.ner_eval_set(rows, tokenizer, label2id, data_args.max_seq_length, data_args)
        word_logits = []
        if rows:
            collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
            logits, label_ids = _predict(model, tokenizer, eval_set.dataset, collator, args)
            for i, ex in enumerate(rows):
                positions = np.flatnonzero(np.asarray(label_ids[i]) != -100)
                seen = eval_set.seen_words[i]
                if len(positions) != len(seen):
                    raise RuntimeError(f"sentence {i}: {len(positions)} labelled tokens for {len(seen)} seen words")
                out = np.full((len(ex["tokens"]), logits.shape[-1]), np.nan, dtype=np.float32)
                out[seen] = np.asarray(logits[i])[positions]
                word_logits.append(out)
        crf = getattr(model, "crf", None)
        potentials = None if crf is None else tuple(p.detach().float().cpu().numpy() for p in crf.potentials())
        return MemberOutput(word_logits=word_logits, potentials=potentials)

    @staticmethod
    def _check_crfs(outputs: list[MemberOutput]) -> bool:
        with_crf = {o.potentials is not None for o in outputs}
        if len(with_crf) != 1:
            raise DataError(None, None, "the ensemble mixes members with and without a CRF; train them alike")
        return with_crf.pop()

    def member_ids(self, output: MemberOutput) -> list[list[int | None]]:
        """One member's own tag ids per word (its Viterbi path with a CRF, else the argmax; None: an unseen word)."""
        return self.combine_ids([output])

    def combine_ids(self, outputs: list[MemberOutput]) -> list[list[int | None]]:
        """The ensemble's tag ids per word by averaging: the Viterbi path of the mean CRF, or the argmax of the mean
        word probabilities; None for a word no member saw."""
        crf = self._check_crfs(outputs)
        out = []
        for i in range(len(outputs[0].word_logits)):
            members = [o.word_logits[i] for o in outputs]
            if crf:
                emissions, start, transitions, end = mean_crf(members, [o.potentials for o in outputs])
                out.append(viterbi(emissions, start, transitions, end))
            else:
                probabilities = mean_word_probabilities(members)
                seen = ~np.isnan(probabilities).any(axis=-1)
                out.append([int(np.argmax(row)) if s else None for row, s in zip(probabilities, seen)])
        return out

    def member_predictions(self, output: MemberOutput, labels: list[str]) -> list[list[str]]:
        return self._tags(self.member_ids(output), labels)

    def combine(self, outputs: list[MemberOutput], labels: list[str], vote: float | None = None) -> list[list[str]]:
        """The ensemble's tags per word (an unseen word: ``O``): averaged, or by entity vote with ``vote``."""
        if vote is None:
            return self._tags(self.combine_ids(outputs), labels)
        scheme = tag_scheme(labels)
        members = [self.member_predictions(o, labels) for o in outputs]
        return [vote_entities([m[i] for m in members], vote, scheme) for i in range(len(members[0]))]

    @staticmethod
    def _tags(ids: list[list[int | None]], labels: list[str]) -> list[list[str]]:
        return [["O" if y is None else labels[y] for y in sentence] for sentence in ids]

    def soft_targets(self, outputs: list[MemberOutput]) -> list[np.ndarray]:
        """Per sentence ``(W, C)``: each word's tag distribution under the ensemble, the student's soft target: the
        mean CRF's marginals (forward-backward), or the mean word probabilities; NaN rows for unseen words."""
        crf = self._check_crfs(outputs)
        out = []
        for i in range(len(outputs[0].word_logits)):
            members = [o.word_logits[i] for o in outputs]
            if crf:
                out.append(crf_marginals(*mean_crf(members, [o.potentials for o in outputs])))
            else:
                out.append(mean_word_probabilities(members))
        return out

    def write(self, path: Path, examples: list[dict], predictions: list[list[str]], data_args) -> None:
        """The recipe's ``test_predictions.txt``: gold tags as read, predictions in the run's tag scheme."""
        self.recipe.write_predictions(path, SimpleNamespace(examples=examples), predictions, data_args.tag_scheme)

    def score(self, gold: list[list[str]], predicted: list[list[str]], labels: list[str], data_args=None) -> dict:
        """The recipe's metrics (exact-span entity P / R / F1, word accuracy; per entity type) of predictions as
        written (in the run's tag scheme: those of ``data_args``, else as given, e.g. read back from a file)."""
        return self.recipe.ner_scores(gold, predicted, None if data_args is None else data_args.tag_scheme)

    def gold(self, examples: list[dict]) -> list[list[str]]:
        return [list(ex["ner_tags"]) for ex in examples]

    def read(self, path: Path) -> tuple[list, list]:
        """``(gold, predicted)`` of a predictions file, per sentence."""
        import evidence

        sentences = evidence.read_ner_predictions(path)
        return [g for g, _ in sentences], [p for _, p in sentences]


class NerSpanEnsembleTask(NerEnsembleTask):
    """NER members with a span head (``--span_head``): their word-level span scores averaged, decoded once.

    Args:
        flat (`bool`): whether the members decode flat entities (``span_flat``, as they were trained); every member
            must say the same.
    """

    predictions_file = "test_predictions.jsonl"
    metrics = ("f1", "precision", "recall")
    label_key = "entities"

    def __init__(self, flat: bool):
        self.flat = bool(flat)

    def load_splits(self, data_args):
        return self.recipe.load_span_splits(data_args)

    def check_splits(self, splits: dict, labels: list[str], data_args) -> None:
        self.recipe.resolve_span_scheme(data_args)  # the scheme of --span_flat's test_predictions.txt
        EnsembleTask.check_splits(self, splits, labels, data_args)

    def check_labels(self, examples, labels: list[str], source: str) -> None:
        from nlp_tricks.data.spans import check_entity_types

        check_entity_types(examples, labels, source, "the ensemble's types")

    def load_member(self, folder: Path, model_args, labels: list[str]):
        """A member saved with its span head (``load_span_model``), checked: its types and its decoding are the
        ensemble's."""
        recipe = self.recipe
        saved = recipe.saved_span_head(str(folder))
        if saved is None:
            raise DataError(folder, None, "not a span model (no span_head in its config.json); train members alike")
        if bool(saved.get("span_flat", False)) != self.flat:
            raise DataError(
                folder,
                None,
                f"span_flat={bool(saved.get('span_flat', False))}, the other members {self.flat}; train members alike",
            )
        member_args = dataclasses.replace(model_args, model_name_or_path=str(folder), tokenizer_name=None)
        types = recipe.saved_types(member_args)
        if types != list(labels):
            raise DataError(folder, None, f"its entity types {types} are not the ensemble's {list(labels)}")
        return recipe.load_span_classifier(member_args, types)

    def predict(self, model, tokenizer, examples: list[dict], labels: list[str], data_args, args) -> MemberOutput:
        """Each sentence's ``(T, W, W)`` span scores over its own words (NaN where the member cannot see a word)."""
        recipe = self.recipe
        # Sentences without entities (unlabelled text) get none: the label rows then only mark the first sub-tokens.
        rows = [ex if "entities" in ex else {**ex, "entities": []} for ex in examples]
        eval_set, most_words = recipe.span_eval_set(rows, tokenizer, labels, data_args)
        recipe.check_span_length(most_words, args, data_args)
        blocks = _span_scores(model, tokenizer, eval_set.dataset, args) if rows else []
        out = []
        for ex, seen, block in zip(rows, eval_set.seen_words, blocks):
            if block.shape[1] != len(seen):
                raise RuntimeError(f"{block.shape[1]} scored words for {len(seen)} seen words")
            words = len(ex["tokens"])
            scores = np.full((len(labels), words, words), np.nan, dtype=np.float32)
            index = np.asarray(seen, dtype=np.int64)
            scores[:, index[:, None], index[None, :]] = block
            out.append(scores)
        return MemberOutput(span_scores=out)

    def _decode(self, scores: np.ndarray, labels: list[str]) -> list[tuple[str, int, int]]:
        import torch

        from nlp_tricks.functional.spans import decode_spans

        values = torch.from_numpy(np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf))
        return [(labels[t], start, end) for t, start, end in decode_spans(values[None], flat=self.flat)[0]]

    def member_predictions(self, output: MemberOutput, labels: list[str]) -> list[list[tuple[str, int, int]]]:
        """One member's own entities per sentence, decoded as it decodes them alone."""
        return [self._decode(scores, labels) for scores in output.span_scores]

    def combine(self, outputs: list[MemberOutput], labels: list[str], vote: float | None = None) -> list[list]:
        """The ensemble's entities per sentence: the mean span scores decoded once, or by span vote with ``vote``."""
        if vote is not None:
            members = [self.member_predictions(o, labels) for o in outputs]
            return [vote_spans([m[i] for m in members], vote, self.flat) for i in range(len(members[0]))]
        return [
            self._decode(mean_span_scores([o.span_scores[i] for o in outputs]), labels)
            for i in range(len(outputs[0].span_scores))
        ]

    def soft_targets(self, outputs: list[MemberOutput]) -> list[np.ndarray]:
        raise NotImplementedError("span heads take no soft targets (teacher_logits)")

    def write(self, path: Path, examples: list[dict], predictions: list[list], data_args) -> None:
        """The span recipe's files: ``<name>.jsonl`` and, flat, ``<name>.txt`` (IOB2 tags)."""
        path = Path(path)
        examples, scheme = SimpleNamespace(examples=examples), data_args.tag_scheme
        self.recipe.write_span_predictions(path.parent, examples, predictions, self.flat, path.stem, scheme)

    def score(self, gold: list[list], predicted: list[list], labels: list[str], data_args=None) -> dict[str, float]:
        """The span recipe's metrics (exact-span P / R / F1, micro and per type)."""
        from nlp_tricks.metrics.spans import span_f1

        scores = span_f1(predicted, gold)
        return {
            **{key: float(scores[key]) for key in ("precision", "recall", "f1")},
            **self.recipe.entity_scores(scores),
        }

    def gold(self, examples: list[dict]) -> list[list[tuple[str, int, int]]]:
        return [[(e["type"], e["start"], e["end"]) for e in ex["entities"]] for ex in examples]

    def read(self, path: Path) -> tuple[list, list]:
        """``(gold, predicted)`` spans of a ``.jsonl`` predictions file, per sentence."""
        records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        spans = [
            [[(e["type"], e["start"], e["end"]) for e in r[key]] for r in records]
            for key in ("gold_entities", "entities")
        ]
        return spans[0], spans[1]


def _span_scores(model, tokenizer, dataset, args) -> list[np.ndarray]:
    """Per sentence of ``dataset`` (span label rows marking its words), its ``(T, n, n)`` span scores over its ``n``
    seen words, float32: the span head's own ``span_scores``, batch by batch with the recipe's collator and
    ``--per_device_eval_batch_size``, in the recipe's autocast. Every process predicts the whole split (scores of
    sentences of any length are kept as they are, never padded to the longest)."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import Trainer

    from nlp_tricks.data.spans import SpanCollator
    from nlp_tricks.functional.outputs import output_logits
    from nlp_tricks.functional.spans import span_scores, word_positions_of

    collator = SpanCollator(tokenizer, pad_to_multiple_of=8)
    trainer = Trainer(model=model, args=args, data_collator=collator, processing_class=tokenizer)
    model = trainer.model.to(args.device).eval()
    loader = DataLoader(dataset, batch_size=args.eval_batch_size, collate_fn=collator, shuffle=False)
    out = []
    for batch in loader:
        labels = batch.pop("labels").to(args.device)
        inputs = {key: value.to(args.device) for key, value in batch.items()}
        with torch.no_grad(), trainer.compute_loss_context_manager():
            logits = output_logits(model(**inputs))
            positions = word_positions_of(labels)
            scores = span_scores(model, logits, positions).float().cpu()
        for b, n in enumerate((positions >= 0).sum(dim=1).tolist()):
            out.append(scores[b, :, :n, :n].numpy())
    return out


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
        from transformers import AutoModelForSequenceClassification

        from common import load_classifier

        member_args = dataclasses.replace(model_args, tokenizer_name=None, ignore_mismatched_sizes=False)
        model, tokenizer, _ = load_classifier(AutoModelForSequenceClassification, member_args, labels, str(folder))
        return model, tokenizer

    def predict(self, model, tokenizer, examples: list[dict], labels: list[str], data_args, args) -> MemberOutput:
        from transformers import DataCollatorWithPadding

        label2id = {label: i for i, label in enumerate(labels)}
        if not examples:
            return MemberOutput(logits=np.zeros((0, len(labels)), dtype=np.float32))
        rows = [ex if "label" in ex else {**ex, "label": labels[0]} for ex in examples]  # placeholder, never scored
        dataset = self.recipe.tokenize_classification(
            rows, tokenizer, label2id, data_args.max_seq_length, data=data_args
        )
        collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
        logits, _ = _predict(model, tokenizer, dataset, collator, args)
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


TASKS: dict[str, EnsembleTask] = {"ner": NerEnsembleTask(), "classification": ClassificationEnsembleTask()}


def task_of_members(recipe: str, folder: str | Path, members: list[str]) -> EnsembleTask:
    """The task that combines an ensemble folder's members: the recipe's, or for NER members saved with a span head
    :class:`NerSpanEnsembleTask` decoding as they do; members of both kinds, or flat and nested, are refused."""
    task = TASKS[recipe]
    if recipe != "ner":
        return task
    saved = [task.recipe.saved_span_head(str(Path(folder) / member)) for member in members]
    if all(settings is None for settings in saved):
        return task
    manifest = Path(folder) / MANIFEST
    if any(settings is None for settings in saved):
        raise DataError(manifest, None, "the ensemble mixes members with and without a span head; train them alike")
    flats = {bool(settings.get("span_flat", False)) for settings in saved}
    if len(flats) != 1:
        raise DataError(
            manifest, None, "the ensemble mixes span members that decode flat (span_flat) and nested; train them alike"
        )
    return NerSpanEnsembleTask(flats.pop())


def predict_members(
    task: EnsembleTask,
    folders: list[Path],
    splits: dict[str, list[dict]],
    labels: list[str],
    data_args,
    model_args,
    args,
    seconds: dict[str, float] | None = None,
) -> dict[str, list[MemberOutput]]:
    """``{split: [one MemberOutput per member]}``: each member loaded in turn (one in memory at a time) and run on
    every split; ``seconds[split]`` (when given) adds up the time spent predicting each split."""
    import gc

    out: dict[str, list[MemberOutput]] = {split: [] for split in splits}
    for folder in folders:
        model, tokenizer = task.load_member(folder, model_args, labels)
        for split, examples in splits.items():
            start = time.perf_counter()
            out[split].append(task.predict(model, tokenizer, examples, labels, data_args, args))
            if seconds is not None:
                seconds[split] = seconds.get(split, 0.0) + time.perf_counter() - start
        del model
        gc.collect()
    return out


def rescore(task: EnsembleTask, path: Path, labels: list[str]) -> dict[str, float]:
    """The task's metrics of a predictions file, read back: gold and predicted as written."""
    gold, predicted = task.read(path)
    return task.score(gold, predicted, labels)


# ---- The recipes' entry point -------------------------------------------------------------------------------------


def _model_flag(argv: list[str]) -> str | None:
    """The value of ``--model_name_or_path`` on a command line (the last one wins, as argparse reads it), or in the
    YAML / JSON config file given first."""
    value = None
    if argv and argv[0].endswith((".yaml", ".yml", ".json")) and Path(argv[0]).is_file():
        try:
            import yaml

            config = yaml.safe_load(Path(argv[0]).read_text(encoding="utf-8"))
            if isinstance(config, dict) and isinstance(config.get("model_name_or_path"), str):
                value = config["model_name_or_path"]
        except Exception:  # the recipe's own parser reports an unreadable config file
            pass
    for i, arg in enumerate(argv):
        if arg == "--model_name_or_path" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--model_name_or_path="):
            value = arg.split("=", 1)[1]
    return value


def predict_with_ensemble(recipe: str, argv: list[str] | None = None) -> bool:
    """Run the recipe's prediction with the ensemble when ``--model_name_or_path`` names an ensemble folder; return
    whether it did (False: a plain model, the recipe goes on as usual).

    Writes ``test_predictions.*`` (the ensemble's), classification ``test_probabilities.npy`` (the mean of the
    members' probabilities), and ``all_results.json`` with the ensemble's ``eval_`` / ``test_`` metrics recomputed
    from its predictions, into ``--output_dir``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    folder = _model_flag(argv)
    if not is_ensemble_folder(folder):
        return False
    from common import is_main_process, prepare_output_dir, write_json_atomic

    task = TASKS[recipe]
    data_args, model_args, training_args = task.parse(argv, predict_only=True)
    if training_args.do_train:
        raise DataError(
            None, None, f"--model_name_or_path {folder} is a k-fold ensemble: it predicts; add --do_train false"
        )
    if getattr(data_args, "multi_label", False):
        raise DataError(
            None, None, f"--model_name_or_path {folder}: a single-label k-fold ensemble; drop --multi_label"
        )
    manifest = read_manifest(folder, recipe)
    task = task_of_members(recipe, folder, manifest["members"])
    labels = manifest["labels"]
    out = Path(training_args.output_dir)
    prepare_output_dir(out, data_args.overwrite_output_dir, reads=(folder,))
    splits, sources = task.read_eval_splits(data_args, labels)
    if not splits:
        raise DataError(None, None, "nothing to predict: give --test_file (or --validation_file)")
    folders = [Path(folder) / member for member in manifest["members"]]
    outputs = predict_members(
        task, folders, splits, labels, data_args, model_args, prediction_args(training_args, out)
    )
    if not is_main_process():
        return True
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for split, examples in splits.items():
        predictions = task.combine(outputs[split], labels, manifest.get("ensemble_vote"))
        prefix = "eval" if split == "validation" else "test"
        if split == "test":
            task.write(out / task.predictions_file, examples, predictions, data_args)
            if recipe == "classification":
                np.save(out / "test_probabilities.npy", task.probabilities(outputs[split]))
        scores = task.score(task.gold(examples), predictions, labels, data_args)
        results.update({f"{prefix}_{key}": value for key, value in scores.items()})
        results[f"{prefix}_samples"] = len(examples)
    results.update(
        {
            "data_files": sources,
            "label_list": labels,
            "ensemble": {
                "folder": str(folder),
                "members": manifest["members"],
                "ensemble_vote": manifest.get("ensemble_vote"),
            },
        }
    )
    write_json_atomic(out / "all_results.json", results)
    shown = [f"{prefix}_{key}" for prefix in ("eval", "test") for key in task.metrics]
    print(f"[ensemble] {len(folders)} members: " + ", ".join(f"{k} {results[k]:.4f}" for k in shown if k in results))
    return True
