"""`nlp-tricks plot` on a real (tiny) training run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nlp_tricks import TricksTrainer
from nlp_tricks.cli import main
from nlp_tricks.plot import plot_run
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
        ("Per-entity F1", ["LOC (0.30)", "ORG (0.30)", "PER (0.30)"]),  # each type's last F1 beside its name
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


# ---- A short run plots: the recipes' logging default, and a note where a series is missing -------------------------


def test_a_30_step_run_on_a_users_csv_logs_loss_and_learning_rate_from_the_first_step(
    tiny_model, tmp_path, monkeypatch
):
    """No --logging_steps: the recipes log a share of the run (about 50 points), so 30 steps log every step; the
    Trainer's 500 or the recipes' former 50 logged no training loss at all in 30 steps."""
    from recipe_helpers import CLS_ROWS, run_in_process, write_csv

    write_csv(tmp_path / "train.csv", CLS_ROWS)
    out = tmp_path / "out"
    args = ["--model_name_or_path", tiny_model, "--train_file", str(tmp_path / "train.csv"), "--output_dir", str(out),
            "--max_steps", "30", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"]  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 0
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e] == list(range(1, 31))
    assert [e["step"] for e in history if "learning_rate" in e] == list(range(1, 31))
    notes = []
    written = {p.name for p in plot_run(out, notes)}
    assert {"loss.png", "learning_rate.png"} <= written and notes == []


def test_a_longer_run_logs_about_50_points_the_first_step_among_them(tiny_model, tmp_path, monkeypatch):
    from recipe_helpers import TRAIN_CONLL, run_in_process

    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    out = tmp_path / "out"
    args = ["--model_name_or_path", tiny_model, "--train_file", str(tmp_path / "train.conll"), "--output_dir",
            str(out), "--max_steps", "100", "--eval_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    assert run_in_process("ner", args, monkeypatch) == 0
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    # A share of 0.02 of 100 steps: every 2nd step (the Trainer rounds the share up), and step 1.
    assert [e["step"] for e in history if "loss" in e] == [1, *range(2, 101, 2)]


def test_a_missing_training_loss_is_said_in_the_log_and_in_loss_png(tmp_path, monkeypatch, capsys):
    """The newcomer's 30-step run with --logging_steps 50: evaluation only. The plot says why, in the log and in
    the PNG, and that learning_rate.png is missing for the same reason."""
    from matplotlib.figure import Figure

    texts = {}
    original = Figure.savefig

    def spy(self, path, *args, **kwargs):
        texts[Path(path).name] = [t.get_text() for ax in self.axes for t in ax.texts]
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    history = [{"step": s, "epoch": s / 10, "eval_loss": 1.0 / s, "eval_f1": 0.1 * s} for s in (10, 20, 30)]
    state = {"log_history": history, "global_step": 30, "logging_steps": 50}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    assert main(["plot", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == [str(tmp_path / "loss.png"), str(tmp_path / "eval.png")]
    notes = captured.err.splitlines()
    assert len(notes) == 2 and all(
        n.startswith(f"nlp-tricks plot: {tmp_path / 'trainer_state.json'}: ") for n in notes
    )
    assert "no training loss in the log (logged every 50 steps, the run had 30)" in notes[0]
    assert "no learning rate" in notes[1]
    assert " ".join(texts["loss.png"][0].split()) in " ".join(notes[0].split())
    # A run that logged everything has no note.
    state["log_history"] = [{"step": 1, "loss": 2.0, "learning_rate": 1e-4}, *history]
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


def test_per_entity_curves_that_coincide_stay_distinguishable(tmp_path, monkeypatch):
    """Ten entity types, most at 0 all run long: each curve its own marker shape, the markers hollow and each smaller
    than the one before, so that coinciding points nest instead of hiding each other."""
    from matplotlib.figure import Figure

    styles = {}
    original = Figure.savefig

    def spy(self, path, *args, **kwargs):
        styles[Path(path).name] = [
            [(line.get_marker(), line.get_markersize(), line.get_fillstyle()) for line in ax.get_lines()]
            for ax in self.axes
        ]
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    types = [f"T{i}" for i in range(10)]
    entry = {"eval_f1": 0.2, **{f"eval_{t}_f1": 0.0 for t in types}, **{f"eval_{t}_number": 5.0 for t in types}}
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": s, **entry} for s in (5, 10)]}))
    assert main(["plot", str(tmp_path)]) == 0
    entity = styles["eval.png"][1]
    assert len(entity) == 10 and len({marker for marker, _, _ in entity}) == 10
    sizes = [size for _, size, _ in entity]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 10
    assert {fill for _, _, fill in entity} == {"none"}
