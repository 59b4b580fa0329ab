"""`python recipes/ablation.py` end to end on a tiny model: runs, table, plot, resume."""

import json
import subprocess
import sys

from recipe_helpers import ROOT, TEST_CONLL, TRAIN_CONLL, env


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
    # The table's numbers are the runs' own: mean of the two seeds' test_f1.
    runs = data["runs"]["fgm"]["default"]
    f1s = [r["results"]["test_f1"] for r in runs]
    assert abs(rows["fgm"]["same_lr"][0] - sum(f1s) / 2) < 1e-12
    assert rows["baseline"]["time_vs_baseline"] == 1.0
    # The FGM runs really trained adversarially (their logs carry the adversarial loss).
    state = json.loads((out / "fgm" / "lrdefault" / "seed1" / "trainer_state.json").read_text())
    assert any("loss_adv" in e for e in state["log_history"])
    # Resume: a second call reruns nothing.
    again = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "[ablation] " not in again.stdout
