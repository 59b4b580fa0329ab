"""Tiny encoder-decoder models built from config (T5, BERT2BERT, Marian) for the seq2seq tests: seconds on a CPU."""

from __future__ import annotations

import torch
from transformers import (
    EncoderDecoderConfig,
    EncoderDecoderModel,
    MarianConfig,
    MarianMTModel,
    T5Config,
    T5ForConditionalGeneration,
)

from nlp_tricks.seq2seq import Seq2SeqTricksArguments
from tiny import VOCAB, bart_lm, bert_config

__all__ = ["bart_lm", "t5_lm", "bert2bert", "marian_mt", "seq2seq_args", "MODELS"]


def t5_lm(**overrides):
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    kwargs.update(overrides)
    return T5ForConditionalGeneration(T5Config(**kwargs))


def bert2bert(**overrides):
    """BERT2BERT (Rothe et al. 2020): a BERT encoder and a BERT decoder with cross-attention, untied."""
    torch.manual_seed(0)
    special = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)
    encoder = bert_config(**special, **overrides)
    decoder = bert_config(is_decoder=True, add_cross_attention=True, **special, **overrides)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = 2
    config.pad_token_id = 0
    config.eos_token_id = 3
    return EncoderDecoderModel(config=config)


def marian_mt(**overrides):
    """Marian scales embeddings inside the decoder's forward (BART scales them in the embedding module)."""
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        scale_embedding=True,
    )
    kwargs.update(overrides)
    return MarianMTModel(MarianConfig(**kwargs))


MODELS = {"bart": bart_lm, "t5": t5_lm, "bert2bert": bert2bert}


def seq2seq_args(tmp_path, **overrides) -> Seq2SeqTricksArguments:
    kwargs = dict(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return Seq2SeqTricksArguments(**kwargs)
