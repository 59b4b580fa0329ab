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


# ---- A model whose weights do not load: one line, exit 1 (formerly a traceback) -----------------------------------


class _Payload:
    """Pickled as a call of ``os.system``: unpickling it would run the command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


def _damaged_model(tiny_model: str, tmp_path, damage: str) -> tuple[str, str]:
    """A copy of the tiny BERT folder, damaged: its weights a pickle that runs code when unpickled, its safetensors
    file cut in half, or a config that needs the folder's own code; the model flag and the expected problem."""
    import shutil

    import torch

    folder = tmp_path / damage
    shutil.copytree(tiny_model, folder)
    weights = folder / "model.safetensors"
    if damage == "pickle":
        weights.unlink()
        torch.save({"weight": _Payload(f"touch {tmp_path / 'code_ran'}")}, folder / "pytorch_model.bin")
        return str(folder), (
            "refused to load pytorch_model.bin: it needs arbitrary unpickling, which can run any code the file "
            "carries (only tensors are loaded: torch.load(weights_only=True)); if you trust it, convert it to "
            "safetensors"
        )
    if damage == "truncated":
        size = weights.stat().st_size
        with open(weights, "r+b") as f:
            f.truncate(size // 2)
        return str(folder), f"cannot load its weights: model.safetensors is truncated ({size // 2} bytes, its header"
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="custom-bert", auto_map={"AutoConfig": "custom.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"open({str(tmp_path / 'code_ran')!r}, 'w').close()\n")
    return str(folder), (
        "the model needs its own code (Python files beside its config), which runs only with --trust_remote_code "
        "true; pass it if you trust that code"
    )


def _data_flags(recipe: str, tmp_path) -> list[str]:
    from recipe_helpers import CLS_ROWS, ner_files

    if recipe in ("ner", "self_training"):
        unlabeled = ["--unlabeled_fraction", "0.5"] if recipe == "self_training" else []
        return ner_files(tmp_path, predict=False) + unlabeled
    if recipe == "classification":
        write_csv(tmp_path / "train.csv", CLS_ROWS)
        return ["--train_file", str(tmp_path / "train.csv")]
    if recipe == "summarization":
        (tmp_path / "train.tsv").write_text("text\tsummary\n" + "\n".join(f"{t}\t{t}" for t, _ in CLS_ROWS))
        return ["--train_file", str(tmp_path / "train.tsv")]
    (tmp_path / "train.txt").write_text("\n".join(t for t, _ in CLS_ROWS))
    return ["--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "train.txt")]


def _assert_one_load_line(stderr: str, model: str, problem: str, tmp_path) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith(f"--model_name_or_path {model}: ")]
    assert len(lines) == 1 and lines[0].startswith(f"--model_name_or_path {model}: {problem}"), stderr[-3000:]
    assert not (tmp_path / "code_ran").exists()  # neither the pickle's payload nor the folder's code ran
    assert not (tmp_path / "out" / "all_results.json").exists()


def test_a_model_whose_weights_do_not_load_is_one_line_and_exit_1(tiny_model, tmp_path):
    """A recipe process (classification) given a pickle that would run code, formerly ending in a traceback (the
    other damages in this process, below: a process start is seconds)."""
    damage = "pickle"
    from recipe_helpers import launch_script

    model, problem = _damaged_model(tiny_model, tmp_path, damage)
    args = tiny_args(model, tmp_path / "out", *_data_flags("classification", tmp_path))
    proc = launch_script(ROOT / "recipes" / "classification.py", args, launcher="python")
    assert proc.returncode == 1, proc.stderr[-3000:]
    _assert_one_load_line(proc.stderr, model, problem, tmp_path)


# The other damages and recipes, each with the damage its own loading path meets first (summarization: BERT2BERT's
# encoder-decoder loader; pretraining: the masked LM's; self-training: its rounds' classifier), in this process.
@pytest.mark.parametrize(
    "recipe, damage",
    [("classification", "truncated"), ("classification", "remote_code"), ("ner", "truncated"),
     ("summarization", "pickle"), ("summarization", "truncated"), ("pretraining", "pickle"),
     ("self_training", "pickle"), ("self_training", "remote_code")],
)  # fmt: skip
def test_every_recipe_refuses_weights_that_do_not_load_in_one_line(recipe, damage, tiny_model, tmp_path, monkeypatch,
                                                                    capsys):  # fmt: skip
    model, problem = _damaged_model(tiny_model, tmp_path, damage)
    args = tiny_args(model, tmp_path / "out", *_data_flags(recipe, tmp_path))
    assert run_in_process(recipe, args, monkeypatch) == 1
    _assert_one_load_line(capsys.readouterr().err, model, problem, tmp_path)
