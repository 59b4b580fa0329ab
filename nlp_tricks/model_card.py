"""The README.md (model card) of a saved model with a head transformers' own classes do not load: a CRF, a span head,
a pooling. It says what the folder holds and how to load it so that it predicts as it was evaluated."""

from __future__ import annotations

from pathlib import Path

__all__ = ["model_card", "write_model_card"]

# config attribute -> (pipeline task, what the folder holds, the loading function, the pipeline call's arguments)
_HEADS = {
    "crf": (
        "token-classification",
        "a linear-chain CRF over the word-level logits (`crf.*` weights, `config.crf`): its predictions are the "
        "Viterbi paths over the first sub-token of each word",
        "load_crf_model",
        ', aggregation_strategy="first"',
    ),
    "span_head": (
        "token-classification",
        "a span head (`config.span_head`) in place of the token classifier: its entities are the spans of words it "
        "scores above 0 (nested ones too; the best non-overlapping set with `config.span_flat`)",
        "load_span_model",
        "",
    ),
    "pooling": (
        "text-classification",
        "a pooling of the encoder's states (`pooling.*` weights, `config.pooling`) feeding the classification head",
        "load_pooled_model",
        "",
    ),
}


def model_card(config, folder: str) -> str | None:
    """The model card of a model saved in ``folder`` with ``config``; None when transformers loads it whole itself."""
    attribute = next((name for name in _HEADS if getattr(config, name, None) not in (None, False)), None)
    if attribute is None:
        return None
    task, holds, loader, call = _HEADS[attribute]
    example = "Madison Square Garden is in New York" if task == "token-classification" else "The match ended 2-1."
    words = (
        "\nA list of words with `is_split_into_words=True` predicts over those words, as the recipe's test "
        "predictions did; a string is split into words as transformers' pipeline splits it.\n"
        if task == "token-classification"
        else ""
    )
    return f"""---
pipeline_tag: {task}
tags:
- nlp_tricks
- {attribute.replace("_", "-")}
---

# {Path(folder).name}

A `{config.architectures[0] if getattr(config, "architectures", None) else "transformers"}` model trained with
nlp_tricks (the `nlp-tricks` package), with {holds}. transformers' own `AutoModelFor...` classes do not load that
part (they drop it or start it afresh), so the model would not predict as it was evaluated. Load it with nlp_tricks
installed, without `trust_remote_code`:

```python
import nlp_tricks  # makes transformers' pipelines load and decode this model's {attribute.replace("_", " ")}
from transformers import pipeline

predict = pipeline("{task}", model="{folder}"{call})
predict("{example}")
```
{words}
Or as a model: `nlp_tricks.{loader}("{folder}")` (docs/heads.md and docs/toolbox.md of nlp_tricks).
"""


def write_model_card(folder: str | Path, config) -> Path | None:
    """Write :func:`model_card` as ``folder/README.md`` (unless the folder holds a PEFT adapter, whose base model
    loads otherwise); the path written, or None."""
    folder = Path(folder)
    card = model_card(config, str(folder))
    if card is None or (folder / "adapter_config.json").exists():
        return None
    path = folder / "README.md"
    path.write_text(card, encoding="utf-8")
    return path
