"""Tiny decoder LM folders (Llama, GPT-J from config, safetensors) with WordLevel tokenizers whose special tokens are
chosen per test: one without a padding token (as GPT-2's), one without padding and unknown tokens (as Llama-3's),
one with neither a padding nor an end token. No download; a folder is written in well under a second."""

from __future__ import annotations

from pathlib import Path

import torch

from recipe_helpers import WORDS

SPECIALS = ("<s>", "</s>", "<unk>")


def make_tiny_decoder(
    path: Path,
    arch: str = "llama",
    *,
    pad: str | None = None,
    unk: str | None = "<unk>",
    eos: str | None = "</s>",
    extra: tuple[str, ...] = (),
) -> str:
    """A causal LM folder whose tokenizer has BOS ``<s>`` and the given ``pad`` / ``unk`` / ``eos`` tokens (None: the
    tokenizer has none of that kind; ``<unk>`` stays in the vocabulary for out-of-vocabulary words, ``<pad>`` is in it
    only when ``pad`` is). The model's config has no ``pad_token_id``: the recipes set it. ``extra`` words join the
    vocabulary. ``arch``: ``llama`` (LlamaForCausalLM) or ``gptj`` (GPTJForCausalLM, which transformers has no token
    classifier for)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import GPTJConfig, GPTJForCausalLM, PreTrainedTokenizerFast

    from tiny_causal import llama_lm

    specials = list(SPECIALS) + (["<pad>"] if pad == "<pad>" else [])
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + list(extra))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    given = {"bos_token": "<s>", "pad_token": pad, "unk_token": unk, "eos_token": eos}
    PreTrainedTokenizerFast(
        tokenizer_object=backend, **{k: v for k, v in given.items() if v is not None}
    ).save_pretrained(path)
    if arch == "llama":
        model = llama_lm(vocab_size=len(vocab), max_position_embeddings=256, pad_token_id=None)
    else:
        torch.manual_seed(0)
        config = GPTJConfig(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256)
        model = GPTJForCausalLM(config)
    model.save_pretrained(path)
    return str(path)
