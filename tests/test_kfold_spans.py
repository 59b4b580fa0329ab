"""`recipes/kfold.py` with a span head (GlobalPointer) on tiny models: the ensemble is the mean of the fold models'
word-level span scores, decoded once as they were trained (flat: the best non-overlapping set; nested: every span
above 0), checked against the scores computed here from each saved fold model, averaged by hand and decoded by brute
force; the out-of-fold and test predictions in the span recipe's JSON-lines format with every number equal to
rescoring them; `--ensemble_vote` on spans; the ensemble folder predicting through `recipes/ner.py`; fold-wise
pseudo-labels; and the settings a span model cannot take refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from seqeval.metrics import f1_score, precision_score, recall_score
from test_kfold import NER_TRAIN, RAN, check_oof_coverage, ner_columns, read_ids, run_here, tiny_flags
from transformers import AutoTokenizer

from nlp_tricks import load_span_model
from nlp_tricks.functional.spans import span_scores
from recipe_helpers import NESTED, TEST_CONLL, run_in_process, write_jsonl

import kfold

# A small learning rate: the fresh heads' positive spans remain, so there are entities to average and decode.
SPAN_FLAGS = ["--span_head_size", "16", "--learning_rate", "1e-5"]
# Nested entities (GPE only in the first sentence: the fold that holds it out trains without it), one span of two
# types, a sentence without entities.
NESTED_TRAIN = [*NESTED, {"tokens": "john ran".split(), "entities": [{"start": 0, "end": 1, "type": "PER"}]}]
NESTED_TEST = [
    {"tokens": "mary works at acme in paris".split(), "entities": [
        {"start": 0, "end": 1, "type": "PER"}, {"start": 3, "end": 6, "type": "ORG"},
        {"start": 5, "end": 6, "type": "LOC"}]},
    {"tokens": "the dog sat".split(), "entities": []},
]  # fmt: skip
RAW_TEXT = "the cat sat in london\njohn works at google\n"
# More test sentences than recipe_helpers' two, so that flat decisions of the mean and of each fold can differ.
FLAT_TEST = TEST_CONLL + "".join(
    "\n" + "".join(f"{word}\t{tag}\n" for word, tag in zip(words.split(), tags.split()))
    for words, tags in (
        ("john works at acme in new york", "B-PER O O B-ORG O B-LOC I-LOC"),
        ("a dog ran in paris", "O O O O B-LOC"),
        ("mary sat on the mat in london", "B-PER O O O O O B-LOC"),
    )
)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _spans(entities) -> list[tuple]:
    return sorted(((e["type"], e["start"], e["end"]) for e in entities), key=lambda s: (s[1], s[2], s[0]))


def word_scores(model_dir: Path, sentences: list[list[str]]) -> list[np.ndarray]:
    """Each sentence's ``(T, W, W)`` span scores under a saved fold model, computed here one sentence at a time
    (float64; the tiny tokenizer gives every word one sub-token)."""
    model = load_span_model(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for words in sentences:
        encoding = tokenizer(words, is_split_into_words=True, return_tensors="pt")
        word_ids = encoding.word_ids()
        first = [word_ids.index(w) for w in range(len(words))]
        with torch.no_grad():
            scores = span_scores(model, model(**encoding).logits, torch.tensor([first]))[0]
        out.append(scores.double().numpy())
    return out


def positive_spans(scores: np.ndarray, types: list[str]) -> list[tuple]:
    """Every (type, start, end exclusive) whose score is > 0, by looping over all of them."""
    num_types, width, _ = scores.shape
    found = [
        (types[t], i, j + 1)
        for t in range(num_types)
        for i in range(width)
        for j in range(i, width)
        if scores[t, i, j] > 0
    ]
    return sorted(found, key=lambda s: (s[1], s[2], s[0]))


def best_flat_labelling(scores: np.ndarray, types: list[str]) -> list[tuple]:
    """Of every flat labelling of the words by spans scoring > 0 (each word in at most one span), the one with the
    highest total score: all of them enumerated."""
    num_types, width, _ = scores.shape

    def labellings(start):
        if start >= width:
            yield 0.0, []
            return
        yield from labellings(start + 1)  # word `start` outside every entity
        for t in range(num_types):
            for end in range(start + 1, width + 1):
                if scores[t, start, end - 1] > 0:
                    for total, rest in labellings(end):
                        yield total + scores[t, start, end - 1], [(types[t], start, end), *rest]

    return max(labellings(0), key=lambda labelling: labelling[0])[1]


def prf(predicted: list[list[tuple]], gold: list[list[tuple]]) -> dict:
    """Exact-span precision / recall / F1 by counting."""
    hits = sum(len(set(p) & set(g)) for p, g in zip(predicted, gold))
    n_pred, n_gold = sum(map(len, predicted)), sum(map(len, gold))
    precision = hits / n_pred if n_pred else 0.0
    recall = hits / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def disagree(out: Path, argv: list[str]) -> None:
    """Make fold 1 disagree with fold 0, then run the k-fold command again (nothing is retrained: the ensemble files
    are recomputed from the saved fold models). Fold models of 2 steps from one start barely differ, so an ensemble
    could not be told from its members; seeded noise of the head's own size on fold 1's head changes that."""
    path = out / "fold1" / "model.safetensors"
    weights = load_file(str(path))
    generator = torch.Generator().manual_seed(0)
    for key in [k for k in weights if k.startswith("classifier.") and k.endswith("weight")]:
        weight = weights[key]
        weights[key] = weight + weight.std() * torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
    save_file(weights, str(path), metadata={"format": "pt"})
    RAN.clear()
    assert kfold.main(argv, run=run_here) == 0
    assert RAN == []


def kfold_argv(out: Path, model: str, *extra: str, runner: tuple = ()) -> list[str]:
    return ["--recipe", "ner", "--folds", "2", "--output_dir", str(out), *runner, "--", *tiny_flags(model),
            *SPAN_FLAGS, *extra]  # fmt: skip


def test_kfold_flat_span_models_average_scores_decode_once_vote_and_predict_as_a_folder(
    tiny_model, tmp_path, monkeypatch
):
    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(FLAT_TEST)
    out = tmp_path / "kf"
    data = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    argv = kfold_argv(out, tiny_model, "--span_head", "global_pointer", "--span_flat", "true", *data)
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    fold_of = check_oof_coverage(out, 2)
    types = results["label_list"]
    assert types == ["LOC", "ORG", "PER"]
    for k in range(2):
        config = json.loads((out / f"fold{k}" / "config.json").read_text())
        assert (config["span_head"], config["span_flat"]) == ("global_pointer", True)
        assert [config["id2label"][str(i)] for i in range(3)] == types
    assert results["ensemble_rule"].startswith("mean of the folds' span scores")

    # Each fold's own test predictions (its run's) are its scores, computed here, decoded alone; out of fold, each
    # training sentence is predicted by the fold model that held it out, decoded alone.
    test = _read(out / "test_predictions.jsonl")
    sentences = [r["tokens"] for r in test]
    for k in range(2):
        own = _read(out / f"fold{k}" / "test_predictions.jsonl")
        assert [_spans(r["entities"]) for r in own] == [best_flat_labelling(s, types) for s in word_scores(
            out / f"fold{k}", sentences)]  # fmt: skip
    oof = _read(out / "oof_predictions.jsonl")
    by_fold = [word_scores(out / f"fold{k}", [r["tokens"] for r in oof]) for k in range(2)]
    for i, record in enumerate(oof):
        assert _spans(record["entities"]) == best_flat_labelling(by_fold[fold_of[i]][i], types), i

    # Every number equals rescoring the written files: seqeval on the IOB2 files, counting on the JSON lines.
    for prefix in ("oof", "test"):
        rows = ner_columns(out / f"{prefix}_predictions.txt")
        gold, pred = [[r[1] for r in s] for s in rows], [[r[2] for r in s] for s in rows]
        assert results[f"{prefix}_f1"] == pytest.approx(f1_score(gold, pred), abs=1e-12)
        assert results[f"{prefix}_precision"] == pytest.approx(precision_score(gold, pred), abs=1e-12)
        assert results[f"{prefix}_recall"] == pytest.approx(recall_score(gold, pred), abs=1e-12)
        records = _read(out / f"{prefix}_predictions.jsonl")
        counted = prf([_spans(r["entities"]) for r in records], [_spans(r["gold_entities"]) for r in records])
        for key, value in counted.items():
            assert results[f"{prefix}_{key}"] == pytest.approx(value, abs=1e-12)
    for k in range(2):
        own = json.loads((out / f"fold{k}" / "all_results.json").read_text())
        assert results["fold_test_f1"][k] == own["test_f1"]

    # The ensemble's entities: the mean of the two fold models' scores (computed here), best flat labelling.
    disagree(out, argv)
    test = _read(out / "test_predictions.jsonl")
    members = [word_scores(out / f"fold{k}", sentences) for k in range(2)]
    member_spans = [[best_flat_labelling(s, types) for s in m] for m in members]
    for i, record in enumerate(test):
        mean = (members[0][i] + members[1][i]) / 2
        assert _spans(record["entities"]) == best_flat_labelling(mean, types), i
    for k in range(2):  # the mean is neither fold's own decoding (so the test tells them apart)
        assert [_spans(r["entities"]) for r in test] != member_spans[k]
    assert sum(len(r["entities"]) for r in test) > 0
    results = json.loads((out / "all_results.json").read_text())

    # The folder predicts like a model: ner.py with it writes the same predictions and scores.
    predicted = tmp_path / "predicted"
    args = ["--model_name_or_path", str(out), "--do_train", "false", "--test_file", str(tmp_path / "test.conll"),
            "--output_dir", str(predicted), "--per_device_eval_batch_size", "2"]  # fmt: skip
    assert run_in_process("ner", args, monkeypatch) == 0
    for name in ("test_predictions.jsonl", "test_predictions.txt"):
        assert (predicted / name).read_text() == (out / name).read_text()
    assert json.loads((predicted / "all_results.json").read_text())["test_f1"] == results["test_f1"]

    # --ensemble_vote 1: the same folds (nothing retrained); a span is kept when both folds predict it.
    RAN.clear()
    vote_argv = kfold_argv(
        out, tiny_model, "--span_head", "global_pointer", "--span_flat", "true", *data, runner=("--ensemble_vote", "1")
    )
    assert kfold.main(vote_argv, run=run_here) == 0
    assert RAN == []
    voted = _read(out / "test_predictions.jsonl")
    for i, record in enumerate(voted):
        both = set(member_spans[0][i]) & set(member_spans[1][i])
        assert _spans(record["entities"]) == sorted(both, key=lambda s: (s[1], s[2], s[0]))
    assert json.loads((out / "all_results.json").read_text())["ensemble_rule"].startswith("entity vote")
    assert json.loads((out / "kfold_ensemble.json").read_text())["ensemble_vote"] == 1

    # A member's scores are over the sentence's own words: a word cut by --max_seq_length has none (NaN), the
    # words it sees have the scores of the sentence cut there.
    from ensemble_folder import NerSpanEnsembleTask, prediction_args

    task = NerSpanEnsembleTask(flat=True)
    data_args, model_args, training_args = task.parse(
        ["--model_name_or_path", str(out / "fold0"), "--max_seq_length", "5", "--output_dir", str(tmp_path / "x")]
    )
    model, tokenizer = task.load_member(out / "fold0", model_args, types)
    words = "mary works at google in paris".split()
    output = task.predict(model, tokenizer, [{"tokens": words}], types, data_args, prediction_args(training_args, out))
    scores = output.span_scores[0]
    assert scores.shape == (3, 6, 6)  # [CLS] mary works at [SEP]: 3 words seen
    assert np.isnan(scores[:, 3:, :]).all() and np.isnan(scores[:, :, 3:]).all()
    # float32 round-off: the member's batch is padded to a multiple of 8 sub-tokens, the reference is not
    np.testing.assert_allclose(scores[:, :3, :3], word_scores(out / "fold0", [words[:3]])[0], rtol=1e-5, atol=1e-6)


def test_kfold_nested_span_models_every_type_and_fold_wise_pseudo_labels(tiny_model, tmp_path, monkeypatch):
    train = write_jsonl(tmp_path / "train.jsonl", NESTED_TRAIN)
    test = write_jsonl(tmp_path / "test.jsonl", NESTED_TEST)
    (tmp_path / "raw.txt").write_text(RAW_TEXT)
    out = tmp_path / "kf"
    argv = kfold_argv(
        out, tiny_model, "--span_head", "efficient_global_pointer", "--train_file", train, "--test_file", test,
        runner=("--unlabeled_file", str(tmp_path / "raw.txt")),
    )  # fmt: skip
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    check_oof_coverage(out, 2)
    types = ["GPE", "LOC", "ORG", "PER"]
    assert results["label_list"] == types
    # Every fold model has every type, the one whose training part lacks GPE too (--entity_types from the runner).
    fold_of = json.loads((out / "folds.json").read_text())["fold_of_example"]
    lacking = fold_of[0]  # the fold that holds out the only GPE sentence trains without it
    trained_on = json.loads((out / "round0" / f"fold{lacking}" / "all_results.json").read_text())["data_files"][
        "train"
    ]
    assert not any(e["type"] == "GPE" for r in _read(Path(trained_on)) for e in r["entities"])
    for k in range(2):
        config = json.loads((out / f"fold{k}" / "config.json").read_text())
        assert [config["id2label"][str(i)] for i in range(4)] == types and config["span_flat"] is False
    assert not (out / "test_predictions.txt").exists()  # nested: JSON lines only

    # Nested: every span whose mean score (computed here) is > 0.
    disagree(out, argv)
    results = json.loads((out / "all_results.json").read_text())
    records = _read(out / "test_predictions.jsonl")
    assert [r["tokens"] for r in records] == [r["tokens"] for r in NESTED_TEST]
    assert [_spans(r["gold_entities"]) for r in records] == [_spans(r["entities"]) for r in NESTED_TEST]
    members = [word_scores(out / f"fold{k}", [r["tokens"] for r in records]) for k in range(2)]
    for i, record in enumerate(records):
        assert _spans(record["entities"]) == positive_spans((members[0][i] + members[1][i]) / 2, types), i
    ensemble = [_spans(r["entities"]) for r in records]
    for k in range(2):  # the mean is neither fold's own decoding (so the test tells them apart)
        assert ensemble != [positive_spans(s, types) for s in members[k]]
    assert sum(map(len, ensemble)) > 0
    for prefix in ("oof", "test"):
        written = _read(out / f"{prefix}_predictions.jsonl")
        counted = prf([_spans(r["entities"]) for r in written], [_spans(r["gold_entities"]) for r in written])
        for key, value in counted.items():
            assert results[f"{prefix}_{key}"] == pytest.approx(value, abs=1e-12)

    # Pseudo-labels: fold k of round 1 learnt F labelled by fold model k of round 0 (which never saw fold k's
    # held-out part): that teacher's own nested spans, from its scores computed here.
    unlabeled = [line.split() for line in RAW_TEXT.splitlines()]
    for k in range(2):
        heldout = set(read_ids(out / "data" / f"fold{k}_heldout.jsonl"))
        provenance = json.loads((out / "data" / f"round1_fold{k}_pseudo_labels.json").read_text())
        teacher = out / provenance["teacher"]
        assert teacher == out / "round0" / f"fold{k}"
        teacher_train = json.loads((teacher / "all_results.json").read_text())["data_files"]["train"]
        assert not heldout & set(read_ids(teacher_train))
        fold_train = json.loads((out / f"fold{k}" / "all_results.json").read_text())["data_files"]["train"]
        pseudo = [r for r in _read(Path(fold_train)) if str(r["id"]).startswith("unlabeled")]
        assert [r["tokens"] for r in pseudo] == unlabeled
        teacher_scores = word_scores(teacher, unlabeled)
        assert [_spans(r["entities"]) for r in pseudo] == [positive_spans(s, types) for s in teacher_scores]

    # The round-0 folder is an ensemble too, and predicts the nested test file as it did.
    predicted = tmp_path / "predicted"
    args = ["--model_name_or_path", str(out / "round0"), "--do_train", "false", "--test_file", test,
            "--output_dir", str(predicted), "--per_device_eval_batch_size", "2"]  # fmt: skip
    assert run_in_process("ner", args, monkeypatch) == 0
    assert (predicted / "test_predictions.jsonl").read_text() == (
        out / "round0" / "test_predictions.jsonl"
    ).read_text()


@pytest.mark.parametrize(
    "runner, message",
    [
        (("--distill", "true"), "--distill true with --span_head global_pointer: a student distils per-token"),
        (("--unlabeled_file", "raw.txt", "--confidence_threshold", "0.5"), "--confidence_threshold 0.5 with --span"),
    ],
)
def test_kfold_refuses_what_a_span_model_cannot_take_in_one_line(tiny_model, tmp_path, capsys, runner, message):
    (tmp_path / "train.conll").write_text(NER_TRAIN)
    out = tmp_path / "kf"
    argv = kfold_argv(out, tiny_model, "--span_head", "global_pointer", "--train_file", str(tmp_path / "train.conll"),
                      runner=runner)  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        kfold.main(argv, run=run_here)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert message in lines[-1] and not (out / "fold0").exists()


def test_an_ensemble_of_span_and_tagging_models_is_refused_in_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    from ensemble_folder import write_manifest

    folder = tmp_path / "ensemble"
    for name, extra in (("span", ["--span_head", "global_pointer", "--span_head_size", "16"]), ("tags", [])):
        (tmp_path / "train.conll").write_text(NER_TRAIN)
        args = [
            "--tricks",
            "none",
            "--model_name_or_path",
            tiny_model,
            "--output_dir",
            str(folder / name),
            "--train_file",
            str(tmp_path / "train.conll"),
            "--max_steps",
            "1",
            "--save_strategy",
            "no",
            *extra,
        ]
        assert run_in_process("ner", args, monkeypatch) == 0  # fmt: skip
    write_manifest(folder, "ner", ["span", "tags"], ["LOC", "ORG", "PER"], None)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    args = ["--model_name_or_path", str(folder), "--do_train", "false", "--test_file", str(tmp_path / "test.conll"),
            "--output_dir", str(tmp_path / "predicted")]  # fmt: skip
    assert run_in_process("ner", args, monkeypatch) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    manifest = folder / "kfold_ensemble.json"
    assert last == f"{manifest}: the ensemble mixes members with and without a span head; train them alike"
    assert not (tmp_path / "predicted" / "all_results.json").exists()


def test_entity_types_fix_a_span_heads_types_and_refuse_in_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    from recipe_helpers import ner_files, tiny_args

    files = ner_files(tmp_path)

    def last_line(args, status):
        assert run_in_process("ner", args, monkeypatch) == status
        return capsys.readouterr().err.strip().splitlines()[-1]

    out = tmp_path / "out"
    span = ["--span_head", "global_pointer", "--span_head_size", "16", "--max_steps", "1"]
    # A type the data holds outside the given ones, by its line.
    line = last_line(tiny_args(tiny_model, out, *files, *span, "--entity_types", "PER", "LOC"), 1)
    assert (
        line == f"{tmp_path / 'train.conll'}:3: entity type 'ORG' is not one of --entity_types (types: ['LOC', 'PER'])"
    )
    # Token tagging has its own label flag; repeated names are refused as the field's values.
    line = last_line(tiny_args(tiny_model, out, *files, "--entity_types", "PER"), 1)
    assert line == "--entity_types names a span head's types; token tagging reads --tag_names"
    line = last_line(tiny_args(tiny_model, out, *files, *span, "--entity_types", "PER", "PER"), 2)
    assert "entity_types=['PER', 'PER'] is not allowed; give distinct non-empty names" in line
    # A saved span model predicts its own types: other ones are refused before anything loads.
    saved = tmp_path / "saved"
    saved.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (saved / name).write_bytes((Path(tiny_model) / name).read_bytes())
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    config.update(span_head="global_pointer", span_head_size=16, id2label={"0": "PER", "1": "LOC"})
    (saved / "config.json").write_text(json.dumps(config))
    line = last_line(tiny_args(str(saved), out, *files, "--entity_types", "LOC", "PER"), 1)
    assert line == (
        f"--entity_types LOC PER: --model_name_or_path {saved} predicts the types PER LOC (in this order); drop "
        "--entity_types or give those"
    )
    # The given order is the model's id order.
    assert run_in_process("ner", tiny_args(tiny_model, out, *files, *span, "--entity_types", "PER", "ORG", "LOC"),
                          monkeypatch) == 0  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "PER", "1": "ORG", "2": "LOC"}
