"""The recipes with --crf, --class_weights and multi-sample dropout: Viterbi metrics, the CRF saved and loaded back,
balanced weights from the training labels, one-line errors."""

import json
from collections import Counter

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file
from seqeval.metrics import f1_score, precision_score
from transformers import AutoTokenizer

from nlp_tricks.functional.crf import CRF, load_crf_model
from nlp_tricks.runtime import upstream as _upstream
from nlp_tricks.self_training import ner_pseudo_labels
from nlp_tricks.tricks.loss_type import LossFunction
from recipe_helpers import TRAIN_CONLL, ner_files, run_in_process, tiny_args


def last_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


def _viterbi_tags(model_dir, words_per_sentence):
    """The CRF's paths over the test sentences, computed here from the saved model (one word = first sub-token)."""
    model = load_crf_model(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    id2label = model.config.id2label
    paths = []
    for words in words_per_sentence:
        enc = tokenizer(words, is_split_into_words=True, return_tensors="pt")
        word_ids = enc.word_ids(0)
        first = [i for i, w in enumerate(word_ids) if w is not None and w not in word_ids[:i]]
        mask = torch.zeros(1, len(word_ids), dtype=torch.bool)
        mask[0, first] = True
        with torch.no_grad():
            logits = model(**enc).logits
        paths.append([id2label[t] for t in model.crf.decode(logits, mask)[0]])
    return paths


def _predictions(path):
    sentences = [block.splitlines() for block in path.read_text().split("\n\n") if block.strip()]
    return [[line.split("\t") for line in block] for block in sentences]


@pytest.mark.skipif(
    Version(transformers.__version__) < Version(_upstream.CRF_LOADING_SINCE),
    reason=f"load_crf_model needs transformers >= {_upstream.CRF_LOADING_SINCE}",
)
def test_ner_crf_metrics_come_from_viterbi_paths_and_the_model_loads_back(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    flags = ["--crf", "true", "--crf_bio_constraints", "true", "--max_steps", "4"]
    assert run_in_process("ner", tiny_args(tiny_model, out, *ner_files(tmp_path), *flags), monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    assert {"crf.transitions", "crf.start_transitions", "crf.end_transitions", "crf.allowed_transitions"} <= set(
        weights
    )
    assert json.loads((out / "config.json").read_text())["crf"] is True

    rows = _predictions(out / "test_predictions.txt")
    expected = _viterbi_tags(out, [[r[0] for r in sentence] for sentence in rows])
    assert [[r[2] for r in sentence] for sentence in rows] == expected
    gold = [[r[1] for r in sentence] for sentence in rows]
    assert results["test_f1"] == f1_score(gold, expected)
    assert results["test_precision"] == precision_score(gold, expected)

    # The trained folder as --model_name_or_path: the CRF comes back (config.crf) and predicts the same paths.
    again = tmp_path / "again"
    args = tiny_args(str(out), again, *ner_files(tmp_path), "--crf", "true", "--do_train", "false")
    assert run_in_process("ner", args, monkeypatch) == 0
    assert (again / "test_predictions.txt").read_text() == (out / "test_predictions.txt").read_text()

    # A CRF whose scores force "O" everywhere: the predictions follow it, not the logits' argmax.
    o = json.loads((out / "config.json").read_text())["label2id"]["O"]
    weights["crf.start_transitions"][o] = 1e3
    weights["crf.transitions"][:, o] = 1e3
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    forced = tmp_path / "forced"
    args = tiny_args(str(out), forced, *ner_files(tmp_path), "--crf", "true", "--do_train", "false")
    assert run_in_process("ner", args, monkeypatch) == 0
    assert {r[2] for sentence in _predictions(forced / "test_predictions.txt") for r in sentence} == {"O"}
    assert json.loads((forced / "all_results.json").read_text())["test_f1"] == 0.0


def test_ner_balanced_class_weights_come_from_the_training_tags(tiny_model, tmp_path, monkeypatch):
    resolved = []
    original = LossFunction.resolve_class_weights

    def spy(self, trainer):
        resolved.append(original(self, trainer))
        return resolved[-1]

    monkeypatch.setattr(LossFunction, "resolve_class_weights", spy)
    args = tiny_args(tiny_model, tmp_path / "out", *ner_files(tmp_path), "--class_weights", "balanced")
    assert run_in_process("ner", args, monkeypatch) == 0
    tags = [line.split()[-1] for line in TRAIN_CONLL.splitlines()[1:] if line.strip()]
    counts = Counter(tags)
    labels = sorted(counts)  # the recipe's label order
    expected = [len(tags) / (len(labels) * counts[label]) for label in labels]
    torch.testing.assert_close(resolved[0], torch.tensor(expected))


def test_ner_multi_sample_dropout_runs(tiny_model, tmp_path, monkeypatch):
    flags = ["--head_dropout_samples", "3", "--head_dropout", "0.5"]
    assert (
        run_in_process("ner", tiny_args(tiny_model, tmp_path / "out", *ner_files(tmp_path), *flags), monkeypatch) == 0
    )


def test_class_weights_of_the_wrong_length_are_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    args = tiny_args(tiny_model, tmp_path / "out", *ner_files(tmp_path), "--class_weights", "1", "2")
    assert run_in_process("ner", args, monkeypatch) == 1
    line = last_line(capsys)
    assert line.startswith("--class_weights: 2 weights for 4 classes") and "0=B-LOC, 1=B-ORG, 2=B-PER, 3=O" in line


def test_iob1_tags_train_with_bio_constraints_and_are_written_back_as_iob1(tiny_model, tmp_path, monkeypatch):
    # CoNLL-2003's original IOB1: I- opens an entity, B- only right after one of its type. The model trains on the
    # IOB2 tags of the same entities, so the BIO constraints fit; the predictions are written back as IOB1.
    iob1 = "John I-PER\nSmith I-PER\nMary B-PER\nran O\n\nin O\nRome I-LOC\n"
    (tmp_path / "train.conll").write_text(iob1)
    (tmp_path / "test.conll").write_text(iob1)
    files = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, *files, "--crf", "true", "--crf_bio_constraints", "true")
    assert run_in_process("ner", args, monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert results["label_list"] == ["B-LOC", "B-PER", "I-PER", "O"]
    rows = [line.split("\t") for line in (out / "test_predictions.txt").read_text().splitlines() if line]
    assert [gold for _, gold, _ in rows] == ["I-PER", "I-PER", "B-PER", "O", "O", "I-LOC"]
    predicted = [pred for _, _, pred in rows]
    # IOB1: a B- tag only right after an entity of its type.
    for i, tag in enumerate(predicted):
        if tag.startswith("B-"):
            assert i not in (0, 4) and predicted[i - 1][2:] == tag[2:], predicted


# ---- Self-training ------------------------------------------------------------------------------------------------


def test_ner_pseudo_labels_follow_the_teachers_crf():
    # [CLS] w0 w0' w1 w2 [SEP] (w0' a continuation): the argmax says 0, 0, 1; a CRF that only allows tag 1 after tag 1
    # and starts with 1 labels every word 1.
    logits = np.array([[0, 0], [3, 0], [0, 9], [2, 0], [0, 1], [0, 0]], dtype=np.float32)
    word_ids = [None, 0, 0, 1, 2, None]
    assert ner_pseudo_labels([logits], [word_ids]).labels == [[0, 0, 1]]
    crf = CRF(2).set_constraints(torch.tensor([False, True]), torch.tensor([[True, True], [False, True]]))
    pseudo = ner_pseudo_labels([logits], [word_ids], crf=crf)
    assert pseudo.labels == [[1, 1, 1]] == [crf.decode(torch.from_numpy(logits[[1, 3, 4]])[None])[0]]
    assert pseudo.confidence[0] == pytest.approx(ner_pseudo_labels([logits], [word_ids]).confidence[0])


def test_self_training_ner_with_crf(tiny_model, tmp_path, monkeypatch, capsys):
    files = ner_files(tmp_path)
    (tmp_path / "raw.conll").write_text("Mary\nworks\n\nthe\ncat\nsat\n")
    files += ["--unlabeled_file", str(tmp_path / "raw.conll")]
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, "--task", "ner", *files, "--crf", "true")
    assert run_in_process("self_training", args, monkeypatch) == 0
    results = json.loads((out / "self_training_results.json").read_text())
    assert results["rounds"][0]["pseudo_labels"]["kept"] == 2
    assert "crf.transitions" in load_file(str(out / "round_1" / "student" / "model.safetensors"))
    soft = tiny_args(tiny_model, tmp_path / "soft", "--task", "ner", *files, "--crf", "true", "--soft_labels", "true")
    assert run_in_process("self_training", soft, monkeypatch) == 1
    assert last_line(capsys).startswith("--soft_labels true distils per-token logits")
