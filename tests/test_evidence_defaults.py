"""The recipes' evidence defaults as a user meets them: `recipes/ner.py` trains a CRF and `recipes/classification.py`
focal loss unless `--tricks none` (or a flag that does not combine with them, or `--multi_label`)."""

import dataclasses
import json

import pytest
from safetensors.torch import load_file

import nlp_tricks.tricks.loss_type as loss_module
from recipe_helpers import CLS_ROWS, ner_files, run_in_process, tiny_args, write_csv


def recipe_args(model, out, *extra, plain=False):
    """tiny_args without its `--tricks none` unless ``plain``: the recipe's own defaults."""
    args = tiny_args(model, out, *extra)
    assert args[:2] == ["--tricks", "none"]
    return args if plain else args[2:]


@pytest.mark.parametrize("plain", [False, True])
def test_ner_trains_a_crf_by_default_and_tricks_none_does_not(tiny_model, tmp_path, monkeypatch, plain):
    out = tmp_path / "out"
    assert run_in_process("ner", recipe_args(tiny_model, out, *ner_files(tmp_path), plain=plain), monkeypatch) == 0
    saved_crf = "crf.transitions" in load_file(str(out / "model.safetensors"))
    assert saved_crf is (not plain)
    assert json.loads((out / "config.json").read_text()).get("crf", False) is (not plain)


def test_ner_flag_that_excludes_the_crf_turns_it_off_with_a_warning(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = recipe_args(tiny_model, out, *ner_files(tmp_path), "--loss_type", "focal")
    assert run_in_process("ner", args, monkeypatch) == 0
    assert "crf.transitions" not in load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize(
    "extra, focal_expected",
    [([], True), (["--tricks", "none"], False), (["--label_smoothing_factor", "0.1"], False)],
)
def test_classification_trains_with_focal_loss_by_default(tiny_model, tmp_path, monkeypatch, extra, focal_expected):
    calls = []
    entry = loss_module.LOSS_TABLE["focal"]

    def spy(*args, **kwargs):
        calls.append(1)
        return entry.function(*args, **kwargs)

    monkeypatch.setitem(loss_module.LOSS_TABLE, "focal", dataclasses.replace(entry, function=spy))
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    write_csv(tmp_path / "test.csv", CLS_ROWS[:3])
    files = ["--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "test.csv")]
    args = recipe_args(tiny_model, tmp_path / "out", *files, *extra)
    assert run_in_process("classification", args, monkeypatch) == 0
    assert bool(calls) is focal_expected
