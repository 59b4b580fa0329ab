"""`nlp-tricks plot` on a real (tiny) training run."""

import json
import subprocess
import sys
from pathlib import Path

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


NAMES = ("precision", "recall", "f1", "number")
NER_EVAL = {
    "eval_loss": 0.9,
    "eval_f1": 0.41,
    "eval_precision": 0.5,
    "eval_recall": 0.35,
    "eval_accuracy": 0.93,
    "eval_runtime": 1.2,
    "eval_samples_per_second": 80.0,
    **{f"eval_{t}_{n}": (36.0 if n == "number" else 0.3) for t in ("PER", "LOC", "ORG") for n in NAMES},
}


def _drawn(monkeypatch, tmp_path, history) -> dict[str, list[tuple[str, list[str]]]]:
    """Run `nlp-tricks plot` on a log; for each PNG, its axes' titles and curve labels as drawn."""
    from matplotlib.figure import Figure

    drawn = {}
    original = Figure.savefig

    def spy(self, path, *args, **kwargs):
        drawn[Path(path).name] = [(ax.get_title(), [line.get_label() for line in ax.get_lines()]) for ax in self.axes]
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert main(["plot", str(tmp_path)]) == 0
    return drawn


def test_ner_eval_plot_shows_scores_and_per_entity_f1_never_support_counts(tmp_path, monkeypatch):
    history = [{"step": 10, "loss": 1.0}, {"step": 10, **NER_EVAL}, {"step": 20, **NER_EVAL, "eval_f1": 0.5}]
    drawn = _drawn(monkeypatch, tmp_path, history)
    assert drawn["eval.png"] == [
        ("Evaluation", ["eval_accuracy", "eval_f1", "eval_precision", "eval_recall"]),
        ("Per-entity F1", ["LOC", "ORG", "PER"]),
    ]
    data = (tmp_path / "eval.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_summarization_eval_plot_puts_generated_length_on_its_own_axis(tmp_path, monkeypatch):
    scores = {"eval_rouge1": 0.3, "eval_rouge2": 0.1, "eval_rougeL": 0.2, "eval_rougeLsum": 0.25, "eval_gen_len": 41.0}
    drawn = _drawn(monkeypatch, tmp_path, [{"step": 5, **scores}, {"step": 10, **scores}])
    assert drawn["eval.png"] == [
        ("Evaluation", ["eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_rougeLsum"]),
        ("Other evaluation metrics", ["eval_gen_len"]),
    ]


@pytest.mark.parametrize("content", ['{"eval_f1": 0.5}', "[1, 2]", "{not json"])
def test_a_json_that_is_not_a_trainer_state_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "all_results.json"
    path.write_text(content)
    assert main(["plot", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nlp-tricks plot: {path}: ")
    assert ("not a trainer state" in err) if content.startswith(('{"', "[")) else ("cannot read it as JSON" in err)


def test_self_training_outputs_are_plotted(tiny_model, tmp_path, monkeypatch):
    from recipe_helpers import ner_files, run_in_process, tiny_args

    out = tmp_path / "out"
    files = ner_files(tmp_path, predict=False)
    args = tiny_args(tiny_model, out, "--task", "ner", *files, "--unlabeled_fraction", "0.5", "--rounds", "2")
    assert run_in_process("self_training", args, monkeypatch) == 0
    written = main(["plot", str(out)])
    assert written == 0
    for stage in ("round_1/teacher", "round_1/student", "round_2/student"):
        assert (out / stage / "loss.png").is_file() and (out / stage / "eval.png").is_file(), stage
    data = (out / "self_training.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
