"""``--trick module:Class``: a user's own Trick (a file this test writes) in the recipes, with its own flag: its
effect on the loss, ``--help``, a YAML config file, one-line refusals, the ablation and k-fold runners."""

import json
import sys

import pytest

from recipe_helpers import ROOT, TEST_CONLL, TRAIN_CONLL, ner_files, run_in_process, tiny_args

import ablation
import kfold
import sweep
from common import parse_recipe_args, user_tricks
from ner import RECIPE_ARGUMENT_TYPES as NER_TYPES

# A logit penalty with a weight flag; it writes what it added to the loss, so the test can check the loss with it.
PENALTY = '''
import json
from dataclasses import dataclass, field
from pathlib import Path

from nlp_tricks import Trick


@dataclass
class LogitPenaltyArguments:
    """A penalty on the logits: a trick of the user's."""

    penalty_weight: float = field(default=0.0, metadata={"help": "Weight of the mean squared logit in the loss."})


class LogitPenalty(Trick):
    arguments = LogitPenaltyArguments
    order = 50

    def __init__(self, args):
        self.weight = args.penalty_weight
        self.terms = []

    @staticmethod
    def validate(args):
        if not args.penalty_weight >= 0:
            raise ValueError(f"penalty_weight={args.penalty_weight} is not allowed; it must be >= 0")

    def adjust_loss(self, trainer, inputs, outputs, loss):
        term = self.weight * outputs.logits.pow(2).mean()
        self.terms.append(float(term.detach()))
        return loss + term

    def on_train_end(self, args, state, control, **kwargs):
        record = {"weight": self.weight, "terms": self.terms}
        Path(args.output_dir, "penalty.json").write_text(json.dumps(record))


class NotATrick:
    pass
'''


@pytest.fixture
def penalty_file(tmp_path):
    path = tmp_path / "penalty.py"
    path.write_text(PENALTY)
    return str(path)


def step_losses(out) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def test_user_trick_changes_the_ner_loss_by_what_it_adds(tiny_model, tmp_path, penalty_file, monkeypatch, one_thread):
    data = ner_files(tmp_path)
    plain, penalised = tmp_path / "plain", tmp_path / "penalised"
    assert run_in_process("ner", tiny_args(tiny_model, plain, *data), monkeypatch) == 0
    flags = ["--trick", f"{penalty_file}:LogitPenalty", "--penalty_weight", "0.5"]
    assert run_in_process("ner", tiny_args(tiny_model, penalised, *data, *flags), monkeypatch) == 0
    record = json.loads((penalised / "penalty.json").read_text())
    assert record["weight"] == 0.5 and len(record["terms"]) == 2 and record["terms"][0] > 0
    # Step 1 starts from the same weights and batch: the loss is the plain run's plus the penalty the trick added
    # (float32 sums: a rounding's difference).
    assert step_losses(penalised)[0] == pytest.approx(step_losses(plain)[0] + record["terms"][0], rel=1e-6)
    assert not (plain / "penalty.json").exists()


@pytest.mark.parametrize("recipe", ["ner", "classification", "summarization", "pretraining", "self_training"])
def test_every_recipe_lists_the_trick_flag_in_help(recipe, penalty_file, monkeypatch, capsys):
    assert run_in_process(recipe, ["--trick", f"{penalty_file}:LogitPenalty", "--help"], monkeypatch) == 0
    shown = capsys.readouterr().out
    assert "--trick TRICK [TRICK ...]" in shown
    assert "--penalty_weight PENALTY_WEIGHT" in shown and "Weight of the mean squared logit in the loss." in shown


def one_line_refusal(capsys, argv, *expected):
    """``argv`` refused as argparse refuses a flag: exit 2, one line on stderr holding every ``expected``."""
    with pytest.raises(SystemExit) as exit_:
        parse_recipe_args(NER_TYPES, "ner", argv=argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err


def test_bad_tricks_and_values_are_one_line(tmp_path, penalty_file, capsys):
    trick = f"{penalty_file}:LogitPenalty"
    one_line_refusal(capsys, ["--trick", trick, "--penalty_weight", "-1"], "penalty_weight=-1.0 is not allowed")
    one_line_refusal(capsys, ["--trick", trick, "--penalty_weight", "x"], "--penalty_weight", "invalid float")
    one_line_refusal(capsys, ["--trick", f"{penalty_file}:Penalty"], "has no class 'Penalty'", "LogitPenalty")
    one_line_refusal(capsys, ["--trick", f"{penalty_file}:NotATrick"], "NotATrick is not a subclass")
    one_line_refusal(capsys, ["--trick", "no_such_module_here:X"], "no module named 'no_such_module_here'")
    one_line_refusal(capsys, ["--trick", str(tmp_path / "missing.py") + ":X"], "no such file")
    one_line_refusal(capsys, ["--trick", penalty_file], "expected module:Class")
    one_line_refusal(capsys, ["--trick", trick, "--trick", trick], "given twice")
    broken = tmp_path / "broken.py"
    broken.write_text("import a_package_nobody_has\n")
    one_line_refusal(capsys, ["--trick", f"{broken}:X"], "importing", "ModuleNotFoundError", "a_package_nobody_has")
    clash = tmp_path / "clash.py"
    clash.write_text(PENALTY.replace("penalty_weight", "learning_rate"))
    one_line_refusal(capsys, ["--trick", f"{clash}:LogitPenalty"], "'learning_rate' is already a flag")


def weights(training_args) -> list[float]:
    return [trick.weight for trick in user_tricks(training_args)]


def test_config_file_sets_the_trick_and_its_flag(tmp_path, penalty_file, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"trick: {penalty_file}:LogitPenalty\npenalty_weight: 0.25\n")
    *_, training = parse_recipe_args(NER_TYPES, "ner", argv=[str(config)])
    assert weights(training) == [0.25]
    *_, training = parse_recipe_args(NER_TYPES, "ner", argv=[str(config), "--penalty_weight", "0.75"])
    assert weights(training) == [0.75]  # the command line wins over the file, as for every flag
    *_, training = parse_recipe_args(NER_TYPES, "ner", argv=[])
    assert user_tricks(training) == []
    config.write_text(f"trick: [{penalty_file}:LogitPenalty]\npenalty_weight: [1]\n")
    one_line_refusal(capsys, [str(config)], "run.yaml: penalty_weight: invalid float value")


def test_module_importable_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_penalty_module.py").write_text(PENALTY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        argv = ["--trick", "my_penalty_module:LogitPenalty", "--penalty_weight", "0.125"]
        *_, training = parse_recipe_args(NER_TYPES, "ner", argv=argv)
        assert weights(training) == [0.125]
    finally:
        sys.modules.pop("my_penalty_module", None)


def test_ablation_runs_a_configuration_with_a_user_trick(tmp_path, penalty_file, capsys):
    added = f"penalty=--trick {penalty_file}:LogitPenalty --penalty_weight 0.1"
    argv = ["--recipe", "ner", "--seeds", "1", "--configurations", "baseline", "--add_configuration", added]
    assert ablation.main([*argv, "--output_dir", str(tmp_path / "abl"), "--dry_run", "--no_yardstick"]) == 0
    planned = [line for line in capsys.readouterr().out.splitlines() if "/penalty/" in line]
    assert len(planned) == 1 and f"--trick {penalty_file}:LogitPenalty --penalty_weight 0.1" in planned[0]
    bad = f"penalty=--trick {penalty_file}:Penalty"
    with pytest.raises(SystemExit) as exit_:
        ablation.main(["--recipe", "ner", "--add_configuration", bad, "--output_dir", str(tmp_path / "abl2")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "configuration penalty: --trick" in err[-1] and "has no class 'Penalty'" in err[-1]
    assert not (tmp_path / "abl2").exists()


def test_kfold_passes_the_trick_and_its_flag_to_every_fold(tiny_model, tmp_path, penalty_file, capsys):
    (tmp_path / "train.conll").write_text(TRAIN_CONLL + "\nthe O\ndog O\n\nJohn B-PER\nran O\n")
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    jobs = []

    def capture(job):
        jobs.append(job)
        raise sweep.RunFailed(f"{job.run_dir}: captured", 0.0)

    recipe = ["--model_name_or_path", tiny_model, "--train_file", str(tmp_path / "train.conll")]
    recipe += ["--test_file", str(tmp_path / "test.conll"), "--trick", f"{penalty_file}:LogitPenalty"]
    argv = ["--recipe", "ner", "--folds", "2", "--output_dir", str(tmp_path / "kf"), "--"]
    assert kfold.main([*argv, *recipe, "--penalty_weight", "0.1"], run=capture) == 1
    assert len(jobs) == 2
    for job in jobs:
        at = job.flags.index("--trick")
        assert job.flags[at : at + 2] == ["--trick", f"{penalty_file}:LogitPenalty"]
        assert job.flags[job.flags.index("--penalty_weight") + 1] == "0.1"
        assert job.script == str(ROOT / "recipes" / "ner.py")
    jobs.clear()
    with pytest.raises(SystemExit) as exit_:  # checked once, before any fold runs
        kfold.main([*argv, *recipe, "--penalty_weight", "-2"], run=capture)
    assert exit_.value.code == 2 and not jobs
    assert "penalty_weight=-2.0 is not allowed" in capsys.readouterr().err
