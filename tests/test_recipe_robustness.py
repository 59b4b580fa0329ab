"""Real files and real workflows through the recipes: labels keep their identity, a saved CRF stays a CRF, sample
counts are checked, `--help` is grouped and argument errors are one line."""

import ast
import dataclasses
import json

import pytest
import transformers
from packaging.version import Version

from nlp_tricks.runtime import upstream as _upstream
from recipe_helpers import ROOT, run_in_process, tiny_args, write_csv


def last_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


def test_section_codes_and_zero_padded_labels_are_classes_of_their_own(tiny_model, tmp_path, monkeypatch):
    codes = ["1.1", "1.10", "2.1", "01", "1"]
    rows = [(f"the cat {'sat ' * i}", code) for i, code in enumerate(codes)] * 3
    write_csv(tmp_path / "train.csv", rows)
    write_csv(tmp_path / "test.csv", [("the cat", "1.10"), ("a dog", "01")])
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]
    # One weight per class, in the order the labels are listed (their numeric values: 01 and 1 are both 1).
    weights = ["--class_weights", "1", "2", "3", "4", "5"]
    assert run_in_process("classification", tiny_args(tiny_model, out, *files, *weights), monkeypatch) == 0
    expected = ["01", "1", "1.1", "1.10", "2.1"]
    assert json.loads((out / "all_results.json").read_text())["label_list"] == expected
    assert json.loads((out / "config.json").read_text())["id2label"] == {str(i): v for i, v in enumerate(expected)}
    written = (out / "test_predictions.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in written[1:]] == ["1.10", "01"]


RECIPES = ("ner", "classification", "summarization", "self_training", "pretraining")


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_opens_with_a_description_and_groups_the_flags(recipe, monkeypatch, capsys):
    assert run_in_process(recipe, ["--help"], monkeypatch) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == f"usage: {recipe}.py [CONFIG.yaml] [--FLAG VALUE ...]"
    docstring = ast.get_docstring(ast.parse((ROOT / "recipes" / f"{recipe}.py").read_text()))
    assert lines[2] == docstring.splitlines()[0]  # the recipe's own description, right under the usage line
    assert f"recipes/{recipe}.py" in text[: text.index("\noptions:")]  # the command lines come first
    titles = [line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert (
        titles[0] == "options" and titles[1] == "data" and "model" in titles and titles[-2:] == ["tricks", "Trainer"]
    )

    def group_of(flag: str) -> str:
        position = text.index(f"\n  --{flag} ")
        return max(
            (text.rindex(f"\n{title}:\n", 0, position), title)
            for title in titles
            if f"\n{title}:\n" in text[:position]
        )[1]

    assert group_of("train_file") == "data" and group_of("model_name_or_path") == "model"
    # warmup_ratio is TricksArguments' own where upstream dropped it (transformers 5.x before that still has it).
    upstream_fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert group_of("warmup_ratio") == ("Trainer" if "warmup_ratio" in upstream_fields else "tricks")
    assert group_of("loss_type") == "tricks"
    assert group_of("learning_rate") == "Trainer" and group_of("seed") == "Trainer"
    # Only -h is left in argparse's flat "options" list.
    options = text[text.index("\noptions:\n") : text.index("\ndata:\n")]
    assert options.count("\n  -") == 1


def test_an_argument_error_is_one_line_without_the_usage_block(monkeypatch, capsys):
    assert run_in_process("ner", ["--max_steps", "x"], monkeypatch) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ner.py: error: argument --max_steps/--max-steps: invalid int value: 'x' (see ner.py --help)"
    ]


@pytest.mark.parametrize(
    "recipe,flag,value",
    [
        ("classification", "max_train_samples", "-5"),
        ("classification", "max_train_samples", "0"),
        ("ner", "max_eval_samples", "-1"),
        ("ner", "max_eval_samples", "0"),
        ("self_training", "max_unlabeled_samples", "0"),
    ],
)
def test_sample_counts_must_be_at_least_one(recipe, flag, value, tiny_model, tmp_path, monkeypatch, capsys):
    extra = ["--unlabeled_fraction", "0.5"] if recipe == "self_training" else []
    args = tiny_args(tiny_model, tmp_path / "out", f"--{flag}", value, *extra)
    assert run_in_process(recipe, args, monkeypatch) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{recipe}.py: error: {flag}={value} is not allowed; it must be >= 1 (leave it out to keep every example) "
        f"(see {recipe}.py --help)"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(
    Version(transformers.__version__) < Version(_upstream.CRF_LOADING_SINCE),
    reason=f"load_crf_model needs transformers >= {_upstream.CRF_LOADING_SINCE}",
)
def test_a_model_trained_with_a_crf_predicts_with_it_without_the_flag(tiny_model, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    from recipe_helpers import TEST_CONLL, ner_files

    files = ner_files(tmp_path, validate=False)
    trained = tmp_path / "trained"
    assert run_in_process("ner", tiny_args(tiny_model, trained, *files, "--crf", "true"), monkeypatch) == 0
    # CRF scores that force one tag everywhere (not what the emissions' argmax gives): Viterbi must follow them.
    weights = load_file(str(trained / "model.safetensors"))
    forced = json.loads((trained / "config.json").read_text())["label2id"]["B-LOC"]
    weights["crf.start_transitions"][forced] = 1e3
    weights["crf.transitions"][:, forced] = 1e3
    save_file(weights, str(trained / "model.safetensors"), metadata={"format": "pt"})

    again = tmp_path / "again"
    assert run_in_process("ner", tiny_args(str(trained), again, *files, "--do_train", "false"), monkeypatch) == 0
    predicted = [line.split("\t")[2] for line in (again / "test_predictions.txt").read_text().splitlines() if line]
    assert predicted == ["B-LOC"] * len(TEST_CONLL.strip().replace("\n\n", "\n").splitlines())

    args = tiny_args(str(trained), tmp_path / "refused", *files, "--do_train", "false", "--crf", "false")
    assert run_in_process("ner", args, monkeypatch) == 1
    assert last_line(capsys) == (
        f"--model_name_or_path {trained} was trained with a CRF and predicts with it (Viterbi); drop --crf false"
    )
