"""Tiny models, tokenizers and datasets built from config: seconds on a CPU, no download."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    PreTrainedTokenizerFast,
)

from nlp_tricks import TricksArguments
from nlp_tricks.runtime import upstream as _upstream

VOCAB = 99

# Tests that reload a CRF model folder: load_crf_model needs a transformers that builds the head it saved.
needs_crf_loading = pytest.mark.skipif(
    Version(transformers.__version__) < Version(_upstream.CRF_LOADING_SINCE),
    reason=f"load_crf_model needs transformers >= {_upstream.CRF_LOADING_SINCE}",
)


def bert_config(**overrides) -> BertConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    kwargs.update(overrides)
    return BertConfig(**kwargs)


def bert_seq_cls(num_labels=3, **overrides):
    torch.manual_seed(0)
    return BertForSequenceClassification(bert_config(num_labels=num_labels, **overrides))


def bert_token_cls(num_labels=5, **overrides):
    torch.manual_seed(0)
    return BertForTokenClassification(bert_config(num_labels=num_labels, **overrides))


def bart_lm(**overrides):
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
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    kwargs.update(overrides)
    return BartForConditionalGeneration(BartConfig(**kwargs))


def word_tokenizer(words=("the", "cat", "sat", "on", "a", "mat", "dog", "ran")) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer over a small vocabulary, built with the `tokenizers` library."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(specials + list(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def seq_cls_data(n=8, length=12, num_labels=3, seed=0) -> ListDataset:
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        ids = torch.randint(5, VOCAB, (length,), generator=g)
        mask = torch.ones(length, dtype=torch.long)
        cut = int(torch.randint(4, length + 1, (1,), generator=g))
        mask[cut:] = 0
        ids[cut:] = 0
        items.append(
            {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, num_labels, (), generator=g)}
        )
    return ListDataset(items)


def token_cls_data(n=8, length=12, num_labels=5, seed=0) -> ListDataset:
    """Padded sequences whose label counts differ per example (-100 on padding and on some 'sub-tokens')."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        ids = torch.randint(5, VOCAB, (length,), generator=g)
        cut = 3 + (i * 5) % (length - 3)
        mask = torch.ones(length, dtype=torch.long)
        mask[cut:] = 0
        ids[cut:] = 0
        labels = torch.randint(0, num_labels, (length,), generator=g)
        labels[cut:] = -100
        labels[torch.rand(length, generator=g) < 0.3] = -100
        items.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return ListDataset(items)


def seq2seq_data(n=8, src_len=10, tgt_len=7, seed=0) -> ListDataset:
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        ids = torch.randint(5, VOCAB, (src_len,), generator=g)
        labels = torch.randint(5, VOCAB, (tgt_len,), generator=g)
        labels[tgt_len - 1 - i % 3 :] = -100
        items.append({"input_ids": ids, "attention_mask": torch.ones(src_len, dtype=torch.long), "labels": labels})
    return ListDataset(items)


def tricks_args(tmp_path, **overrides) -> TricksArguments:
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
    return TricksArguments(**kwargs)


def one_sgd_step_trainer(tmp_path, model, data, tricks=(), **overrides):
    """A TricksTrainer for one plain SGD step at lr 0.5 over ``data`` in order (no decay, no clipping): the setting in
    which the tests write a trick's step out by hand."""
    from nlp_tricks import TricksTrainer

    kwargs = dict(
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        weight_decay=0.0,
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
    )
    kwargs.update(overrides)
    return TricksTrainer(model=model, args=tricks_args(tmp_path, **kwargs), train_dataset=data, tricks=list(tricks))


WORDPIECES = (
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "un",
    "##believ",
    "##able",
    "token",
    "##ization",
    "play",
    "##ed",
    ",",
    ".",
)


def wordpiece_tokenizer(pieces=WORDPIECES) -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer (lower-casing, punctuation split, ``##`` sub-tokens) over a tiny vocabulary."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(specials + list(pieces))}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def ema_of(trainer):
    """The EMA a trainer keeps with ``ema_decay > 0`` (the ``EMA`` trick's), or ``None``."""
    from nlp_tricks.tricks.ema import ExponentialMovingAverage

    trick = trainer.get_trick(ExponentialMovingAverage)
    return None if trick is None else trick.ema


def span_data(n=8, length=12, num_types=3, seed=0, empty=()) -> ListDataset:
    """Padded sentences with span label rows (nlp_tricks.data.spans.span_label_rows), fixed (length + 8, 3) rows:
    words of one or two sub-tokens, whose counts differ, and random entities that nest and repeat a span with
    another type. Sentences listed in ``empty`` have no word (no item of the loss)."""
    import random

    from nlp_tricks.data.spans import span_label_rows

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        ids = torch.randint(5, VOCAB, (length,), generator=g)
        cut = 4 + (i * 5) % (length - 4)
        mask = torch.ones(length, dtype=torch.long)
        mask[cut:] = 0
        ids[cut:] = 0
        positions = [] if i in empty else [p for p in range(1, cut - 1) if p == 1 or rng.random() < 0.7]
        spans = []
        for _ in range(rng.randint(0, 4) if positions else 0):
            start = rng.randrange(len(positions))
            spans.append((rng.randrange(num_types), start, rng.randint(start + 1, min(len(positions), start + 3))))
        if positions:
            spans.append((rng.randrange(num_types), *spans[-1][1:]) if spans else (0, 0, 1))
        rows = span_label_rows(positions, spans)
        rows += [[-100, -100, -100]] * (length + 8 - len(rows))
        items.append({"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(rows)})
    return ListDataset(items)


def sgd_step_args(tmp_path, **overrides) -> TricksArguments:
    """One plain SGD step at lr 0.5, no decay or clipping: the weights after it are the step's gradient, the
    comparison of the DDP scripts (tests/scripts/*_ddp.py)."""
    kwargs = dict(max_steps=1, optim="sgd", learning_rate=0.5, weight_decay=0.0, max_grad_norm=0.0)
    kwargs.update(overrides)
    return tricks_args(tmp_path, **kwargs)
