"""The end of a recipe run as a person reads it (recipes/common/summary.py): the headline scores as in
all_results.json, where the model, predictions, metrics and plots are, and a predict command that runs; and the
README's launch, which prints neither accelerate's block of defaults nor torch's pin_memory warning."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from nlp_tricks.cli import main as cli_main
from recipe_helpers import (
    CLS_ROWS,
    ROOT,
    TRAIN_CONLL,
    assert_ok,
    env,
    ner_files,
    run_in_process,
    tiny_args,
    write_csv,
)


def summary_of(stdout: str, recipe: str) -> dict[str, str]:
    """The summary's rows (``{"test": "f1 0.500  ...", "model": ...}``) from a run's standard output."""
    lines = stdout.splitlines()
    start = lines.index(f"***** {recipe}: done *****")
    rows = {}
    for line in lines[start + 1 :]:
        name, _, text = line.partition("  ")
        if not name or name.startswith((" ", "{", "*")):
            break
        rows[name] = text.strip()
    return rows


def scores(results: dict, prefix: str, names: tuple[str, ...]) -> str:
    """The headline as the summary should write it, from all_results.json (written out here, not the code's)."""
    parts = [f"{name} {results[f'{prefix}_{name}']:.3f}" for name in names]
    samples = [f"({results[f'{prefix}_samples']} examples)"] if f"{prefix}_samples" in results else []
    return "  ".join([*parts, *samples])


def test_ner_summary_names_the_files_and_its_predict_command_reproduces_the_predictions(
    tiny_model, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    assert run_in_process("ner", tiny_args(tiny_model, out, *ner_files(tmp_path)), monkeypatch) == 0
    rows = summary_of(capsys.readouterr().out, "ner")
    results = json.loads((out / "all_results.json").read_text())
    names = ("f1", "precision", "recall", "accuracy")
    assert rows["test"] == scores(results, "test", names)
    assert rows["validation"] == scores(results, "eval", names)
    assert rows["model"] == str(out) and (out / "model.safetensors").is_file()
    assert rows["predictions"] == str(out / "test_predictions.txt")
    assert rows["metrics"] == str(out / "all_results.json")
    assert rows["plots"].startswith(f"nlp-tricks plot {out} ")
    # The plot command as printed draws the run.
    assert cli_main(shlex.split(rows["plots"].split("  ")[0])[1:]) == 0
    assert (out / "loss.png").is_file() and (out / "learning_rate.png").is_file()

    # The predict command as printed: the run's data flags (not its training ones) with the model.
    command = shlex.split(rows["predict"])
    assert command[:2] == ["python", str(ROOT / "recipes" / "ner.py")]  # the script as this run was started
    flags = command[2:]
    assert flags == [*ner_files(tmp_path), "--model_name_or_path", str(out), "--do_train", "false",
                     "--output_dir", f"{out}_predict"]  # fmt: skip
    assert run_in_process("ner", flags, monkeypatch) == 0
    again = Path(f"{out}_predict")
    assert (again / "test_predictions.txt").read_text() == (out / "test_predictions.txt").read_text()
    predicted = summary_of(capsys.readouterr().out, "ner")
    assert predicted["model"] == "none written (--do_train false)" and "predict" not in predicted


def test_classification_summary(tiny_model, tmp_path, monkeypatch, capsys):
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    write_csv(tmp_path / "test.csv", CLS_ROWS[:3])
    files = ["--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]
    out = tmp_path / "out"
    assert run_in_process("classification", tiny_args(tiny_model, out, *files), monkeypatch) == 0
    rows = summary_of(capsys.readouterr().out, "classification")
    results = json.loads((out / "all_results.json").read_text())
    assert rows["test"] == scores(results, "test", ("f1", "accuracy"))
    assert "validation" not in rows  # no validation file: no validation scores
    assert rows["predictions"] == f"{out / 'test_predictions.csv'}, {out / 'test_probabilities.npy'}"
    assert shlex.split(rows["predict"])[2:] == [*files, "--model_name_or_path", str(out), "--do_train", "false",
                                                "--output_dir", f"{out}_predict"]  # fmt: skip


def test_summarization_summary_shows_rouge(tiny_model, tmp_path, monkeypatch, capsys):
    records = [{"text": f"john works at acme in {city} .", "summary": f"john in {city}"} for city in ("paris",) * 10]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, "--train_file", str(tmp_path / "train.jsonl"), "--generation_max_length", "4")
    assert run_in_process("summarization", args, monkeypatch) == 0
    rows = summary_of(capsys.readouterr().out, "summarization")
    results = json.loads((out / "all_results.json").read_text())
    assert rows["test"] == scores(results, "test", ("rouge1", "rouge2", "rougeL"))
    assert rows["predictions"] == str(out / "test_predictions.jsonl")
    assert shlex.split(rows["predict"])[:2] == ["python", str(ROOT / "recipes" / "summarization.py")]


def test_pretraining_summary_names_the_recipe_that_uses_its_model(tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat .\njohn works at acme in paris .\n" * 6)
    out = tmp_path / "out"
    extra = ("--train_file", str(tmp_path / "corpus.txt"), "--validation_split_percentage", "34")
    assert (
        run_in_process("pretraining", tiny_args(tiny_model, out, *extra, "--max_seq_length", "12"), monkeypatch) == 0
    )
    rows = summary_of(capsys.readouterr().out, "pretraining")
    results = json.loads((out / "all_results.json").read_text())
    perplexity = (
        f"perplexity {results['eval_perplexity']:.2f} (before training {results['eval_perplexity_before']:.2f})"
    )
    assert rows["validation"].startswith(perplexity)
    assert rows["predictions"] == "none written"
    assert shlex.split(rows["use"]) == [
        "python",
        str(ROOT / "recipes" / "classification.py"),
        "--model_name_or_path",
        str(out),
    ]


def test_self_training_summary_points_at_the_last_student(tiny_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    files = ner_files(tmp_path)
    args = tiny_args(tiny_model, out, "--task", "ner", *files, "--unlabeled_fraction", "0.5", "--rounds", "2")
    assert run_in_process("self_training", args, monkeypatch) == 0
    rows = summary_of(capsys.readouterr().out, "self_training")
    student = json.loads((out / "self_training_results.json").read_text())["rounds"][-1]["student"]
    assert rows["test"] == scores(student, "test", ("f1", "precision", "recall", "accuracy"))
    assert rows["model"] == str(out / "round_2" / "student")
    assert rows["metrics"] == str(out / "self_training_results.json")
    assert rows["plots"].startswith(f"nlp-tricks plot {out} ")
    # The task's recipe predicts with the student, on the run's labelled data flags (not --unlabeled_fraction).
    flags = shlex.split(rows["predict"])[2:]
    assert shlex.split(rows["predict"])[1] == str(ROOT / "recipes" / "ner.py")
    assert flags[: len(files)] == files and "--unlabeled_fraction" not in flags
    assert run_in_process("ner", flags, monkeypatch) == 0


def test_the_readme_launch_prints_no_block_of_defaults_and_no_pin_memory_warning(tiny_model, tmp_path):
    """`accelerate launch --config_file accelerate_configs/one_process.yaml` as the README gives it, without
    OMP_NUM_THREADS (a newcomer's shell): one line for the threads, the summary, and no launcher warnings."""
    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               "accelerate_configs/one_process.yaml", "recipes/ner.py",
               *tiny_args(tiny_model, out, "--train_file", str(tmp_path / "train.conll"))]  # fmt: skip
    environment = {k: v for k, v in env().items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert_ok(proc)
    assert "were not passed" not in proc.stderr and "pin_memory" not in proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("torch threads: ")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert len(said) == 1 and f" of {cores} cores (" in said[0], proc.stderr[-2000:]
    rows = summary_of(proc.stdout, "ner")
    assert rows["model"] == str(out)
    # The launcher's own options come back in the predict command.
    assert shlex.split(rows["predict"])[:5] == [
        "accelerate", "launch", "--config_file", "accelerate_configs/one_process.yaml", "recipes/ner.py",
    ]  # fmt: skip
