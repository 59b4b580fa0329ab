"""`python recipes/ablation.py` end to end on a tiny model: runs, table, plot, resume."""

import json
import subprocess
import sys

import pytest

from recipe_helpers import ROOT, TEST_CONLL, TRAIN_CONLL, env

import ablation


def test_ablation_tiny_ner(tiny_model, tmp_path):
    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    out = tmp_path / "abl"
    command = [
        sys.executable, str(ROOT / "recipes" / "ablation.py"), "--recipe", "ner", "--seeds", "2", "--max_steps", "2",
        "--configurations", "baseline,fgm", "--output_dir", str(out), "--",
        "--model_name_or_path", tiny_model, "--train_file", str(tmp_path / "train.conll"),
        "--validation_file", str(tmp_path / "test.conll"), "--test_file", str(tmp_path / "test.conll"),
        "--per_device_train_batch_size", "2", "--disable_tqdm", "true", "--logging_steps", "1",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (out / "ablation.md").read_text()
    for config in ("baseline", "fgm"):
        assert f"| {config} |" in table
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "ablation.json").read_text())
    rows = {r["configuration"]: r for r in data["rows"]}
    # The table's numbers are those the runs reported: the mean of the two seeds' test_f1, recomputed from their
    # prediction files (one test split: nothing to pool).
    f1s = [by_fold["null"]["results"]["test_f1"] for by_fold in data["runs"]["fgm"]["default"].values()]
    assert abs(rows["fgm"]["same_lr"][0] - sum(f1s) / 2) < 1e-9
    assert rows["baseline"]["time_vs_baseline"] == 1.0
    assert rows["baseline"]["difference"]["value"] == 0.0
    # The trivial baseline is a row, run on the same split.
    assert "| gazetteer |" in table and rows["gazetteer"]["examples"] == rows["baseline"]["examples"] == 2
    # The FGM runs really trained adversarially (their logs carry the adversarial loss).
    state = json.loads((out / "fgm" / "lrdefault" / "seed1" / "trainer_state.json").read_text())
    assert any("loss_adv" in e for e in state["log_history"])
    # Resume: a second call reruns nothing.
    again = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "[ablation] " not in again.stdout


def test_ablation_folds_predict_every_example_once(tiny_model, tmp_path):
    (tmp_path / "train.conll").write_text(TRAIN_CONLL + "\nMary B-PER\nsat O\n\nthe O\ndog O\nran O\n")
    out = tmp_path / "cv"
    command = [
        sys.executable, str(ROOT / "recipes" / "ablation.py"), "--recipe", "ner", "--seeds", "1", "--folds", "2",
        "--max_steps", "1", "--configurations", "baseline", "--jobs", "2", "--resamples", "200",
        "--output_dir", str(out), "--",
        "--model_name_or_path", tiny_model, "--train_file", str(tmp_path / "train.conll"),
        "--per_device_train_batch_size", "2", "--disable_tqdm", "true",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "ablation.json").read_text())
    rows = {r["configuration"]: r for r in data["rows"]}
    # 5 sentences, 2 folds: each one is in exactly one test fold, so the pooled predictions hold all 5.
    assert rows["baseline"]["examples"] == rows["gazetteer"]["examples"] == 5
    tests = [by_fold[str(k)]["results"]["test_samples"] for by_fold in data["runs"]["baseline"]["default"].values()
             for k in range(2)]  # fmt: skip
    assert sorted(tests) == [2, 3]
    assert "pooled test predictions of 2 folds" in (out / "ablation.md").read_text()


def test_ablation_refuses_multi_label_classification(tmp_path, capsys):
    """The per-example bootstrap and the TF-IDF baseline score single labels: a multi-label ablation is one line."""
    with pytest.raises(SystemExit) as exit_info:
        ablation.main(["--recipe", "classification", "--output_dir", str(tmp_path), "--", "--multi_label", "true"])
    assert exit_info.value.code == 2
    assert "--multi_label" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing ran
    cases = {
        ("--multi_label",): True,
        ("--multi_label", "--seed", "1"): True,
        ("--multi-label", "true"): True,
        ("--multi_label=True",): True,
        ("--multi_label", "false"): False,
        ("--multi_label=no",): False,
        ("--max_train_samples", "50"): False,
    }
    for flags, expected in cases.items():
        assert ablation.multi_label_requested(list(flags)) is expected, flags
