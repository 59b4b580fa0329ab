"""Tiny decoder-only models (GPT-2, Llama, GPT-NeoX) and causal-LM data, built from config: no download."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from tiny import VOCAB, ListDataset

PAD = 0


def gpt2_lm(**overrides) -> GPT2LMHeadModel:
    """GPT-2 layout (`transformer.h.N`), lm_head tied to `transformer.wte`; no dropout."""
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    kwargs.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**kwargs))


def llama_lm(**overrides) -> LlamaForCausalLM:
    """Llama / Mistral / Qwen2 layout (`model.layers.N`), untied lm_head, grouped-query attention."""
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    kwargs.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kwargs))


def neox_lm(**overrides) -> GPTNeoXForCausalLM:
    """GPT-NeoX layout (`gpt_neox.layers.N`, `gpt_neox.embed_in`, untied `embed_out`)."""
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    kwargs.update(overrides)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**kwargs))


CAUSAL_LMS = {"gpt2": gpt2_lm, "llama": llama_lm}


def causal_lm_data(n=8, length=12, seed=0, prompt_masked=True) -> ListDataset:
    """Right-padded sequences of different lengths; labels are the input ids with -100 on the padding and, with
    ``prompt_masked``, on a prompt of 0-2 tokens (completion-only training), so label counts differ per example and
    position 0 carries a label in some rows (it is never a prediction target: counting it is a bug)."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        ids = torch.randint(5, VOCAB, (length,), generator=g)
        cut = 4 + (i * 5) % (length - 3)
        mask = torch.ones(length, dtype=torch.long)
        mask[cut:] = 0
        ids[cut:] = PAD
        labels = ids.clone()
        labels[cut:] = -100
        if prompt_masked:
            labels[: i % 3] = -100
        items.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return ListDataset(items)
