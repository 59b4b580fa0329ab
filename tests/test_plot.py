"""`nlp-tricks plot` on a real (tiny) training run."""

import json
import subprocess
import sys

import pytest

from nlp_tricks import TricksTrainer
from nlp_tricks.cli import main
from tiny import bert_seq_cls, seq_cls_data, tricks_args

pytest.importorskip("matplotlib")


def test_plot_a_tiny_run(tmp_path):
    args = tricks_args(
        tmp_path,
        max_steps=4,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        layer_decay=0.8,
        warmup_ratio=0.5,
    )
    trainer = TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(), eval_dataset=seq_cls_data())
    trainer.train()
    trainer.save_state()
    history = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    # per-group learning rates are logged: layer-wise decay makes the embeddings' lr the smallest
    first = next(e for e in history if "lr/embeddings" in e)
    assert first["lr/embeddings"] == pytest.approx(first["lr/layer_1"] * 0.8**2)
    assert main(["plot", str(tmp_path)]) == 0
    for name in ("loss.png", "learning_rate.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_plot_missing_state_is_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nlp_tricks.cli", "plot", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "trainer_state.json" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("head_scale,log_scale", [(10.0, True), (1.0, False)])
def test_learning_rate_plot_goes_log_when_groups_differ_by_more_than_3x(tmp_path, monkeypatch, head_scale, log_scale):
    """A 10x head rate would squash the layer-wise decay of the other groups into one line on a linear axis."""
    from matplotlib.axes import Axes

    history = [
        {"step": s, "lr/head": head_scale * lr, "lr/layer_0": 0.9 * lr, "lr/layer_1": lr}
        for s, lr in ((1, 1e-4), (2, 5e-5))
    ]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    scales = []
    monkeypatch.setattr(Axes, "set_yscale", lambda self, value, **kw: scales.append(value))
    assert main(["plot", str(tmp_path)]) == 0
    assert scales == (["log"] if log_scale else [])
