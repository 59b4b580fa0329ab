"""recipes/common.py: one parse of the command line (config file + overrides, task-dependent defaults) and the
thread count of a single CPU process under `accelerate launch`."""

import os
import subprocess
import sys

import pytest
import torch

from nlp_tricks import TricksArguments

import common
from common import parse_recipe_args
from ner import NerDataArguments
from self_training import TASK_DEFAULTS, SelfTrainingArguments, SelfTrainingDataArguments, SelfTrainingModelArguments

NER_TYPES = (NerDataArguments, common.ModelArguments, TricksArguments)


def test_config_file_then_command_line_overrides(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 7\nlearning_rate: 3.0e-4\nfocal_alpha: 0.25\nloss_type: focal\n")
    data, _, training = parse_recipe_args(NER_TYPES, "ner", argv=[str(config), "--max_steps", "2"])
    assert training.max_steps == 2  # the command line wins
    assert training.learning_rate == 3e-4  # the file's value
    assert training.focal_alpha == [0.25]  # a scalar for a list flag is a list of one
    assert training.output_dir == "outputs/ner" and data.dataset_name == "demo"


def test_unknown_config_key_is_reported_first_with_the_closest_name(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("learnig_rate: 1e-4\nlayer_decay: 7\n")  # also a bad value, reported only after the key
    with pytest.raises(SystemExit) as info:
        parse_recipe_args(NER_TYPES, "ner", argv=[str(config)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"{config}: unknown key 'learnig_rate'; did you mean 'learning_rate'? (see ner.py --help)"), (
        err
    )


def test_missing_config_file_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_recipe_args(NER_TYPES, "ner", argv=[str(tmp_path / "nope.yaml")])
    assert (
        capsys.readouterr().err.strip().splitlines()[-1].endswith("nope.yaml: no such config file (see ner.py --help)")
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--task", "classification"], TASK_DEFAULTS["classification"]["learning_rate"]),
        (["--task", "ner"], 1.5e-4),
        (["--task", "classification", "--learning_rate", "1.5e-4"], 1.5e-4),  # given: kept, even if it is NER's
    ],
)
def test_self_training_task_defaults_parse_once(argv, expected):
    types = (SelfTrainingDataArguments, SelfTrainingArguments, SelfTrainingModelArguments, TricksArguments)
    parsed = parse_recipe_args(
        types,
        "self_training",
        {"learning_rate": 1.5e-4},
        argv=[*argv, "--unlabeled_fraction", "0.5"],
        dependent_defaults=("task", TASK_DEFAULTS),
    )
    assert parsed[-1].learning_rate == expected


@pytest.mark.parametrize(
    "argv, crf, ema_decay",
    [
        ([], True, 0.99),  # --tricks default: the recipe's evidence defaults
        (["--tricks", "none"], False, 0.0),  # the plain baseline
        (["--crf", "false"], False, 0.99),  # a trick's own flag wins over --tricks default
        (["--tricks", "none", "--crf", "true"], True, 0.0),  # plain plus the one trick given
    ],
)
def test_tricks_default_turns_on_the_evidence_defaults_unless_given_or_none(argv, crf, ema_decay):
    evidence = {"crf": True, "ema_decay": 0.99}
    *_, training = parse_recipe_args(NER_TYPES, "ner", argv=argv, evidence_defaults=evidence)
    assert (training.crf, training.ema_decay) == (crf, ema_decay)
    *_, plain = parse_recipe_args(NER_TYPES, "ner", argv=[])  # a recipe without evidence defaults: plain
    assert (plain.crf, plain.ema_decay) == (False, 0.0)


def test_evidence_defaults_yield_to_a_flag_they_do_not_combine_with(caplog):
    """--loss_type focal given: the CRF (which replaces the loss) is left off with a warning, not an error; a bad value
    of the user's own is still one line and exit 2; --multi_label-style switches keep the evidence off."""
    *_, training = parse_recipe_args(NER_TYPES, "ner", argv=["--loss_type", "focal"], evidence_defaults={"crf": True})
    assert (training.crf, training.loss_type) == (False, "focal")
    assert (
        "--crf true (this recipe's default, --tricks default) is left off: crf=True replaces the loss" in caplog.text
    )
    with pytest.raises(SystemExit) as info:
        parse_recipe_args(NER_TYPES, "ner", argv=["--layer_decay", "7"], evidence_defaults={"crf": True})
    assert info.value.code == 2
    kept_off = parse_recipe_args(
        NER_TYPES, "ner", argv=["--label_all_tokens", "true"], evidence_defaults={"crf": True},
        evidence_unless="label_all_tokens",
    )  # fmt: skip
    assert kept_off[-1].crf is False


def test_recipe_tricks_help_names_its_evidence_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_recipe_args(NER_TYPES, "ner", argv=["--help"], evidence_defaults={"crf": True})
    help_text = " ".join(capsys.readouterr().out.split())
    assert "This recipe's: --crf true." in help_text
    with pytest.raises(SystemExit) as info:
        parse_recipe_args(NER_TYPES, "ner", argv=["--tricks", "some"])
    assert info.value.code == 2


@pytest.fixture
def fake_launcher(monkeypatch):
    """A stand-in `accelerate launch` parent process whose environment and command line the test chooses."""
    procs = []

    def start(env: dict, args: list[str]):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "launch", *args], env=env)
        procs.append(proc)
        monkeypatch.setattr(os, "getppid", lambda: proc.pid)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
        monkeypatch.delenv("WORLD_SIZE", raising=False)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads the launcher's /proc entries")
@pytest.mark.parametrize(
    "launcher_env, launcher_args, uses_every_core",
    [
        ({}, [], True),  # accelerate's own default of 1 thread: every core
        ({"OMP_NUM_THREADS": "1"}, [], False),  # the user's choice: kept
        ({}, ["--num_cpu_threads_per_process", "1"], False),  # the user's choice: kept
    ],
)
def test_single_cpu_process_uses_every_core_unless_the_user_chose(
    fake_launcher, launcher_env, launcher_args, uses_every_core
):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | launcher_env
    fake_launcher(env, launcher_args)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        common.use_every_core()
        expected = len(os.sched_getaffinity(0)) if uses_every_core else 1
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
