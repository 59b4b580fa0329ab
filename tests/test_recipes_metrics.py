"""The recipes' pieces in process: sub-token label alignment and the shipped `evaluate` metric modules (offline)."""

from __future__ import annotations

from pathlib import Path

import evaluate
import pytest

from nlp_tricks.metrics import METRICS, load_metric, metric_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def word_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {t: i for i, t in enumerate(specials + "john lives in new - york .".split())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # splits "New-York" into 3 sub-tokens of one word
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def test_ner_labels_on_first_sub_token(word_tokenizer):
    import ner

    label2id = {"B-LOC": 0, "B-PER": 1, "I-LOC": 2, "O": 3}
    examples = [{"tokens": ["John", "lives", "in", "New-York", "."], "ner_tags": ["B-PER", "O", "O", "B-LOC", "O"]}]
    # Sub-tokens: [CLS] john lives in new - york . [SEP]
    first_only = ner.tokenize_ner(examples, word_tokenizer, label2id, 64, label_all_tokens=False)
    assert first_only["labels"] == [[-100, 1, 3, 3, 0, -100, -100, 3, -100]]
    every = ner.tokenize_ner(examples, word_tokenizer, label2id, 64, label_all_tokens=True)
    assert every["labels"] == [[-100, 1, 3, 3, 0, 2, 2, 3, -100]]  # continuation of B-LOC is I-LOC
    truncated = ner.tokenize_ner(examples, word_tokenizer, label2id, 6, label_all_tokens=False)
    assert truncated["labels"] == [[-100, 1, 3, 3, 0, -100]]


def test_ner_trains_on_iob2_tags_whatever_the_scheme(word_tokenizer):
    import ner

    label2id = {"B-LOC": 0, "B-PER": 1, "I-LOC": 2, "O": 3}
    # Sub-tokens: [CLS] john lives in new - york . [SEP]; "New-York" is one BIOES S- word in 3 sub-tokens.
    examples = [{"tokens": ["John", "lives", "in", "New-York", "."], "ner_tags": ["S-PER", "O", "O", "S-LOC", "O"]}]
    first_only = ner.tokenize_ner(examples, word_tokenizer, label2id, 64, label_all_tokens=False)
    assert first_only["labels"] == [[-100, 1, 3, 3, 0, -100, -100, 3, -100]]  # S-PER, S-LOC: the IOB2 B- tags
    every = ner.tokenize_ner(examples, word_tokenizer, label2id, 64, label_all_tokens=True)
    # The entity keeps its boundaries: B-LOC I-LOC I-LOC, one entity over the word's sub-tokens.
    assert every["labels"] == [[-100, 1, 3, 3, 0, 2, 2, 3, -100]]
    # The same sentence in BMES and BILOU trains on the same labels; a continuation tag the training data never
    # uses is left out rather than replaced.
    for tags in (["S-PER", "O", "O", "S-LOC", "O"], ["U-PER", "O", "O", "U-LOC", "O"]):
        assert (
            ner.tokenize_ner([{**examples[0], "ner_tags": tags}], word_tokenizer, label2id, 64, True)["labels"]
            == (every["labels"])
        )
    del label2id["I-LOC"]
    assert ner.tokenize_ner(examples, word_tokenizer, label2id, 64, True)["labels"] == [
        [-100, 1, 3, 3, 0, -100, -100, 3, -100]
    ]


def test_metric_modules_are_local_files():
    for name in METRICS:
        path = Path(metric_path(name))
        assert (path / f"{name}.py").is_file()
    with pytest.raises(ValueError, match="choose one of"):
        metric_path("bleu")


def test_rouge_by_hand():
    metric = evaluate.load(metric_path("rouge"), keep_in_memory=True)
    scores = metric.compute(
        predictions=["the cat sat", "a b c d"], references=["the cat sat on the mat", "a b x d"], use_stemmer=False
    )
    # 1: unigrams P 3/3 R 3/6 -> F 2/3; bigrams P 2/2 R 2/5 -> 4/7; LCS 3 -> 2/3.
    # 2: unigrams 3/4 both -> 3/4; bigrams {ab} 1/3 both -> 1/3; LCS "a b d" 3 -> 3/4.
    assert scores["rouge1"] == pytest.approx((2 / 3 + 3 / 4) / 2)
    assert scores["rouge2"] == pytest.approx((4 / 7 + 1 / 3) / 2)
    assert scores["rougeL"] == pytest.approx((2 / 3 + 3 / 4) / 2)


def test_accuracy_macro_f1_by_hand():
    metric = load_metric("accuracy_f1")
    scores = metric.compute(predictions=[0, 0, 1, 2], references=[0, 1, 1, 1], labels=[0, 1, 2])
    # class 0: P 1/2 R 1 F 2/3; class 1: P 1 R 1/3 F 1/2; class 2: P 0 R 0 F 0 -> macro (2/3 + 1/2) / 3.
    assert scores["accuracy"] == pytest.approx(2 / 4)
    assert scores["f1"] == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)
