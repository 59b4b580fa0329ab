"""Pair order (nlp_tricks.functional.pair_swap, recipes/classification_heads.py): both orders in one optimizer step,
exact under gradient accumulation, against the loss written out; the averaged prediction against the two forward
passes combined by hand, for both heads; length-sorted prediction restored byte for byte."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.data.prompts import PromptTemplate
from nlp_tricks.functional.pair_swap import parse_label_map, swap_averaged_logits, swap_permutation
from nlp_tricks.label_token import LabelTokenClassifier, label_token_ids
from recipe_helpers import make_tiny_causal_model

import classification
from classification_heads import ClassificationCollator, attach_pair_swap, restore_order, sort_by_length

LABELS = ["a", "b", "tie"]
PERM = [1, 0, 2]  # a=b, b=a, tie=tie
PAIRS = [
    ("the cat sat", "a dog ran on the mat", "a"),
    ("john works at acme", "mary", "b"),
    ("paris", "london in new york", "tie"),
    ("the dog", "the cat ran in paris", "b"),
    ("a mat", "john", "a"),
    ("mary works", "the mat", "tie"),
]
DATA = SimpleNamespace(truncation_side="right", head_tokens=None, preprocessing_num_workers=None, overwrite_cache=True)


def examples(rows=PAIRS):
    return [{"text": a, "text_pair": b, "label": y} for a, b, y in rows]


@pytest.fixture(scope="module")
def bert(tiny_model):
    """The tiny BERT classifier without dropout, its tokenizer (pairs: [CLS] a [SEP] b [SEP])."""

    def build():
        torch.manual_seed(0)
        return AutoModelForSequenceClassification.from_pretrained(
            tiny_model, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )

    return build, AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama as a label-token classifier (no dropout), its tokenizer, a pair template."""
    folder = make_tiny_causal_model(tmp_path_factory.mktemp("llama"), chat_template=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    ids = label_token_ids(tokenizer, ["cat", "dog", "mat"])

    def build():
        return LabelTokenClassifier(AutoModelForCausalLM.from_pretrained(folder), ids)

    return build, tokenizer, PromptTemplate("{text} : {text_pair} ?")


def test_label_map_parsing_and_its_refusals():
    assert parse_label_map("a=b, b=a ,tie=tie", LABELS) == {"a": "b", "b": "a", "tie": "tie"}
    assert parse_label_map("symmetric", LABELS) == {label: label for label in LABELS}
    assert swap_permutation(parse_label_map("a=b,b=a,tie=tie", LABELS), LABELS) == PERM
    for spec, message in [
        ("a=b,b=a", r"labels \['tie'\] are not mapped"),
        ("a=b,b=tie,tie=a", "a=b needs b=a"),
        ("a=b,b=a,tie=x", r"labels \['x'\] are not among"),
        ("a=b,b=a,tie", "is not label=label"),
        ("a=b,a=a,b=a,tie=tie", "mapped twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_label_map(spec, LABELS)


def test_averaged_logits_give_the_averaged_probabilities():
    torch.manual_seed(0)
    ab, ba = torch.randn(4, 3) * 3, torch.randn(4, 3) * 3
    averaged = swap_averaged_logits(ab, ba, PERM)
    torch.testing.assert_close(averaged.softmax(-1), (ab.softmax(-1) + ba[:, PERM].softmax(-1)) / 2)
    multi = swap_averaged_logits(ab, ba, PERM, multi_label=True)
    torch.testing.assert_close(multi.sigmoid(), (ab.sigmoid() + ba[:, PERM].sigmoid()) / 2)


def tokenized(tokenizer, prompt=None, swap=PERM, train=False, rows=PAIRS):
    label2id = {label: i for i, label in enumerate(LABELS)}
    dataset, _ = classification.tokenize_and_count(
        examples(rows), tokenizer, label2id, 64, data=DATA, prompt=prompt, swap=swap, train=train
    )
    return dataset


def trainer_args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, seed=0,
        remove_unused_columns=False, per_device_eval_batch_size=4, disable_tqdm=True,
    )  # fmt: skip
    kwargs.update(overrides)
    return TricksArguments(**kwargs)


def one_step(build, tokenizer, tmp_path, batch_size, accumulation, prompt=None):
    model = build()
    args = trainer_args(
        tmp_path, optim="sgd", learning_rate=0.5, max_steps=1, max_grad_norm=0.0, weight_decay=0.0,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation, lr_scheduler_type="constant",
    )  # fmt: skip
    train = tokenized(tokenizer, prompt, train=True, rows=PAIRS[:4])
    TricksTrainer(model=model, args=args, train_dataset=train, data_collator=ClassificationCollator(tokenizer)).train()
    return model


def both_orders_by_hand(encode, model, lr=0.5):
    """One SGD step on the mean cross-entropy over the 4 pairs in both orders, the swapped labels mapped by hand."""
    swapped_label = {"a": "b", "b": "a", "tie": "tie"}
    loss = 0.0
    for a, b, y in PAIRS[:4]:
        for first, second, label in ((a, b, y), (b, a, swapped_label[y])):
            logits = model(**encode(first, second)).logits
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor([LABELS.index(label)]))
    (loss / 8).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return model


@pytest.mark.parametrize("head", ["classifier", "label_token"])
def test_both_orders_in_one_step_are_exact_under_accumulation(head, bert, llama, tmp_path):
    if head == "classifier":
        build, tokenizer = bert
        prompt = None

        def encode(first, second):
            return tokenizer(first, second, return_tensors="pt")
    else:
        build, tokenizer, prompt = llama

        def encode(first, second):
            return tokenizer(prompt.render(first, second)[0], add_special_tokens=False, return_tensors="pt")

    reference = both_orders_by_hand(encode, build())
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = one_step(build, tokenizer, tmp_path / f"{batch_size}x{accumulation}", batch_size, accumulation, prompt)
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            # Padding changes the order of float32 sums: round-off only.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name} ({batch_size}x{accumulation})")


@pytest.mark.parametrize("head", ["classifier", "label_token"])
def test_swap_averaged_prediction_is_the_two_passes_combined_by_hand(head, bert, llama, tmp_path):
    if head == "classifier":
        build, tokenizer = bert
        prompt = None
    else:
        build, tokenizer, prompt = llama
    model = build().eval()
    attach_pair_swap(model, SimpleNamespace(pair_swap_predict=True), PERM)
    dataset = tokenized(tokenizer, prompt)
    assert "swap_labels" not in dataset.column_names and "swap_input_ids" in dataset.column_names
    trainer = TricksTrainer(model=model, args=trainer_args(tmp_path), data_collator=ClassificationCollator(tokenizer))
    output = trainer.predict(dataset)
    with torch.no_grad():
        for row, (a, b, _) in enumerate(PAIRS):
            if prompt is None:
                ab, ba = tokenizer(a, b, return_tensors="pt"), tokenizer(b, a, return_tensors="pt")
            else:
                ab, ba = (tokenizer(prompt.render(*pair)[0], return_tensors="pt") for pair in ((a, b), (b, a)))
            model.pair_swap_average.remove()  # the plain model, one pass per order
            p_ab, p_ba = model(**ab).logits.softmax(-1)[0], model(**ba).logits.softmax(-1)[0]
            model.pair_swap_average.attach(model)
            expected = (p_ab + p_ba[PERM]) / 2
            got = torch.from_numpy(output.predictions[row]).softmax(-1)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # padded vs alone: round-off
    labels = torch.tensor([LABELS.index(y) for *_, y in PAIRS])
    expected_loss = torch.nn.functional.cross_entropy(torch.from_numpy(output.predictions), labels)
    assert output.metrics["test_loss"] == pytest.approx(float(expected_loss), rel=1e-5)


def test_length_sorted_prediction_restores_the_order_byte_for_byte(bert, tmp_path):
    """One row per batch: each row's computation is the same sorted or not, so the restored predictions are the
    unsorted ones byte for byte; four rows per batch pad to other lengths: float32 round-off."""
    build, tokenizer = bert
    model = build().eval()
    dataset = tokenized(tokenizer, swap=None, rows=PAIRS * 3)
    ordered, order = sort_by_length(dataset)
    lengths = [len(ids) for ids in ordered["input_ids"]]
    assert lengths == sorted(lengths, reverse=True) and sorted(order.tolist()) == list(range(len(dataset)))
    for batch_size in (1, 4):
        args = trainer_args(tmp_path, per_device_eval_batch_size=batch_size)
        trainer = TricksTrainer(model=model, args=args, data_collator=ClassificationCollator(tokenizer))
        plain = trainer.predict(dataset).predictions
        sorted_predictions = trainer.predict(ordered).predictions
        assert not np.array_equal(sorted_predictions, plain)  # sorting did move rows
        restored = restore_order(sorted_predictions, order)
        if batch_size == 1:
            assert restored.dtype == plain.dtype and restored.tobytes() == plain.tobytes()
        else:
            np.testing.assert_allclose(restored, plain, rtol=1e-5, atol=1e-6)
