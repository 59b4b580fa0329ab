"""The NER recipe on every tag scheme: one corpus written in IOB1, IOB2, BIOES, BMES and BILOU trains to the same
predictions (as spans) and the same scores, each run writing test_predictions.txt in its file's scheme next to the
file's own gold tags; a character-per-line CJK corpus with CRLF line ends; refusals of a tag the scheme does not
have; the gazetteer baseline and the evidence rescoring of the written files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import evidence
import pytest
from data_generator import draw_spans, write_scheme_tags

from nlp_tricks.data.schemes import SCHEMES, convert_tags, tags_to_spans
from nlp_tricks.metrics.spans import tag_f1
from recipe_helpers import WORDS, run_in_process, tiny_args

# Words of the tiny model's vocabulary, so every word has a sub-token.
VOCAB = [w for w in WORDS if w.isalpha()]


def corpus(seed: int, n: int) -> list[tuple[list[str], list[tuple[str, int, int]]]]:
    """``n`` sentences of vocabulary words with entities (some of three words, some adjacent)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        length = rng.randint(3, 7)
        sentences.append(([rng.choice(VOCAB) for _ in range(length)], draw_spans(rng, length, first_entity=True)))
    return sentences


def write_conll(path: Path, sentences, scheme: str, end: str = "\n") -> list[list[str]]:
    """The sentences as CoNLL ``token<TAB>tag`` lines in ``scheme`` (written from the schemes' definitions in
    tests/data_generator.py); the tags of each sentence."""
    tags = [write_scheme_tags(spans, len(words), scheme) for words, spans in sentences]
    blocks = [end.join(f"{w}\t{t}" for w, t in zip(words, sentence_tags)) for (words, _), sentence_tags in zip(
        sentences, tags)]  # fmt: skip
    path.write_bytes((end + end).join(blocks).encode() + end.encode())
    return tags


def columns(path: Path) -> list[list[tuple[str, ...]]]:
    sentences, current = [], []
    for line in path.read_text(encoding="utf-8").split("\n") + [""]:
        if line.strip():
            current.append(tuple(line.split("\t")))
        elif current:
            sentences.append(current)
            current = []
    return sentences


TRAIN, TEST = corpus(0, 16), corpus(1, 5)
RUN_FLAGS = ["--max_steps", "12", "--learning_rate", "5e-3", "--crf", "true", "--crf_bio_constraints", "true"]


def run_scheme(model: str, tmp_path: Path, scheme: str, monkeypatch, *flags: str) -> tuple[Path, list[list[str]]]:
    folder = tmp_path / scheme
    folder.mkdir()
    write_conll(folder / "train.conll", TRAIN, scheme)
    gold = write_conll(folder / "test.conll", TEST, scheme, end="\r\n")
    files = ["--train_file", str(folder / "train.conll"), "--validation_file", str(folder / "test.conll")]
    files += ["--test_file", str(folder / "test.conll")]
    out = folder / "out"
    assert run_in_process("ner", tiny_args(model, out, *files, *RUN_FLAGS, *flags), monkeypatch) == 0
    return out, gold


def test_one_corpus_in_every_scheme_trains_to_the_same_entities(tiny_model, tmp_path, monkeypatch, caplog):
    schemes = ("iob2", "iob1", "bioes", "bmes", "bilou")
    runs = {}
    for scheme in schemes:
        caplog.clear()
        out, gold = run_scheme(tiny_model, tmp_path, scheme, monkeypatch)
        # Auto-detection says the scheme in one line.
        said = [r.getMessage() for r in caplog.records if "tag scheme" in r.getMessage()]
        assert len(said) == 1 and f"tag scheme {scheme.upper()} (" in said[0], said
        rows = columns(out / "test_predictions.txt")
        # The gold column is the file's own tags; the predictions are well-formed tags of the file's scheme.
        assert [[g for _, g, _ in sentence] for sentence in rows] == gold
        predicted = [[p for _, _, p in sentence] for sentence in rows]
        assert all(convert_tags(tags, scheme) == tags for tags in predicted), predicted
        results = json.loads((out / "all_results.json").read_text())
        # The model trains on the entities' IOB2 tags whatever the scheme.
        assert results["label_list"] == ["B-LOC", "B-ORG", "B-PER", "I-LOC", "I-ORG", "I-PER", "O"]
        # Every number is the written file's, rescored by span reading and by the evidence rows.
        scores = tag_f1(predicted, gold)
        for key in ("f1", "precision", "recall", "accuracy"):
            assert results[f"test_{key}"] == pytest.approx(scores[key], abs=1e-12), key
        rows_scores = evidence.example_rows("ner", out)
        assert evidence.corpus_metric("ner", "f1", rows_scores) == pytest.approx(results["test_f1"], abs=1e-12)
        runs[scheme] = ([tags_to_spans(tags) for tags in predicted], results)
    spans, results = runs[schemes[0]]
    assert any(spans), "the tiny model predicts no entity: the comparison would be empty"
    for scheme in schemes[1:]:
        assert runs[scheme][0] == spans, scheme
        for key in ("eval_f1", "test_f1", "test_precision", "test_recall", "eval_loss"):
            assert runs[scheme][1][key] == results[key], (scheme, key)


def test_a_named_scheme_refuses_a_tag_it_does_not_have(tiny_model, tmp_path, monkeypatch, capsys):
    write_conll(tmp_path / "train.conll", TRAIN, "bmes")
    files = ["--train_file", str(tmp_path / "train.conll")]
    args = tiny_args(tiny_model, tmp_path / "out", *files, "--tag_scheme", "bioes")
    assert run_in_process("ner", args, monkeypatch) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    rows = (tmp_path / "train.conll").read_text().split("\n")
    number, first_m = next((i, row.split("\t")[1]) for i, row in enumerate(rows, 1) if "\tM-" in row)
    assert line == (
        f"{tmp_path / 'train.conll'}:{number}: tag {first_m!r} is not a BIOES tag (--tag_scheme bioes: 'O' and B-, "
        "I-, E-, S- and a type); the file's tags read as BMES: name it with --tag_scheme bmes, or leave --tag_scheme "
        "auto"
    )
    # Auto: a test file in another scheme than the training file's is refused at its first foreign tag.
    write_conll(tmp_path / "test.conll", TEST, "bilou")
    files += ["--test_file", str(tmp_path / "test.conll")]
    assert run_in_process("ner", tiny_args(tiny_model, tmp_path / "out", *files), monkeypatch) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"{tmp_path / 'test.conll'}:") and "is not a BMES tag (detected in" in line
    assert "this one's tags read as BILOU" in line


def cjk_model(path: Path, characters: str) -> str:
    """A tiny BERT whose tokenizer has one token per CJK character (a WordLevel vocabulary built with
    ``tokenizers``), as Chinese BERTs tokenize."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(characters)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # the words are characters: one token each
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(path)  # fmt: skip
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, pad_token_id=0)  # fmt: skip
    BertModel(config).save_pretrained(path)
    return str(path)


# A Chinese NER corpus as MSRA / Weibo / Resume ship it: one character per line, BMES tags, CRLF line ends.
CJK_TRAIN = [
    ("中国人民银行在北京", [("ORG", 0, 6), ("LOC", 7, 9)]),
    ("张三去上海", [("PER", 0, 2), ("LOC", 3, 5)]),
    ("东京大学很大", [("ORG", 0, 4)]),
    ("李四在日本", [("PER", 0, 2), ("LOC", 3, 5)]),
]
CJK_TEST = [("王五在北京大学", [("PER", 0, 2), ("ORG", 3, 7)])]


def test_a_character_per_line_bmes_corpus_with_crlf_reads_trains_and_scores(tmp_path, monkeypatch):
    characters = "".join(text for text, _ in CJK_TRAIN + CJK_TEST)
    model = cjk_model(tmp_path / "cjk_bert", characters)
    train, test = tmp_path / "train.txt", tmp_path / "test.conll"  # .txt is CoNLL too for NER (token first)
    write_conll(train, [(list(text), spans) for text, spans in CJK_TRAIN], "bmes", end="\r\n")
    gold = write_conll(test, [(list(text), spans) for text, spans in CJK_TEST], "bmes", end="\r\n")
    assert b"\tM-ORG\r\n" in train.read_bytes()
    out = tmp_path / "out"
    files = ["--train_file", str(train), "--validation_file", str(test), "--test_file", str(test)]
    args = tiny_args(model, out, *files, "--max_steps", "20", "--learning_rate", "1e-2")
    assert run_in_process("ner", args, monkeypatch) == 0
    rows = columns(out / "test_predictions.txt")
    assert [[w for w, _, _ in sentence] for sentence in rows] == [list(text) for text, _ in CJK_TEST]
    assert [[g for _, g, _ in sentence] for sentence in rows] == gold
    predicted = [[p for _, _, p in sentence] for sentence in rows]
    assert all(convert_tags(tags, "bmes") == tags for tags in predicted)
    results = json.loads((out / "all_results.json").read_text())
    assert results["test_f1"] == tag_f1(predicted, gold)["f1"] and results["test_ORG_number"] == 1
    assert results["test_words_without_tokens"] == 0  # every character is a token of its own


def test_the_gazetteer_baseline_reads_and_writes_the_files_scheme(tmp_path, monkeypatch):
    write_conll(tmp_path / "train.conll", TRAIN, "bmes")
    gold = write_conll(tmp_path / "test.conll", TRAIN[:4], "bmes")
    out = tmp_path / "gazetteer"
    files = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    assert run_in_process("baselines", ["--baseline", "gazetteer", "--output_dir", str(out), *files], monkeypatch) == 0
    rows = columns(out / "test_predictions.txt")
    assert [[g for _, g, _ in sentence] for sentence in rows] == gold
    predicted = [[p for _, _, p in sentence] for sentence in rows]
    assert all(convert_tags(tags, "bmes") == tags for tags in predicted)
    # Test sentences are training sentences: the gazetteer finds each of their entities.
    scores = tag_f1(predicted, gold)
    assert scores["recall"] == 1.0
    # The baseline's F1 is the evidence rows' (the same counts, another order of operations: to round-off).
    assert json.loads((out / "all_results.json").read_text())["test_f1"] == pytest.approx(scores["f1"], abs=1e-12)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_evidence_rows_read_every_scheme(tmp_path, scheme):
    gold_spans = [spans for _, spans in TRAIN]
    predicted_spans = [spans[1:] for spans in gold_spans]  # the first entity of each sentence missed
    lines = []
    for (words, _), g, p in zip(TRAIN, gold_spans, predicted_spans):
        gold, pred = write_scheme_tags(g, len(words), scheme), write_scheme_tags(p, len(words), scheme)
        lines += [f"{w}\t{a}\t{b}" for w, a, b in zip(words, gold, pred)] + [""]
    (tmp_path / "test_predictions.txt").write_text("\n".join(lines))
    rows = evidence.example_rows("ner", tmp_path)
    right, predicted, gold = rows[:, 0].sum(), rows[:, 1].sum(), rows[:, 2].sum()
    assert (right, predicted, gold) == (sum(map(len, predicted_spans)),) * 2 + (sum(map(len, gold_spans)),)


def test_pseudo_labels_are_scored_against_the_gold_of_any_scheme():
    import numpy as np

    from nlp_tricks.self_training import PseudoLabels

    from ner import NER_TASK

    labels = ["B-ORG", "I-ORG", "O"]
    # The teacher's IOB2 tags B I I O O; the held-out gold in BMES: B-ORG M-ORG E-ORG O S-ORG (the same entity,
    # then a one-word one the teacher missed): 4 of 5 words right.
    pseudo = PseudoLabels([0], [[0, 1, 1, 2, 2]], [np.zeros((5, 3))], np.ones(1))
    gold = [["B-ORG", "M-ORG", "E-ORG", "O", "S-ORG"]]
    assert NER_TASK.pseudo_label_accuracy(pseudo, gold, labels) == 4 / 5


def test_self_training_on_a_bilou_file(tiny_model, tmp_path, monkeypatch):
    write_conll(tmp_path / "train.conll", TRAIN, "bilou")
    write_conll(tmp_path / "test.conll", TEST, "bilou")
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    args = tiny_args(tiny_model, out, "--task", "ner", *files, "--unlabeled_fraction", "0.5", "--crf", "true")
    assert run_in_process("self_training", args, monkeypatch) == 0
    round1 = json.loads((out / "self_training_results.json").read_text())["rounds"][0]
    assert round1["pseudo_labels"]["kept"] == 8 and 0.0 <= round1["pseudo_labels"]["accuracy_of_kept"] <= 1.0
    assert 0.0 <= round1["student"]["test_f1"] <= 1.0


def test_a_span_head_writes_flat_predictions_in_the_files_scheme(tiny_model, tmp_path, monkeypatch):
    write_conll(tmp_path / "train.conll", TRAIN, "bmes")
    gold = write_conll(tmp_path / "test.conll", TEST, "bmes")
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]
    args = tiny_args(tiny_model, out, *files, "--span_head", "global_pointer", "--span_flat", "true")
    assert run_in_process("ner", args, monkeypatch) == 0
    rows = columns(out / "test_predictions.txt")
    assert [[g for _, g, _ in sentence] for sentence in rows] == gold
    predicted = [[p for _, _, p in sentence] for sentence in rows]
    assert all(convert_tags(tags, "bmes") == tags for tags in predicted)
    records = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    assert [tags_to_spans(tags) for tags in predicted] == [
        [(e["type"], e["start"], e["end"]) for e in record["entities"]] for record in records
    ]
