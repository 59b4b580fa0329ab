"""The recipes' flags do what they read as, and mistakes are one line (resume, one-line errors, labels)."""

import json

import pytest
import torch

from nlp_tricks.functional.losses import focal_alpha_weights, focal_loss
from recipe_helpers import CLS_ROWS, ner_files, run_in_process, tiny_args, write_csv


def last_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


def test_save_steps_alone_saves_and_resume_true_continues(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, *ner_files(tmp_path, predict=False), "--save_steps", "1")
    assert run_in_process("ner", args, monkeypatch) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    # --max_steps 4 from checkpoint-2: two more steps.
    resumed = [*args, "--resume_from_checkpoint", "true", "--max_steps", "4"]
    assert run_in_process("ner", resumed, monkeypatch) == 0
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


def test_resume_true_without_checkpoint_is_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, *ner_files(tmp_path, predict=False), "--resume_from_checkpoint", "true")
    assert run_in_process("ner", args, monkeypatch) == 1
    line = last_line(capsys)
    assert line.startswith("--resume_from_checkpoint true: no complete checkpoint-N in") and str(out) in line


def test_do_train_false_evaluates_the_model_as_it_is(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, *ner_files(tmp_path, predict=False), "--do_train", "false")
    assert run_in_process("ner", args, monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert "eval_f1" in results and "train_loss" not in results
    assert not (out / "model.safetensors").exists()  # nothing was trained, so nothing new is saved


def test_help_says_what_resume_true_means(monkeypatch, capsys):
    assert run_in_process("ner", ["--help"], monkeypatch) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "'true' picks the newest COMPLETE checkpoint-N" in text
    assert "--ignore_mismatched_sizes" in text


def test_focal_alpha_one_value_weighs_the_background_against_the_rest():
    labels = ["B-LOC", "B-PER", "O"]
    assert focal_alpha_weights([0.25], labels) == [0.25, 0.25, 0.75]
    logits, target = torch.randn(6, 3), torch.tensor([0, 1, 2, 2, 1, 0])
    # gamma 0: the weighted cross-entropy with weight (0.25, 0.25, 0.75), as torch computes it.
    expected = torch.nn.functional.cross_entropy(logits, target, weight=torch.tensor([0.25, 0.25, 0.75]))
    alpha = focal_alpha_weights([0.25], labels)
    torch.testing.assert_close(focal_loss(logits, target, gamma=0.0, alpha=alpha), expected)
    with pytest.raises(ValueError, match="in this order: 0=business, 1=sport"):
        focal_alpha_weights([0.25], ["business", "sport"])
    with pytest.raises(ValueError, match="3 weights for 2 classes"):
        focal_alpha_weights([1, 2, 3], ["business", "sport"])


def test_focal_alpha_one_value_trains_ner(tiny_model, tmp_path, monkeypatch):
    args = tiny_args(
        tiny_model,
        tmp_path / "out",
        *ner_files(tmp_path, predict=False),
        "--loss_type",
        "focal",
        "--focal_alpha",
        "0.25",
    )
    assert run_in_process("ner", args, monkeypatch) == 0


def test_focal_alpha_that_does_not_fit_the_labels_is_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    args = tiny_args(
        tiny_model, tmp_path / "out", "--train_file", str(tmp_path / "train.csv"), "--loss_type", "focal",
        "--focal_alpha", "0.25",
    )  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 1
    line = last_line(capsys)
    assert line.startswith("--focal_alpha: ") and "in this order: 0=" in line


def test_hub_id_while_offline_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = tiny_args("no-such-org/no-such-model", tmp_path / "out", *ner_files(tmp_path, predict=False))
    assert run_in_process("ner", args, monkeypatch) == 1
    assert last_line(capsys).startswith("--model_name_or_path no-such-org/no-such-model: cannot load it")


def test_a_trained_head_of_another_size_needs_ignore_mismatched_sizes(tiny_model, tmp_path, monkeypatch, capsys):
    first = tmp_path / "first"
    assert run_in_process("ner", tiny_args(tiny_model, first, *ner_files(tmp_path, predict=False)), monkeypatch) == 0
    (tmp_path / "other.conll").write_text("Mary B-PER\nran O\n\nthe O\ncat B-ANIMAL\n\na O\ndog B-ANIMAL\n")
    args = tiny_args(str(first), tmp_path / "second", "--train_file", str(tmp_path / "other.conll"))
    assert run_in_process("ner", args, monkeypatch) == 1
    assert "add --ignore_mismatched_sizes true" in last_line(capsys)
    assert run_in_process("ner", [*args, "--ignore_mismatched_sizes", "true"], monkeypatch) == 0


def test_one_class_in_training_is_an_error(tiny_model, tmp_path, monkeypatch, capsys):
    write_csv(tmp_path / "train.csv", [("the cat", "animal"), ("a dog", "animal")])
    args = tiny_args(tiny_model, tmp_path / "out", "--train_file", str(tmp_path / "train.csv"))
    assert run_in_process("classification", args, monkeypatch) == 1
    expected = f"{tmp_path / 'train.csv'}: only one label ('animal') in the training data; a classifier needs two"
    assert last_line(capsys) == expected
