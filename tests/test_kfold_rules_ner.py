"""NER decision rules and teachers of `recipes/kfold.py` on tiny models: a per-type bias on a CRF's emissions and
per-type thresholds of a span head, fitted on out-of-fold rows, checked against Viterbi by enumeration and nested
decoding by looping, applied when the folder predicts; a greedy soup selected on the held-out folds; the NER recipe
distilling a teacher that cuts words into other sub-tokens."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kfold import NER_TRAIN, _token_classifier, ner_columns, run_here, seqeval_scores, tiny_flags
from test_kfold_members import predict_through

from recipe_helpers import TEST_CONLL, run_in_process
from tiny import needs_crf_loading

import kfold
from ensemble_folder import TASKS


def brute_force_path(emissions, start, transitions, end) -> list[int]:
    def score(path):
        s = start[path[0]] + end[path[-1]] + sum(emissions[t, y] for t, y in enumerate(path))
        return s + sum(transitions[a, b] for a, b in zip(path, path[1:]))

    return list(max(itertools.product(range(emissions.shape[1]), repeat=len(emissions)), key=score))


@needs_crf_loading
def test_crf_type_bias_fitted_out_of_fold_and_applied_by_the_folder(tiny_model, tmp_path, monkeypatch):
    from kfold_rules import fit_params, read_oof, tag_bias

    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    out = tmp_path / "kf"
    data = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    argv = [
        "--recipe",
        "ner",
        "--folds",
        "2",
        "--fit_rule",
        "bias",
        "--soup",
        "greedy",
        "--output_dir",
        str(out),
        "--",
        *tiny_flags(tiny_model),
        *data,
    ]
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    rule = json.loads((out / "decision_rule.json").read_text())
    labels = results["label_list"]
    assert rule["rules"] == ["bias"] and len(rule["type_bias"]) == 3  # LOC, ORG, PER

    # The cross-fitted out-of-fold tags: each sentence's own fold CRF, its emissions shifted by the bias fitted on
    # the other fold's rows (recomputed here), decoded by enumerating every path.
    data_args = TASKS["ner"].parse(["--train_file", str(tmp_path / "train.conll")])[0]
    inputs, gold, fold_of = read_oof(out, TASKS["ner"], labels, data_args)
    oof = ner_columns(out / "rule" / "oof_predictions.txt")
    for fold in range(2):
        others = np.flatnonzero(fold_of != fold)
        params = fit_params(inputs.subset(others), [gold[i] for i in others], labels, ["bias"], 1.0, False)
        shift = tag_bias(labels, params["type_bias"])
        for i in np.flatnonzero(fold_of == fold):
            start, transitions, end = inputs.potentials[fold]
            path = brute_force_path(inputs.rows[i] + shift, start, transitions, end)
            assert [p for _, _, p in oof[i]] == [labels[y] for y in path], i
    assert results["rule_oof_f1"] == pytest.approx(seqeval_scores(out / "rule" / "oof_predictions.txt")["f1"])

    # The folder predicts with its rule: what DIR/rule/ holds.
    predicted = predict_through(
        "ner", str(out), str(tmp_path / "test.conll"), tmp_path / "predicted", monkeypatch, batch="2"
    )
    assert (predicted / "test_predictions.txt").read_text() == (out / "rule" / "test_predictions.txt").read_text()
    assert results["rule_test_f1"] == json.loads((predicted / "all_results.json").read_text())["test_f1"]

    # The greedy soup of the CRF folds, selected on the training rows (no validation file): a CRF model.
    info = json.loads((out / "soup" / "soup.json").read_text())
    assert info["selection"].startswith("the training rows") and info["selection_score"] >= max(info["member_scores"])
    assert json.loads((out / "soup" / "config.json").read_text())["crf"] is True
    assert results["soup_test_f1"] == pytest.approx(seqeval_scores(out / "soup" / "test_predictions.txt")["f1"])


def test_span_thresholds_fitted_out_of_fold(tiny_model, tmp_path, monkeypatch):
    from kfold_rules import fit_params, read_oof

    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    out = tmp_path / "kf"
    data = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    argv = [
        "--recipe",
        "ner",
        "--folds",
        "2",
        "--fit_rule",
        "threshold",
        "--output_dir",
        str(out),
        "--",
        *tiny_flags(tiny_model),
        "--span_head",
        "global_pointer",
        "--span_head_size",
        "16",
        *data,
    ]
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    types = results["label_list"]
    rule = json.loads((out / "decision_rule.json").read_text())
    assert rule["rules"] == ["threshold"] and len(rule["thresholds"]) == len(types)
    task = kfold.NerSpanEnsembleTask(False)
    data_args = TASKS["ner"].parse(["--train_file", str(tmp_path / "train.conll")])[0]
    inputs, gold, fold_of = read_oof(out, task, types, data_args)
    records = [json.loads(line) for line in (out / "rule" / "oof_predictions.jsonl").read_text().splitlines()]
    for fold in range(2):
        others = np.flatnonzero(fold_of != fold)
        thresholds = fit_params(inputs.subset(others), [gold[i] for i in others], types, ["threshold"], 1.0, False)
        for i in np.flatnonzero(fold_of == fold):
            scores = inputs.rows[i]
            want = sorted(
                (
                    (types[t], a, b + 1)
                    for t in range(len(types))
                    for a in range(scores.shape[1])
                    for b in range(a, scores.shape[1])
                    if scores[t, a, b] > thresholds["thresholds"][t]
                ),
                key=lambda s: (s[1], s[2], s[0]),
            )
            got = sorted(
                ((e["type"], e["start"], e["end"]) for e in records[i]["entities"]), key=lambda s: (s[1], s[2], s[0])
            )
            assert got == want, i
    predicted = predict_through(
        "ner", str(out), str(tmp_path / "test.conll"), tmp_path / "predicted", monkeypatch, batch="2"
    )
    assert (predicted / "test_predictions.jsonl").read_text() == (out / "rule" / "test_predictions.jsonl").read_text()


def test_ner_recipe_distils_a_teacher_with_another_tokenizer(tiny_model, tmp_path, monkeypatch):
    """--teacher on recipes/ner.py: each word's soft target is the teacher's softmax at its own first sub-token
    (a character tokenizer: every word several sub-tokens), and the CRF is off by default with it."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from teacher import soft_targets

    labels = ["B-LOC", "B-ORG", "B-PER", "O"]
    teacher = _token_classifier(tmp_path / "teacher", labels, chars=True)
    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    rows = [{"tokens": "john works at acme".split()}, {"tokens": "mary ran in paris".split()}]
    args = TASKS["ner"].parse(["--train_file", str(tmp_path / "train.conll"), "--output_dir", str(tmp_path / "s")])
    targets, info = soft_targets(teacher, "ner", rows, labels, *args)
    model = AutoModelForTokenClassification.from_pretrained(teacher).eval()
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    for row, target in zip(rows, targets):
        encoding = tokenizer(row["tokens"], is_split_into_words=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(**encoding).logits[0].double()
        first = [encoding.word_ids().index(w) for w in range(len(row["tokens"]))]
        assert first != list(range(1, len(row["tokens"]) + 1))  # words of several sub-tokens
        np.testing.assert_allclose(target, torch.softmax(logits[first], -1).numpy(), rtol=1e-5, atol=1e-6)
    out = tmp_path / "student"
    argv = [
        *tiny_flags(tiny_model),
        "--output_dir",
        str(out),
        "--train_file",
        str(tmp_path / "train.conll"),
        "--test_file",
        str(tmp_path / "test.conll"),
        "--teacher",
        str(teacher),
    ]
    assert run_in_process("ner", argv, monkeypatch) == 0
    assert not json.loads((out / "config.json").read_text()).get("crf")
    assert Path(out / "all_results.json").is_file()
    assert (
        run_in_process(
            "ner",
            [*argv[:-2], "--teacher", str(teacher), "--crf", "true", "--output_dir", str(tmp_path / "o2")],
            monkeypatch,
        )
        == 1
    )
