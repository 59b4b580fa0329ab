"""Real files and real workflows through the recipes: labels keep their identity, a saved CRF stays a CRF, sample
counts are checked, `--help` is grouped and argument errors are one line."""

import json

from recipe_helpers import run_in_process, tiny_args, write_csv


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
