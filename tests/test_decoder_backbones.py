"""Decoder LMs as classifier and tagger backbones, through the recipes' model loading (recipes/common): a padding
token for tokenizers without one, the model's own last-token rule under left and right padding, token classification
through transformers' class (or one line where it has none), and every trick on a LoRA-wrapped decoder.

Tiny Llama / GPT-J folders and models from config (tests/tiny_decoders.py, tests/tiny_zoo.py); no download.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from tiny_decoders import make_tiny_decoder
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

import tiny_zoo
from nlp_tricks import TricksTrainer, build_param_groups
from nlp_tricks.data import DataError
from nlp_tricks.functional.crf import CRF, add_crf
from nlp_tricks.functional.multi_sample_dropout import find_classifier
from tiny import seq_cls_data, token_cls_data, tricks_args

from common import ModelArguments, add_lora, load_classifier

LABELS = ["animal", "place", "work"]
LR = 1e-3


def load(auto_cls, folder, **model_flags):
    return load_classifier(auto_cls, ModelArguments(model_name_or_path=folder, **model_flags), LABELS)


def pad_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no padding token" in r.getMessage()]


# ---- A padding token for tokenizers without one ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "specials, token, how",
    [
        ({}, "<unk>", "its unk token"),  # GPT-2 / Llama-2 style: an unknown token, no padding
        ({"unk": None}, "</s>", "its eos token"),  # Llama-3 style: neither padding nor unknown token
        ({"unk": None, "eos": None}, "<pad>", "a new token"),
    ],
)
def test_a_tokenizer_without_padding_pads_with_unk_else_eos_else_a_new_token(tmp_path, caplog, specials, token, how):
    folder = make_tiny_decoder(tmp_path / "m", **specials)
    before = AutoTokenizer.from_pretrained(folder)
    assert before.pad_token is None
    with caplog.at_level(logging.WARNING):
        model, tokenizer, _ = load(AutoModelForSequenceClassification, folder)
    added = how == "a new token"
    assert tokenizer.pad_token == token and len(tokenizer) == len(before) + added
    assert model.config.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids(token)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    ending = ", added to the vocabulary" if added else ""
    assert pad_lines(caplog) == [
        f"--model_name_or_path {folder}: its tokenizer has no padding token; padding with {how} {token!r} "
        f"(id {tokenizer.pad_token_id}){ending}; --pad_token TOKEN chooses one"
    ]


def test_pad_token_flag_chooses_a_token_of_the_vocabulary_or_adds_one(tmp_path, caplog):
    folder = make_tiny_decoder(tmp_path / "m", pad="<pad>")
    vocab = len(AutoTokenizer.from_pretrained(folder))
    with caplog.at_level(logging.WARNING):
        model, tokenizer, _ = load(AutoModelForSequenceClassification, folder, pad_token="</s>")
        assert (tokenizer.pad_token, model.config.pad_token_id, len(tokenizer)) == ("</s>", 1, vocab)
        model, tokenizer, _ = load(AutoModelForSequenceClassification, folder, pad_token="[PAD]")
    assert tokenizer.pad_token == "[PAD]" and len(tokenizer) == vocab + 1
    assert model.config.pad_token_id == tokenizer.pad_token_id == vocab
    assert model.get_input_embeddings().num_embeddings == vocab + 1
    assert pad_lines(caplog) == []  # asked for: nothing to say


# ---- The sequence classifier's last-token rule ------------------------------------------------------------------


@pytest.mark.parametrize("specials", [{}, {"unk": None}], ids=["pad=unk", "pad=eos"])
def test_the_classifier_reads_the_last_token_under_left_and_right_padding(tmp_path, specials):
    """LlamaForSequenceClassification's own rule (the rightmost token that is not padding, by config.pad_token_id)
    with the padding token the loader chose: a batch padded on the left and one padded on the right give each text
    the logits it gets alone, unpadded."""
    folder = make_tiny_decoder(tmp_path / "m", **specials)
    model, tokenizer, _ = load(AutoModelForSequenceClassification, folder)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    model.eval()
    texts = ["the cat sat on the mat", "john works", "mary ran in london ."]
    with torch.no_grad():
        alone = torch.cat([model(**tokenizer(text, return_tensors="pt")).logits for text in texts])
        for side in ("left", "right"):
            tokenizer.padding_side = side
            batch = tokenizer(texts, padding=True, return_tensors="pt")
            assert batch["input_ids"].eq(tokenizer.pad_token_id).sum() > 0
            # Left padding shifts the rotary positions by a constant, which attention does not see (relative
            # positions), up to float32 round-off.
            torch.testing.assert_close(model(**batch).logits, alone, rtol=1e-4, atol=1e-5)


# ---- Token classification ------------------------------------------------------------------------------------------


def test_a_decoder_tags_through_its_token_classification_class(tmp_path):
    model, tokenizer, _ = load(AutoModelForTokenClassification, make_tiny_decoder(tmp_path / "m"))
    assert type(model).__name__ == "LlamaForTokenClassification"
    assert model.config.num_labels == len(LABELS) and tokenizer.pad_token == "<unk>"


def test_a_decoder_without_a_token_classification_class_is_one_line(tmp_path):
    folder = make_tiny_decoder(tmp_path / "gptj", "gptj")
    with pytest.raises(DataError) as err:
        load(AutoModelForTokenClassification, folder)
    assert str(err.value) == (
        f"--model_name_or_path {folder}: transformers has no TokenClassification class for the architecture 'gptj' "
        "(GPTJForCausalLM); this recipe needs one (Llama, Qwen2, Mistral, GPT-2 and most encoders have it)"
    )
    model, _, _ = load(AutoModelForSequenceClassification, folder)  # which GPT-J has
    assert type(model).__name__ == "GPTJForSequenceClassification"


# ---- Every trick on a LoRA-wrapped decoder --------------------------------------------------------------------------


def lora_llama(task: str, crf: bool = False, **lora):
    """A tiny Llama classifier (``seq`` or ``token``, 3 labels, padding id 0) wrapped by the recipes' add_lora:
    adapters on every linear layer, the head (and a CRF) in full."""
    case = tiny_zoo.Case(
        "llama", "LlamaForSequenceClassification" if task == "seq" else "LlamaForTokenClassification", task
    )
    model = case.model(pad_token_id=0)
    if crf:
        add_crf(model)
    flags = {"peft": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **lora}
    return add_lora(model, ModelArguments(**flags), "SEQ_CLS" if task == "seq" else "TOKEN_CLS")


def trained(tmp_path, model, task: str, steps: int = 3, **tricks) -> dict[str, torch.Tensor]:
    """The trainable weights after ``steps`` steps, as the trainer evaluates and saves them (the EMA's with
    ``ema_decay``)."""
    data = seq_cls_data() if task == "seq" else token_cls_data(num_labels=3)
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, max_steps=steps, **tricks), train_dataset=data)
    trainer.train()
    with trainer.call_tricks("eval_weights"):
        return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


TRICKS = {
    "fgm": {"adversarial": "fgm"},
    "pgd": {"adversarial": "pgd"},
    "awp": {"adversarial": "awp"},
    "freelb": {"adversarial": "freelb"},
    "rdrop": {"rdrop_alpha": 1.0},
    "ema": {"ema_decay": 0.5},
    "focal": {"loss_type": "focal"},
    "class_weights": {"class_weights": [1.0, 3.0, 0.5]},
    "layer_decay": {"layer_decay": 0.5},
    "head_dropout": {"head_dropout_samples": 3, "head_dropout": 0.3},
    "sam": {"sam_rho": 0.05},
    "smart": {"smart_alpha": 1.0},
    "loraplus": {"loraplus_lr_ratio": 16.0},
}


@pytest.mark.parametrize("task", ["seq", "token"])
@pytest.mark.parametrize("trick", list(TRICKS))
def test_each_trick_trains_a_lora_decoder_and_changes_what_it_learns(tmp_path, trick, task):
    """Three steps with the trick: every trainable weight (adapters, the head's modules_to_save copy) moved, and the
    weights the trainer evaluates with differ from those of the same three steps without it. R-Drop needs dropout:
    the adapter's, in both runs (its two passes draw other masks, so the plain run is only a sanity reference
    there). Multi-sample dropout: on the tagger (a decoder's sequence classifier is refused, below)."""
    if trick == "head_dropout" and task == "seq":
        pytest.skip("refused on a decoder's sequence classifier: test_multi_sample_dropout_on_a_decoder_classifier...")
    lora = {"lora_dropout": 0.1} if trick == "rdrop" else {}
    initial = {n: p.detach().clone() for n, p in lora_llama(task, **lora).named_parameters() if p.requires_grad}
    plain = trained(tmp_path / "plain", lora_llama(task, **lora), task)
    with_trick = trained(tmp_path / trick, lora_llama(task, **lora), task, **TRICKS[trick])
    assert set(with_trick) == set(initial) and any("modules_to_save" in name for name in initial)
    for name, value in with_trick.items():
        assert not torch.equal(value, initial[name]), f"{name} did not change"
    assert any(not torch.equal(with_trick[n], plain[n]) for n in plain), f"{trick} changed nothing"


def test_layer_decay_groups_cover_the_decoder_layers_in_order():
    """layer_decay 0.5 on 2 decoder layers: layer i's adapters at lr 0.5^(2 - i), the head's modules_to_save copy at
    head_lr_scale; the frozen base in no group."""
    model = lora_llama("seq")
    groups = build_param_groups(model, learning_rate=LR, weight_decay=0.0, layer_decay=0.5, head_lr_scale=10.0)
    assert [g["label"] for g in groups] == ["layer_0", "layer_1", "head"]
    owned = {name for g in groups for name in g["names"]}
    assert owned == {n for n, p in model.named_parameters() if p.requires_grad}
    for group in groups:
        for name in group["names"]:
            layer = re.search(r"\.layers\.(\d)\.", name)
            want = LR * 10.0 if layer is None else LR * 0.5 ** (2 - int(layer.group(1)))
            assert group["lr"] == pytest.approx(want), name
            assert ("lora_" in name) == (layer is not None), name


def test_multi_sample_dropout_hooks_the_heads_trained_copy():
    model = lora_llama("token")
    name, head = find_classifier(model)
    assert name == "score.modules_to_save.default" and head.weight.requires_grad


def test_multi_sample_dropout_on_a_decoder_classifier_is_refused_in_one_line(tmp_path):
    """A decoder's sequence classifier runs its head at every position, then keeps the last token's logits: the K
    head samples are not logits, so the recipes refuse it before training (the tagger takes it)."""
    folder = make_tiny_decoder(tmp_path / "m")
    args = tricks_args(tmp_path, head_dropout_samples=3, head_dropout=0.3)
    with pytest.raises(
        DataError, match=r"^--head_dropout_samples 3 --head_dropout 0.3: a decoder's sequence classifier"
    ):
        load_classifier(
            AutoModelForSequenceClassification, ModelArguments(model_name_or_path=folder), LABELS, None, args
        )
    model, _, _ = load_classifier(
        AutoModelForTokenClassification, ModelArguments(model_name_or_path=folder), LABELS, None, args
    )
    assert type(model).__name__ == "LlamaForTokenClassification"


def test_rdrop_without_any_dropout_is_still_refused_after_the_first_step(tmp_path):
    """A LoRA adapter's B starts at zero, so R-Drop judges a PEFT model's dropout after one step; a tiny Llama with
    no dropout at all (attention_dropout 0, lora_dropout 0) is refused then."""
    with pytest.raises(ValueError, match="rdrop_alpha=1.0 needs dropout, but the two passes over the batch gave"):
        trained(tmp_path, lora_llama("seq"), "seq", steps=2, rdrop_alpha=1.0)


def test_crf_trains_in_full_beside_the_adapter_at_its_own_rate(tmp_path):
    """A CRF added before wrapping (as the NER recipe does) is a modules_to_save of the adapter: the trick trains
    and decodes with its copy, at crf_lr_scale without decay, and merging leaves the trained CRF in the model."""
    model = lora_llama("token", crf=True)
    initial = model.base_model.model.crf.original_module.transitions.detach().clone()
    trainer = TricksTrainer(
        model=model, args=tricks_args(tmp_path, crf=True, weight_decay=0.1), train_dataset=token_cls_data(num_labels=3)
    )
    trainer.create_optimizer()
    crf = [g for g in trainer.optimizer.param_groups if g.get("label") == "base_model.model.crf"]
    assert [(len(g["params"]), g["lr"], g["weight_decay"]) for g in crf] == [(3, pytest.approx(LR * 100.0), 0.0)]
    copy = model.base_model.model.crf.modules_to_save["default"]
    assert {id(p) for p in crf[0]["params"]} == {
        id(p) for p in copy.parameters()
    }  # the trained copy, not the original
    trainer.train()
    assert not torch.equal(copy.transitions, initial)
    assert torch.equal(model.base_model.model.crf.original_module.transitions, initial)
    merged = model.merge_and_unload()
    assert isinstance(merged.crf, CRF) and torch.equal(merged.crf.transitions, copy.transitions)


def test_crf_on_a_peft_model_without_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="crf=True cannot be added to a PEFT model after wrapping"):
        TricksTrainer(model=lora_llama("token"), args=tricks_args(tmp_path, crf=True))


def byte_level_tokenizer(pre_tokenizer):
    """A byte-level BPE tokenizer with no merges (one token per byte), as Llama-3's, SmolLM2's and GPT-2's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("sequence", [False, True], ids=["ByteLevel", "Sequence[Split, ByteLevel]"])
def test_ner_gives_a_decoders_pre_split_words_their_form_after_a_space(sequence):
    """Each pre-split word gets the leading 'Ġ' it has in running text (the first word too), whatever the model
    type: SmolLM2's (ByteLevel) and Llama-3's (a Split then ByteLevel) pre-tokenizers."""
    from tokenizers import pre_tokenizers
    from transformers import LlamaConfig

    from ner_data import prepare_ner_tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not sequence)
    split = pre_tokenizers.Split(pattern=" ", behavior="isolated")
    tokenizer = byte_level_tokenizer(pre_tokenizers.Sequence([split, byte_level]) if sequence else byte_level)
    words = ["john", "works"]
    assert tokenizer(words, is_split_into_words=True).tokens() == list("johnworks")
    prepare_ner_tokenizer(LlamaConfig(), tokenizer)
    encoding = tokenizer(words, is_split_into_words=True)
    assert encoding.tokens() == ["Ġ", *"john", "Ġ", *"works"]
    assert encoding.word_ids() == [0] * 5 + [1] * 6


def test_the_merge_after_training_holds_the_weights_the_trainer_evaluates_with(tmp_path):
    """--merge_lora with --ema_decay: the merged model computes what the adapter model computes with the EMA swapped
    in (not its raw weights), so the saved, evaluated and reloaded model is the EMA's."""
    from transformers import default_data_collator

    from common import merge_trained_adapter

    model = lora_llama("seq")
    data = seq_cls_data()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, ema_decay=0.5), train_dataset=data)
    trainer.train()
    batch = {k: v for k, v in default_data_collator([data[i] for i in range(len(data))]).items() if k != "labels"}
    model.eval()
    with torch.no_grad():
        raw = model(**batch).logits
        with trainer.call_tricks("eval_weights"):
            ema = model(**batch).logits
        merge_trained_adapter(trainer)
        merged = trainer.model.eval()(**batch).logits
    # A plain transformers model with no LoRA layer left (older PEFT leaves a `peft_config` attribute behind).
    assert not any("lora_" in name for name, _ in trainer.model.named_parameters())
    assert type(trainer.model).__name__ == "LlamaForSequenceClassification"
    assert not torch.allclose(raw, ema, atol=1e-4)
    torch.testing.assert_close(merged, ema, rtol=1e-5, atol=1e-6)  # W + s B A summed in another order
