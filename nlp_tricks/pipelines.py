"""transformers' ``pipeline`` for models saved with a CRF, a span head or a pooling: they predict as they were
evaluated.

Such a folder is a transformers model plus weights its transformers class does not have (``crf.*``; the span head in
place of ``classifier``; ``pooling.*``) and a config entry naming them (``crf``, ``span_head``, ``pooling``).
Transformers' own ``AutoModelFor...`` classes drop those weights (or start a fresh head) and its pipelines predict by
the argmax of the logits. After ``import nlp_tricks``, transformers' ``"token-classification"`` (alias ``"ner"``) and
``"text-classification"`` tasks use the classes of this module (:func:`register`), which differ from transformers'
only for such models:

- a model saved with a CRF loads with it (:func:`~nlp_tricks.functional.crf.load_crf_model`) and each word's tag is the
  CRF's Viterbi path over the logits of the words' first sub-tokens (what the recipes predict); an item's ``score``
  is the CRF's marginal probability of its tag (forward-backward), the mean over an entity's words. The items are
  words, so ``aggregation_strategy`` only chooses the form: ``"none"`` gives one item per word (``entity``: its tag),
  any other the entities (``entity_group``), read from the tags as the recipes' metrics read them (seqeval's
  default mode, BIO / BIOES / BILOU).
- a model saved with a span head loads with it (:func:`~nlp_tricks.functional.spans.load_span_model`) and the
  entities are its spans (every span scoring above 0, nested ones included, or the best non-overlapping set when it
  was trained with ``span_flat``), as ``entity_group`` items whatever ``aggregation_strategy``; ``score`` is the
  sigmoid of the span's score (above 0.5 for every predicted span; not a calibrated probability).
- a model saved with a pooling loads with it (:func:`~nlp_tricks.functional.pooling.load_pooled_model`); prediction
  is transformers' own.

Words: with ``is_split_into_words=True``, the given words (as a data file splits them; the recipes' predictions are
over those); from a string, the words transformers' pipeline forms for ``aggregation_strategy="first"``.

A model whose config names one of these heads but that does not hold it (``AutoModelForTokenClassification`` loaded
it) is refused in one line when the pipeline is built, instead of predicting by its logits' argmax.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification
from transformers.pipelines import PIPELINE_REGISTRY
from transformers.pipelines.text_classification import TextClassificationPipeline
from transformers.pipelines.token_classification import AggregationStrategy, TokenClassificationPipeline

from .ensemble import crf_marginals, entity_spans
from .functional.crf import CRF, load_crf_model
from .functional.pooling import Pooling, load_pooled_model
from .functional.spans import SpanHead, decode_spans, load_span_model, span_head_of, span_scores

__all__ = [
    "AutoModelForTokenClassificationWithHeads",
    "AutoModelForSequenceClassificationWithHeads",
    "TokenClassificationPipelineWithHeads",
    "TextClassificationPipelineWithHeads",
    "check_head",
    "register",
]

# The keyword arguments of from_pretrained that reading the config needs too.
_CONFIG_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code", "_from_pipeline")


class _LoaderWithHeads:
    """``from_pretrained`` loads the model with the head its config records (``heads``: config attribute, loading
    function), else with ``auto_class``."""

    auto_class: type
    heads: tuple = ()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        config = kwargs.pop("config", None)
        if config is None:
            config_kwargs = {key: kwargs[key] for key in _CONFIG_KWARGS if key in kwargs}
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **config_kwargs)
        for attribute, load in cls.heads:
            if getattr(config, attribute, None) not in (None, False):
                return load(pretrained_model_name_or_path, config=config, **kwargs)
        return cls.auto_class.from_pretrained(pretrained_model_name_or_path, config=config, **kwargs)


class AutoModelForTokenClassificationWithHeads(_LoaderWithHeads):
    """A token classification model with its CRF (``config.crf``) or span head (``config.span_head``), else
    ``AutoModelForTokenClassification``'s model."""

    auto_class = AutoModelForTokenClassification
    heads = (("crf", load_crf_model), ("span_head", load_span_model))


class AutoModelForSequenceClassificationWithHeads(_LoaderWithHeads):
    """A sequence classification model with its pooling (``config.pooling``), else
    ``AutoModelForSequenceClassification``'s model."""

    auto_class = AutoModelForSequenceClassification
    heads = (("pooling", load_pooled_model),)


def _has_span_head(model) -> bool:
    try:
        return isinstance(span_head_of(model), SpanHead)
    except ValueError:
        return False


def check_head(model) -> None:
    """Refuse, in one line, a model whose config records a CRF, a span head or a pooling that it does not hold (a
    transformers Auto class loaded it without): its logits' argmax is not what it was trained to predict."""
    config = model.config
    if getattr(config, "crf", False) and not isinstance(getattr(model, "crf", None), CRF):
        saved, loader = "a CRF (config.crf)", "load_crf_model"
    elif getattr(config, "span_head", None) and not _has_span_head(model):
        saved, loader = f"a {config.span_head} span head (config.span_head)", "load_span_model"
    elif getattr(config, "pooling", None) and not isinstance(getattr(model, "pooling", None), Pooling):
        saved, loader = f"{config.pooling} pooling (config.pooling)", "load_pooled_model"
    else:
        return
    raise ValueError(
        f"{type(model).__name__} was saved with {saved} but loaded without it, so it would not predict as it was "
        f"trained: give pipeline(model=...) the folder after `import nlp_tricks`, or load it with "
        f"nlp_tricks.{loader}(folder)"
    )


def _class_names(supported_models) -> list[str]:
    if isinstance(supported_models, list):
        return supported_models
    values = supported_models.values()
    return [name for value in values for name in (value if isinstance(value, tuple) else (value,))]


class _WithHeads:
    """What both pipelines add to transformers' own when they are built."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_head(self.model)

    def check_model_type(self, supported_models):
        # The loaders above give a subclass of the transformers class (BertForTokenClassificationWithCRF): it is
        # supported as that class is, without transformers' error listing every supported class.
        names = _class_names(supported_models)
        if not any(cls.__name__ in names for cls in type(self.model).__mro__):
            super().check_model_type(supported_models)


class TextClassificationPipelineWithHeads(_WithHeads, TextClassificationPipeline):
    """transformers' text classification pipeline; a model saved with a pooling loads with it, a model that lost
    its pooling is refused."""


class TokenClassificationPipelineWithHeads(_WithHeads, TokenClassificationPipeline):
    """transformers' token classification pipeline, decoding a model's CRF (Viterbi over words) or span head (its
    spans) as the recipes do; any other model exactly as transformers does."""

    def postprocess(self, all_outputs, aggregation_strategy=AggregationStrategy.NONE, ignore_labels=None):
        if isinstance(getattr(self.model, "crf", None), CRF):
            decode = self._crf_items
        elif _has_span_head(self.model):
            decode = self._span_items
        else:
            return super().postprocess(all_outputs, aggregation_strategy, ignore_labels)
        ignore_labels = ["O"] if ignore_labels is None else ignore_labels
        items = []
        for outputs in all_outputs:
            words = self._words(outputs, all_outputs[0])
            decoded = decode(outputs["logits"], words, aggregation_strategy) if words else []
            items += [item for item in decoded if item.get("entity", item.get("entity_group")) not in ignore_labels]
        return self.aggregate_overlapping_entities(items) if len(all_outputs) > 1 else items

    def _words(self, outputs: dict, first: dict) -> list[list[dict]]:
        """The words of one chunk, each the list of its tokens (transformers' pre-entities: ``word``, ``start``,
        ``end``, ``index``), special tokens left out."""
        offsets = outputs["offset_mapping"]
        tokens = self.gather_pre_entities(
            first["sentence"],
            outputs["input_ids"][0],
            outputs["logits"][0].float().numpy(),
            None if offsets is None else offsets[0],
            outputs["special_tokens_mask"][0].numpy(),
            AggregationStrategy.SIMPLE,
            word_ids=outputs.get("word_ids"),
            word_to_chars_map=first.get("word_to_chars_map"),
        )
        word_ids = outputs.get("word_ids")
        words: list[list[dict]] = []
        for token in tokens:
            if word_ids is not None:  # the given words, exactly
                starts_word = not words or word_ids[token["index"]] != word_ids[words[-1][0]["index"]]
            else:
                starts_word = not words or not token["is_subword"]
            if starts_word:
                words.append([token])
            else:
                words[-1].append(token)
        return words

    def _text(self, words: list[list[dict]]) -> dict:
        tokens = [token for word in words for token in word]
        return {
            "word": self.tokenizer.convert_tokens_to_string([token["word"] for token in tokens]),
            "start": tokens[0]["start"],
            "end": tokens[-1]["end"],
        }

    def _crf_items(self, logits: torch.Tensor, words: list[list[dict]], aggregation_strategy) -> list[dict]:
        crf = self.model.crf
        emissions = logits[0, [word[0]["index"] for word in words]].float()  # (W, C): each word's first sub-token
        path = crf.decode(emissions[None].to(crf.transitions.device))[0]
        start, transitions, end = (p.detach().cpu().numpy() for p in crf.potentials())
        marginals = crf_marginals(emissions.numpy(), start, transitions, end)
        tags = [self.model.config.id2label[tag] for tag in path]
        scores = [float(marginals[i, tag]) for i, tag in enumerate(path)]
        if aggregation_strategy in (None, AggregationStrategy.NONE):
            return [
                {"entity": tag, "score": score, "index": word[0]["index"], **self._text([word])}
                for word, tag, score in zip(words, tags, scores)
            ]
        entities = entity_spans(tags)
        return [
            {"entity_group": kind, "score": float(np.mean(scores[a : b + 1])), **self._text(words[a : b + 1])}
            for kind, a, b in entities
        ]

    def _span_items(self, logits: torch.Tensor, words: list[list[dict]], aggregation_strategy) -> list[dict]:
        head = span_head_of(self.model)
        device = next(head.parameters()).device
        positions = torch.tensor([[word[0]["index"] for word in words]], device=device)
        scores = span_scores(self.model, logits.to(device), positions)
        flat = bool(getattr(self.model.config, "span_flat", False))
        return [
            {
                "entity_group": self.model.config.id2label[kind],
                "score": float(torch.sigmoid(scores[0, kind, first, end - 1])),
                **self._text(words[first:end]),
            }
            for kind, first, end in decode_spans(scores, flat=flat)[0]
        ]


# task -> (its pipeline class, its model loader)
_TASKS = {
    "token-classification": (TokenClassificationPipelineWithHeads, AutoModelForTokenClassificationWithHeads),
    "text-classification": (TextClassificationPipelineWithHeads, AutoModelForSequenceClassificationWithHeads),
}


def register() -> None:
    """Make transformers' ``"token-classification"`` (``"ner"``) and ``"text-classification"`` tasks use the
    pipelines and loaders of this module (the tasks' defaults kept). Idempotent; ``import nlp_tricks`` calls it when
    ``transformers.pipelines`` is imported.

    The entries are written into ``PIPELINE_REGISTRY.supported_tasks`` rather than through ``register_pipeline``,
    which would also mark the classes as a custom pipeline that ``Pipeline.save_pretrained`` writes into the saved
    config (loadable then only with ``trust_remote_code``).
    """
    for task, (pipeline_class, loader) in _TASKS.items():
        entry = PIPELINE_REGISTRY.supported_tasks[task]
        PIPELINE_REGISTRY.supported_tasks[task] = {**entry, "impl": pipeline_class, "pt": (loader,)}


register()  # importing this module is what `import nlp_tricks` does once transformers' pipelines load
