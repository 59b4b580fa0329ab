"""Pooling: each mode against the pooling written out here, on every encoder family's own head; padding never
counts; the pooled model saves and loads; the trick and the recipe flag."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2ForSequenceClassification

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.functional.pooling import POOLING_MODES, add_pooling, load_pooled_model
from recipe_helpers import CLS_ROWS, run_in_process, tiny_args, write_csv
from tiny import bert_seq_cls, bert_token_cls, seq_cls_data, tricks_args
from tiny_zoo import CASES

FAMILIES = {c.family: c for c in CASES if c.task == "seq_cls" and c.family not in ("bart", "t5")}


def _batch(pad_id: int, extra_pad: int = 0):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 99, (3, 7 + extra_pad), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate((7, 4, 2)):
        mask[row, length:] = 0
        ids[row, length:] = pad_id
    return ids, mask


def _pad_id(model) -> int:
    return model.config.pad_token_id if model.config.pad_token_id is not None else 0


def _plain_and_pooled(family: str, mode: str):
    torch.manual_seed(0)
    plain = FAMILIES[family].model().eval()
    pooled = copy.deepcopy(plain)
    add_pooling(pooled, mode)
    pooled.eval()
    with torch.no_grad():  # non-trivial learned weights, so a wrong weighting shows
        if mode == "weighted_layers":
            pooled.pooling.layer_weights.copy_(torch.tensor([0.5, -1.0, 2.0]))
    return plain, pooled


def _head(model, family: str, vector: torch.Tensor) -> torch.Tensor:
    """Each family's own head applied to one vector per sequence, written out (dropout off)."""
    if family in ("bert", "albert"):  # pooler output -> dropout -> classifier
        return model.classifier(vector)
    if family in ("roberta", "xlm-roberta", "electra"):  # the head takes [:, 0] of what it is given
        return model.classifier(vector[:, None, :])
    if family == "deberta-v2":  # ContextPooler on [:, 0], then the classifier
        return model.classifier(model.pooler(vector[:, None, :]))
    if family == "distilbert":
        return model.classifier(torch.relu(model.pre_classifier(vector)))
    raise AssertionError(family)


def _reference_vector(plain, pooled, mode: str, ids, mask) -> torch.Tensor:
    """The pooled vector written out from the plain model's hidden states."""
    out = plain.base_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    h = out.last_hidden_state
    m = mask[..., None].float()
    mean = (h * m).sum(1) / m.sum(1)
    big = torch.where(m.bool(), h, torch.full_like(h, -1e30))
    maximum = big.max(dim=1).values
    if mode == "cls":
        return h[:, 0]
    if mode == "mean":
        return mean
    if mode == "max":
        return maximum
    if mode == "mean_max":
        return torch.cat([mean, maximum], dim=1)
    if mode == "weighted_layers":
        w = torch.softmax(pooled.pooling.layer_weights, dim=0)
        means = [(layer * m).sum(1) / m.sum(1) for layer in out.hidden_states]
        return sum(w[i] * means[i] for i in range(len(means)))
    if mode == "attention":
        first, _, last = pooled.pooling.attention
        scores = torch.tanh(h @ first.weight.T + first.bias) @ last.weight[0]
        scores = scores.masked_fill(~mask.bool(), float("-inf"))
        a = torch.softmax(scores, dim=1)
        return (a[..., None] * h).sum(1)
    raise AssertionError(mode)


def test_mean_pooling_is_the_classifier_of_the_masked_mean():
    plain, pooled = _plain_and_pooled("bert", "mean")
    ids, mask = _batch(0)
    with torch.no_grad():
        h = plain.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        expected = plain.classifier(mean)
        logits = pooled(input_ids=ids, attention_mask=mask).logits
    # float32 round-off: the sum over positions runs in another order (masked_fill + sum vs multiply + sum)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert pooled.bert.pooler is None  # its output is replaced; its weights would get no gradient


@pytest.mark.parametrize("mode", POOLING_MODES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_mode_feeds_the_models_own_head_with_the_written_out_vector(family, mode):
    plain, pooled = _plain_and_pooled(family, mode)
    ids, mask = _batch(_pad_id(plain))
    with torch.no_grad():
        expected = _head(pooled, family, _reference_vector(plain, pooled, mode, ids, mask))
        out = pooled(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-6)  # float32 summation order
    assert out.hidden_states is None  # weighted_layers asks for them internally; the caller did not


@pytest.mark.parametrize("mode", POOLING_MODES)
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_appended_padding_does_not_change_the_logits(family, mode):
    _, pooled = _plain_and_pooled(family, mode)
    pad = _pad_id(pooled)
    ids, mask = _batch(pad)
    longer_ids = torch.cat([ids, torch.full((3, 5), pad)], dim=1)
    longer_mask = torch.cat([mask, torch.zeros(3, 5, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        short = pooled(input_ids=ids, attention_mask=mask).logits
        long = pooled(input_ids=longer_ids, attention_mask=longer_mask).logits
    # attention sums over more (zero-weighted) keys: the same value up to float32 summation order
    torch.testing.assert_close(long, short, rtol=1e-5, atol=1e-6)


def test_mean_max_gives_the_head_a_linear_layer_twice_as_wide():
    _, pooled = _plain_and_pooled("bert", "mean_max")
    assert pooled.classifier.in_features == 64 and pooled.classifier.out_features == 3
    _, pooled = _plain_and_pooled("roberta", "mean_max")
    assert pooled.classifier.dense.in_features == 64 and pooled.classifier.out_proj.in_features == 32


@pytest.mark.parametrize("mode", POOLING_MODES)
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_saved_pooled_model_loads_back_with_the_same_logits(tmp_path, family, mode):
    _, pooled = _plain_and_pooled(family, mode)
    pooled.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pooling"] == mode
    loaded = load_pooled_model(tmp_path).eval()
    ids, mask = _batch(_pad_id(pooled))
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=ids, attention_mask=mask).logits, pooled(input_ids=ids, attention_mask=mask).logits
        )


def test_loading_a_model_saved_without_pooling_says_so(tmp_path):
    bert_seq_cls().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not saved with pooling"):
        load_pooled_model(tmp_path)


def test_models_whose_head_pooling_cannot_feed_are_refused():
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        add_pooling(bert_token_cls(), "mean")
    gpt2 = GPT2ForSequenceClassification(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=99))
    with pytest.raises(ValueError, match="pooling does not know how GPT2ForSequenceClassification"):
        add_pooling(gpt2, "mean")


def test_arguments_are_validated(tmp_path):
    with pytest.raises(ValueError, match="pooling='sum' is not allowed"):
        TricksArguments(output_dir=str(tmp_path), pooling="sum")
    with pytest.raises(ValueError, match="pooling='mean' applies to sequence classification and crf=True"):
        TricksArguments(output_dir=str(tmp_path), pooling="mean", crf=True)


def test_the_trick_trains_every_new_weight_and_saves_a_loadable_model(tmp_path):
    model = bert_seq_cls()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, pooling="attention"), train_dataset=seq_cls_data())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert {"pooling.attention.0.weight", "pooling.attention.2.weight"} <= set(before)
    trainer.train()
    for name, param in model.named_parameters():
        assert not torch.equal(before[name], param), f"{name} did not change"
    trainer.save_model(str(tmp_path / "final"))
    loaded = load_pooled_model(tmp_path / "final").eval()
    ids, mask = _batch(0)
    model.eval()
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits
        )


def test_new_weights_are_drawn_under_the_seed(tmp_path):
    draws = []
    for _ in range(2):
        model = bert_seq_cls()
        torch.manual_seed(123)  # a different global RNG state each time would not matter
        TricksTrainer(model=model, args=tricks_args(tmp_path, pooling="attention", seed=7))
        draws.append(model.pooling.attention[0].weight.detach().clone())
        torch.rand(5)
    assert torch.equal(draws[0], draws[1])


def test_recipe_flag(tiny_model, tmp_path, monkeypatch):
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    write_csv(tmp_path / "test.csv", CLS_ROWS[:3])
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "test.csv")]
    assert run_in_process("classification", tiny_args(tiny_model, out, *files, "--pooling", "mean"), monkeypatch) == 0
    assert json.loads((out / "config.json").read_text())["pooling"] == "mean"
    model = load_pooled_model(out)
    assert model.pooling.mode == "mean" and model.bert.pooler is None
    plain = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2)
    assert plain.bert.pooler is not None
    # The saved folder as --model_name_or_path loads pooled (the recipe reads config.pooling) and trains on.
    again = tmp_path / "again"
    assert run_in_process("classification", tiny_args(str(out), again, *files), monkeypatch) == 0
    reloaded = load_pooled_model(again)
    assert reloaded.pooling.mode == "mean" and not torch.equal(reloaded.classifier.weight, model.classifier.weight)
