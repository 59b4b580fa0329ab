"""One tiny model (from config) and matching batch for each (architecture, task) of the compatibility matrix.

Every input sequence ends with token 2 (the end-of-sequence id the BART / T5 classification heads pool at) and draws
its other tokens from 5..VOCAB-1, so no special id appears by chance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers as tf

from tiny import VOCAB, ListDataset

LENGTH = 8  # tokens per sequence
TARGET_LENGTH = 5  # decoder labels of the generation heads
EOS = 2

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_SEQ2SEQ = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=37,
    decoder_ffn_dim=37,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    classifier_dropout=0.0,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=EOS,
    decoder_start_token_id=EOS,
    forced_eos_token_id=None,
)

# family -> (config class, keyword arguments), all with vocab VOCAB and no dropout
CONFIGS = {
    "bert": (tf.BertConfig, {**_SMALL, **_NO_DROPOUT}),
    "roberta": (tf.RobertaConfig, {**_SMALL, **_NO_DROPOUT, "pad_token_id": 1}),
    "xlm-roberta": (tf.XLMRobertaConfig, {**_SMALL, **_NO_DROPOUT, "pad_token_id": 1}),
    "deberta-v2": (tf.DebertaV2Config, {**_SMALL, **_NO_DROPOUT, "pooler_hidden_size": 32, "pooler_dropout": 0.0}),
    "electra": (tf.ElectraConfig, {**_SMALL, **_NO_DROPOUT, "embedding_size": 16}),
    "albert": (tf.AlbertConfig, {**_SMALL, **_NO_DROPOUT, "embedding_size": 16, "classifier_dropout_prob": 0.0}),
    "distilbert": (
        tf.DistilBertConfig,
        dict(
            dim=32, n_layers=2, n_heads=4, hidden_dim=37, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0
        ),
    ),
    "bart": (tf.BartConfig, _SEQ2SEQ),
    "mbart": (tf.MBartConfig, _SEQ2SEQ),
    "t5": (
        tf.T5Config,
        dict(
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            classifier_dropout=0.0,
            pad_token_id=0,
            eos_token_id=EOS,
            decoder_start_token_id=0,
        ),
    ),
    "gpt2": (  # its default special ids (50256) lie outside the tiny vocabulary
        tf.GPT2Config,
        dict(
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_inner=37,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=EOS,
        ),
    ),
    "llama": (
        tf.LlamaConfig,
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=37),
    ),
}


@dataclass(frozen=True)
class Case:
    """One row of the matrix: ``model_class`` of ``family`` trained on ``task`` batches."""

    family: str
    model_class: str
    task: str  # seq_cls | regression | multi_label | token_cls | mlm | multiple_choice | qa | seq2seq | causal_lm
    num_labels: int = 3
    loss_tricks_apply: bool = True  # False: float labels, where the model's own loss is used

    @property
    def id(self) -> str:
        suffix = "" if self.task in ("seq_cls", "token_cls") else f"-{self.task}"
        return f"{self.model_class}{suffix}"

    def model(self, **config_overrides):
        config_class, kwargs = CONFIGS[self.family]
        kwargs = {"vocab_size": VOCAB, "max_position_embeddings": 64, **kwargs, "num_labels": self.num_labels}
        if self.family == "t5":
            kwargs.pop("max_position_embeddings")
        if self.task == "multi_label":
            kwargs["problem_type"] = "multi_label_classification"
        kwargs.update(config_overrides)
        torch.manual_seed(0)
        return getattr(tf, self.model_class)(config_class(**kwargs))

    def data(self, n: int = 4, seed: int = 0) -> ListDataset:
        g = torch.Generator().manual_seed(seed)
        choices = 2 if self.task == "multiple_choice" else 1

        def ids():
            x = torch.randint(5, VOCAB, (choices, LENGTH), generator=g)
            x[:, -1] = EOS
            return x.squeeze(0)

        items = []
        for i in range(n):
            x = ids()
            item = {"input_ids": x, "attention_mask": torch.ones_like(x)}
            if self.task in ("seq_cls", "multiple_choice"):
                item["labels"] = torch.randint(0, choices if choices > 1 else self.num_labels, (), generator=g)
            elif self.task == "regression":
                item["labels"] = torch.randn((), generator=g) * 2
            elif self.task == "multi_label":
                item["labels"] = torch.randint(0, 2, (self.num_labels,), generator=g).float()
            elif self.task in ("token_cls", "mlm"):
                classes = VOCAB if self.task == "mlm" else self.num_labels
                labels = torch.randint(0, classes, (LENGTH,), generator=g)
                labels[torch.rand(LENGTH, generator=g) < 0.4] = -100
                item["labels"] = labels
            elif self.task == "qa":
                start = torch.randint(0, LENGTH - 2, (), generator=g)
                item["start_positions"] = start
                # The last example's answer lies outside the window: the models clamp and ignore it.
                item["end_positions"] = start + 2 if i < n - 1 else torch.tensor(LENGTH + 3)
            elif self.task == "seq2seq":
                labels = torch.randint(5, VOCAB, (TARGET_LENGTH,), generator=g)
                labels[TARGET_LENGTH - 1 - i % 2 :] = -100
                item["labels"] = labels
            elif self.task == "causal_lm":
                labels = x.clone()
                labels[: 1 + i % 3] = -100
                item["labels"] = labels
            items.append(item)
        return ListDataset(items)


def _encoder_rows(family: str, prefix: str) -> list[Case]:
    return [
        Case(family, f"{prefix}ForTokenClassification", "token_cls", num_labels=5),
        Case(family, f"{prefix}ForSequenceClassification", "seq_cls"),
    ]


CASES = [
    Case("bert", "BertForSequenceClassification", "seq_cls"),
    Case("bert", "BertForSequenceClassification", "regression", num_labels=1, loss_tricks_apply=False),
    Case("bert", "BertForSequenceClassification", "multi_label", loss_tricks_apply=False),
    Case("bert", "BertForTokenClassification", "token_cls", num_labels=5),
    Case("bert", "BertForMaskedLM", "mlm"),
    Case("bert", "BertForMultipleChoice", "multiple_choice"),
    Case("bert", "BertForQuestionAnswering", "qa", num_labels=2),
    *_encoder_rows("roberta", "Roberta"),
    *_encoder_rows("deberta-v2", "DebertaV2"),
    *_encoder_rows("electra", "Electra"),
    *_encoder_rows("distilbert", "DistilBert"),
    *_encoder_rows("albert", "Albert"),
    *_encoder_rows("xlm-roberta", "XLMRoberta"),
    Case("bart", "BartForConditionalGeneration", "seq2seq"),
    Case("bart", "BartForSequenceClassification", "seq_cls"),
    Case("t5", "T5ForConditionalGeneration", "seq2seq"),
    Case("t5", "T5ForSequenceClassification", "seq_cls"),
    Case("gpt2", "GPT2LMHeadModel", "causal_lm"),
    Case("llama", "LlamaForCausalLM", "causal_lm"),
]
