"""recipes/common: one parse of the command line (config file + overrides, task-dependent defaults; common/parsing.py,
common/config_file.py) and the start every recipe shares (common/start.py); the thread count:
tests/test_recipe_threads.py."""

import re

import pytest
import torch

from nlp_tricks import TricksArguments
from nlp_tricks.data import DataError

import common
from common import parse_recipe_args, start_recipe
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


def last_error_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


# Before the file's values were checked, each of these reached the Trainer, the optimizer or a reader unchecked and
# ended in a traceback (TypeError in Trainer._validate_args, in build_param_groups and in os.stat; Adam's ValueError).
@pytest.mark.parametrize(
    "name, text, message",
    [
        ("run.yaml", "max_steps: [1, 2]", "max_steps: invalid int value: '[1, 2]'"),
        ("run.yaml", "learning_rate: {a: 1}", """learning_rate: invalid float value: '{"a": 1}'"""),
        ("run.yaml", "train_file: [a, b]", """train_file: invalid str value: '["a", "b"]'"""),
        ("run.yaml", "learning_rate: .nan", "learning_rate: invalid float value: 'nan'"),
        ("run.yaml", "learning_rate: .inf", "learning_rate: invalid float value: 'inf'"),
        ("run.yaml", "max_steps: null", "max_steps: invalid int value: 'null'"),
        ("run.yaml", "focal_alpha: [0.25, x]", "focal_alpha: invalid float value: 'x'"),
        ("run.json", '{"max_steps": [1, 2]}', "max_steps: invalid int value: '[1, 2]'"),
        ("run.json", '{"learning_rate": NaN}', "learning_rate: invalid float value: 'nan'"),
    ],
)  # fmt: skip
def test_wrong_typed_config_value_is_one_line_naming_the_file_and_key(tmp_path, capsys, name, text, message):
    config = tmp_path / name
    config.write_text(text + "\n")
    with pytest.raises(SystemExit) as info:
        parse_recipe_args(NER_TYPES, "ner", argv=[str(config)])
    assert info.value.code == 2
    assert last_error_line(capsys) == f"ner.py: error: {config}: {message} (see ner.py --help)"


def test_yaml_no_for_a_choice_flag_is_told_to_quote_it(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("save_strategy: no\n")  # YAML 1.1: false
    with pytest.raises(SystemExit) as info:
        parse_recipe_args(NER_TYPES, "ner", argv=[str(config)])
    assert info.value.code == 2
    line = last_error_line(capsys)
    assert line.startswith(f"ner.py: error: {config}: save_strategy: invalid choice: 'false' (choose from ")
    assert line.endswith("; YAML reads an unquoted no / yes / off / on as a boolean: quote it (see ner.py --help)")


@pytest.mark.parametrize(
    "flag, text",
    [("max_steps", "1.5"), ("max_steps", "true"), ("seed", "x"), ("crf", "maybe"), ("loss_type", "bogus"),
     ("learning_rate", "nan")],
)  # fmt: skip
def test_a_config_value_gets_the_message_the_command_line_gets(tmp_path, capsys, flag, text):
    """argparse's own line for `--flag text` is the reference; the file's names the file and the key instead."""
    with pytest.raises(SystemExit):
        parse_recipe_args(NER_TYPES, "ner", argv=[f"--{flag}", text])
    command_line = last_error_line(capsys)
    assert command_line.startswith(f"ner.py: error: argument --{flag}")  # "--max_steps/--max-steps: "
    config = tmp_path / "run.yaml"
    config.write_text(f"{flag}: {text}\n")
    with pytest.raises(SystemExit) as info:
        parse_recipe_args(NER_TYPES, "ner", argv=[str(config)])
    assert info.value.code == 2
    assert last_error_line(capsys) == re.sub(r"argument \S+: ", f"{config}: {flag}: ", command_line, count=1)


def test_config_values_their_fields_admit_are_kept(tmp_path):
    """What the command line cannot give is kept where the field's type admits it: a mapping for a dict field,
    null for an optional one; every other value is what its text after the flag gives."""
    config = tmp_path / "run.yaml"
    config.write_text(
        "lr_scheduler_kwargs: {num_cycles: 2}\ntrain_file: null\nlearning_rate: 1e-4\nnum_train_epochs: 3\n"
        "loss_type: focal\nfocal_alpha: [0.25, 1]\nlabel_all_tokens: 1\nsave_strategy: 'no'\n"
        "resume_from_checkpoint: true\n"
    )
    data, _, training = parse_recipe_args(NER_TYPES, "ner", argv=[str(config)])
    assert training.lr_scheduler_kwargs == {"num_cycles": 2} and data.train_file is None
    assert training.learning_rate == 1e-4  # YAML 1.1 reads 1e-4 as text, which the flag's float() takes
    assert training.num_train_epochs == 3.0 and isinstance(training.num_train_epochs, float)
    assert training.focal_alpha == [0.25, 1.0] and data.label_all_tokens is True
    assert training.save_strategy == "no" and training.resume_from_checkpoint == "true"


def test_non_finite_float_flag_is_refused_on_the_command_line(capsys):
    # It used to reach the optimizer: torch's "Invalid learning rate: nan", a traceback.
    with pytest.raises(SystemExit) as info:
        parse_recipe_args(NER_TYPES, "ner", argv=["--learning_rate", "nan"])
    assert info.value.code == 2
    assert (
        last_error_line(capsys)
        == "ner.py: error: argument --learning_rate/--learning-rate: invalid float value: 'nan' (see ner.py --help)"
    )


def test_start_recipe_sets_the_seed_and_guards_the_output_dir(tmp_path):
    out = tmp_path / "out"
    start_recipe(NER_TYPES, "ner", argv=["--seed", "123", "--output_dir", str(out)], description=None)
    drawn = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(drawn, torch.rand(4))
    out.mkdir(exist_ok=True)  # the first start locked (and so created) the folder
    (out / "all_results.json").write_text("{}")
    with pytest.raises(DataError, match="holds the results of an earlier run"):
        start_recipe(NER_TYPES, "ner", argv=["--output_dir", str(out)], description=None)
    start_recipe(NER_TYPES, "ner", argv=["--output_dir", str(out), "--overwrite_output_dir", "true"], description=None)
    assert not (out / "all_results.json").exists()


@pytest.mark.parametrize("resumes", [True, False])
def test_start_recipe_keeps_checkpoints_only_for_a_recipe_that_resumes(tmp_path, resumes):
    (tmp_path / "checkpoint-2").mkdir()
    argv = ["--output_dir", str(tmp_path), "--resume_from_checkpoint", "true"]
    if resumes:
        start_recipe(NER_TYPES, "ner", argv=argv, description=None, resumes=resumes)
        assert (tmp_path / "checkpoint-2").is_dir()
    else:  # self-training: --resume_from_checkpoint does not make a folder of results its own
        with pytest.raises(DataError, match=r"holds the results of an earlier run \(checkpoint-2\)"):
            start_recipe(NER_TYPES, "ner", argv=argv, description=None, resumes=resumes)


def test_start_recipe_keeps_a_saved_crf_only_where_asked(tmp_path):
    model = tmp_path / "crf_model"
    model.mkdir()
    (model / "config.json").write_text('{"crf": true}')
    argv = ["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "out")]
    *_, training = start_recipe(
        NER_TYPES, "ner", argv=argv, description=None, saved_crf_models=("model_name_or_path",)
    )
    assert training.crf is True
    with pytest.raises(DataError, match="was trained with a CRF"):
        start_recipe(
            NER_TYPES,
            "ner",
            argv=[*argv, "--crf", "false"],
            description=None,
            saved_crf_models=("model_name_or_path",),
        )
    *_, plain = start_recipe(NER_TYPES, "ner", argv=argv, description=None)  # classification's start: no CRF
    assert plain.crf is False


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
