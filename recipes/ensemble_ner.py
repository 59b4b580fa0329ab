"""NER's k-fold ensembles: word-level probabilities or CRF scores (:class:`NerEnsembleTask`), and a span head's
span scores (:class:`NerSpanEnsembleTask`), each combined across members and decoded once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from nlp_tricks.data import DataError
from nlp_tricks.ensemble import (
    crf_marginals,
    mean_crf,
    mean_span_scores,
    mean_word_probabilities,
    tag_scheme,
    viterbi,
    vote_entities,
    vote_spans,
)

from ensemble_tasks import EnsembleTask, MemberOutput, check_member_labels, member_logits


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
            "evidence_unless": "teacher",
        }

    def load_splits(self, data_args):
        return self.recipe.load_ner_splits(data_args)

    def check_splits(self, splits: dict, labels: list[str], data_args) -> None:
        """The recipe's checks: the tag scheme resolved (into ``data_args.tag_scheme``), every tag known."""
        self.recipe.check_ner_splits(splits, data_args, labels)

    def load_member(self, folder: Path, model_args, labels: list[str]):
        from transformers import AutoModelForTokenClassification

        from common import load_classifier

        check_member_labels(folder, labels)
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
            logits, label_ids = member_logits(model, tokenizer, eval_set.dataset, collator, args)
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
