"""The loss table (nlp_tricks.tricks.loss_type.LOSS_TABLE): every entry is the loss the trainer computes, keeps the
functional losses' contract, and its own fields are refused with another loss; the layering of the loss modules."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from loss_cases import CHUNKED_LOSSES, EVERY_LOSS
from transformers import default_data_collator

from nlp_tricks import TricksTrainer
from nlp_tricks.functional.chunked_loss import LMHeadLogits
from nlp_tricks.tricks.loss_type import LOSS_TABLE, LOSS_TYPES, LossArguments, LossFunction
from tiny import bert_token_cls, token_cls_data, tricks_args
from tiny_causal import causal_lm_data, llama_lm

ROOT = Path(__file__).resolve().parents[1] / "nlp_tricks"


def _batch(data):
    return default_data_collator([data[i] for i in range(len(data))])


def _spy_on(monkeypatch, name):
    """Replace loss ``name``'s function in the table by one that records its calls and computes the same."""
    entry, calls = LOSS_TABLE[name], []

    def spy(logits, labels, **kwargs):
        calls.append((logits, labels, kwargs))
        out = entry.function(logits, labels, **kwargs)
        calls[-1] += (out,)
        return out

    monkeypatch.setitem(LOSS_TABLE, name, dataclasses.replace(entry, function=spy))
    return calls


@pytest.mark.parametrize("name", list(LOSS_TABLE))
def test_every_table_entry_is_the_loss_the_trainer_computes(tmp_path, monkeypatch, name):
    """loss_type=name: the trainer's loss is the entry's function, called once on the model's logits and labels; a
    loss that takes the chunks gets a causal LM's LMHeadLogits."""
    calls = _spy_on(monkeypatch, name)
    model = bert_token_cls()
    batch = _batch(token_cls_data(n=4))
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, **EVERY_LOSS[name]))
    loss = trainer.compute_loss(model, batch)
    assert len(calls) == 1, f"loss_type={name!r} did not call its function once"
    logits, labels, _, out = calls[0]
    with torch.no_grad():  # the tiny model has no dropout: the same logits
        want_logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    assert torch.equal(labels, batch["labels"]) and torch.equal(loss, out)
    if name in CHUNKED_LOSSES:
        calls.clear()
        lm = llama_lm()
        trainer = TricksTrainer(model=lm, args=tricks_args(tmp_path, chunked_lm_loss=True, **EVERY_LOSS[name]))
        assert trainer.lm_loss_path == "chunked"
        loss = trainer.compute_loss(lm.train(), _batch(causal_lm_data()))
        assert len(calls) == 1 and isinstance(calls[0][0], LMHeadLogits) and torch.equal(loss, calls[0][3])


@pytest.mark.parametrize("name", list(LOSS_TABLE))
def test_every_table_function_keeps_the_losses_contract(name):
    """(N, C) and (B, L, C) alike; ignored items cost nothing and get no gradient; ``num_items_in_batch`` divides the
    sum; float32 whatever the logits' dtype."""
    function = LOSS_TABLE[name].function
    kwargs = {LOSS_TABLE[name].smoothing: 0.1} if LOSS_TABLE[name].needs_smoothing else {}
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 7, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[torch.rand(3, 5, generator=g) < 0.3] = -100
    mean = function(logits, labels, **kwargs)
    flat = function(logits.reshape(15, 7), labels.reshape(15), **kwargs)
    torch.testing.assert_close(mean, flat)
    per_item = function(logits, labels, reduction="none", **kwargs)
    assert per_item.shape == labels.shape and (per_item[labels == -100] == 0).all()
    (grad,) = torch.autograd.grad(function(logits, labels, reduction="sum", **kwargs), logits)
    assert grad[labels == -100].abs().max() == 0
    total = function(logits, labels, reduction="sum", **kwargs)
    torch.testing.assert_close(function(logits, labels, num_items_in_batch=37, **kwargs), total / 37)
    assert function(logits.detach().bfloat16(), labels, **kwargs).dtype == torch.float32


def _another_value(default):
    return [0.5] if default is None else default + 0.5


def _foreign_fields():
    """(field, its loss, another loss that does not declare it) for every loss's own field."""
    return [
        (own, name, other)
        for name, entry in LOSS_TABLE.items()
        for own in entry.fields
        for other in LOSS_TABLE
        if own not in LOSS_TABLE[other].fields
    ]


@pytest.mark.parametrize("own,name,other", _foreign_fields())
def test_a_loss_field_set_with_another_loss_is_refused_in_one_line(tmp_path, own, name, other):
    default = LossArguments.__dataclass_fields__[own].default
    settings = dict(EVERY_LOSS[other], **{own: _another_value(default)})
    with pytest.raises(ValueError) as error:
        tricks_args(tmp_path, **settings)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{own}=") and f"loss_type={name!r}" in message and f"loss_type={other!r}" in message
    # At its default the field is taken as not set (the rule): accepted.
    tricks_args(tmp_path, **dict(EVERY_LOSS[other], **{own: default}))


def test_poly1_settings_validated_and_summarised(tmp_path):
    args = tricks_args(
        tmp_path, loss_type="poly1", poly1_epsilon=2.0, label_smoothing_factor=0.1, class_weights=["1", "2", "3"]
    )
    assert LossFunction(args).summary() == [
        "loss_type='poly1'",
        "poly1_epsilon=2.0",
        "label_smoothing_factor=0.1",
        "class_weights=[1.0, 2.0, 3.0]",
    ]
    assert LossFunction(tricks_args(tmp_path, loss_type="poly1")).summary() == ["loss_type='poly1'"]
    with pytest.raises(ValueError, match=r"^poly1_epsilon=-1.5 is not allowed; it must be >= -1"):
        tricks_args(tmp_path, loss_type="poly1", poly1_epsilon=-1.5)
    with pytest.raises(
        ValueError, match="label_smoothing_factor applies to loss_type 'ce', 'label_smoothing' or 'poly1'"
    ):
        tricks_args(tmp_path, loss_type="dft", label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="focal takes its class weights from focal_alpha"):
        tricks_args(tmp_path, loss_type="focal", class_weights=["1", "2"])


def test_loss_type_choices_and_help_come_from_the_table():
    metadata = LossArguments.__dataclass_fields__["loss_type"].metadata
    assert metadata["choices"] == list(LOSS_TYPES) == list(LOSS_TABLE)
    for name, entry in LOSS_TABLE.items():
        assert f"{name!r} ({entry.help})" in metadata["help"]
        for own in entry.fields:
            assert LossArguments.__dataclass_fields__[own].metadata["help"], own


def _imports(path: Path) -> list[str]:
    """The modules a file imports, relative ones resolved (``..tricks.x`` -> ``nlp_tricks.tricks.x``)."""
    package = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            found.append(".".join(base + ([node.module] if node.module else [])))
    return found


# Layering exceptions: none (nothing may be added here).
_NOT_YET_MOVED: set[str] = set()


@pytest.mark.parametrize(
    "layer,forbidden",
    [("runtime", ("nlp_tricks.tricks",)), ("functional", ("nlp_tricks.tricks", "nlp_tricks.runtime"))],
)
def test_layering(layer, forbidden):
    """runtime/ imports nothing from tricks/ (the causal-LM loss path asks the tricks, not the loss trick's class);
    functional/ nothing from runtime/ or tricks/ (pure torch)."""
    wrong = [
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in sorted((ROOT / layer).glob("*.py"))
        for name in _imports(path)
        if name.startswith(forbidden)
    ]
    assert not set(wrong) - _NOT_YET_MOVED, wrong


def _quoted_code(page: Path) -> list[tuple[str, str]]:
    """(source path, python block) for each block of ``page`` after a ``<!-- from PATH -->`` line."""
    pattern = re.compile(r"<!-- from (\S+) -->\n```python\n(.*?)```", re.S)
    return pattern.findall(page.read_text(encoding="utf-8"))


def test_adding_a_loss_shows_the_code_as_it_is_in_the_repository():
    """docs/tricks.md's worked example (Poly-1): each quoted block, its parts between `...` lines, appears in its
    source file as it is, in that order."""
    quoted = _quoted_code(ROOT.parent / "docs" / "tricks.md")
    assert {path for path, _ in quoted} >= {"nlp_tricks/functional/losses.py", "nlp_tricks/tricks/loss_type.py"}
    for path, block in quoted:
        source, at = (ROOT.parent / path).read_text(encoding="utf-8"), 0
        for part in re.split(r"^\s*\.\.\.\n", block, flags=re.M):
            found = source.find(part, at)
            assert part and found >= 0, f"docs/tricks.md quotes {path} as it is not:\n{part}"
            at = found + len(part)
