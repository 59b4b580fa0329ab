"""Self-training: confidence filtering against hand-computed cases, soft labels through the collator, order across
2 processes, unlabelled-file errors, and the recipe end to end (a few steps: NER one round, classification two)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DataCollatorForTokenClassification, DataCollatorWithPadding

from nlp_tricks.data import DataError
from nlp_tricks.functional.losses import distillation_loss
from nlp_tricks.self_training import (
    TeacherLogitsCollator,
    classification_pseudo_labels,
    ner_pseudo_labels,
    one_hot_logits,
    predict_logits,
    read_unlabeled_file,
    token_teacher_logits,
)
from recipe_helpers import (
    TRAIN_CONLL,
    assert_ok,
    launch,
    launch_ddp_script,
    ner_files,
    run_in_process,
    tiny_args,
    write_csv,
)
from tiny import bert_seq_cls, bert_token_cls, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
LN = math.log


# ---- Confidence filtering -----------------------------------------------------------------------------------------


def test_classification_confidence_is_max_softmax_probability():
    # softmax maxima by hand: [4, 1, 1] / 6, uniform 1/3, [1, 9, 1] / 11
    logits = [np.array([LN(4), 0.0, 0.0]), np.zeros(3), np.array([0.0, LN(9), 0.0])]
    pseudo = classification_pseudo_labels(logits, confidence_threshold=0.6)
    torch.testing.assert_close(torch.from_numpy(pseudo.confidence), torch.tensor([4 / 6, 1 / 3, 9 / 11], dtype=float))
    assert pseudo.indices == [0, 2] and pseudo.labels == [0, 1]
    assert all(np.array_equal(a, logits[i]) for a, i in zip(pseudo.logits, pseudo.indices))
    assert classification_pseudo_labels(logits, confidence_threshold=0.7).indices == [2]
    assert classification_pseudo_labels(logits, confidence_threshold=0.0).indices == [0, 1, 2]
    with pytest.raises(ValueError, match="confidence_threshold=1.5 is not allowed"):
        classification_pseudo_labels(logits, confidence_threshold=1.5)


def test_ner_confidence_is_min_over_first_sub_tokens():
    # Sentence 0: [CLS] w0 w0' w1 [SEP]. Special tokens and the continuation w0' are very (un)sure and must not count:
    # words: w0 -> p = 3/4 (label 0), w1 -> p = 9/10 (label 1): confidence 3/4.
    s0 = np.array([[0.0, 50.0], [LN(3), 0.0], [0.0, 0.0], [0.0, LN(9)], [50.0, 0.0]], dtype=np.float32)
    ids0 = [None, 0, 0, 1, None]
    # Sentence 1: 3 words, truncated after word 1: words 0, 1 -> p = 0.99 and 0.6 (label 0 then 1): confidence 0.6.
    s1 = np.array([[0.0, 0.0], [LN(99), 0.0], [0.0, LN(1.5)], [0.0, 0.0]], dtype=np.float32)
    ids1 = [None, 0, 1, None]
    # Sentence 2: no word at all (only special tokens): never kept.
    s2 = np.zeros((2, 2), dtype=np.float32)
    ids2 = [None, None]
    pseudo = ner_pseudo_labels([s0, s1, s2], [ids0, ids1, ids2], confidence_threshold=0.7)
    expected = torch.tensor([0.75, 0.6, float("nan")], dtype=torch.float64)
    torch.testing.assert_close(torch.from_numpy(pseudo.confidence), expected, equal_nan=True, rtol=1e-6, atol=1e-6)
    assert pseudo.indices == [0] and pseudo.labels == [[0, 1]]
    assert np.array_equal(pseudo.logits[0], s0[[1, 3]])  # the teacher's logits of each word's first sub-token
    low = ner_pseudo_labels([s0, s1, s2], [ids0, ids1, ids2], confidence_threshold=0.0)
    assert low.indices == [0, 1] and low.labels == [[0, 1], [0, 1]]  # truncated: only the 2 words the teacher saw


def test_ner_word_without_sub_token_has_no_label():
    logits = np.array([[0.0, 0.0], [LN(4), 0.0], [0.0, LN(4)], [0.0, 0.0]], dtype=np.float32)
    pseudo = ner_pseudo_labels([logits], [[None, 0, 2, None]])  # word 1 produced no sub-token
    assert pseudo.labels == [[0, None, 1]]
    assert np.isnan(pseudo.logits[0][1]).all() and pseudo.confidence[0] == pytest.approx(0.8)


# ---- Teacher logits for the student -------------------------------------------------------------------------------


def test_one_hot_logits_make_the_soft_term_a_tempered_cross_entropy():
    # Gold examples carry one-hot teacher logits: KL(onehot || softmax(s/T)) = CE(s/T, y), so the soft term is
    # T^2 * CE(s / T, y) (reference: F.cross_entropy).
    torch.manual_seed(0)
    student = torch.randn(6, 4, dtype=torch.float32)
    gold = torch.tensor([0, 3, 1, 2, 2, 0])
    teacher = torch.from_numpy(np.stack([one_hot_logits(int(y), 4) for y in gold]))
    for temperature in (0.5, 1.0, 4.0):
        got = distillation_loss(student, teacher, None, temperature=temperature)
        expected = temperature**2 * F.cross_entropy(student / temperature, gold)
        torch.testing.assert_close(got, expected)


def test_token_teacher_logits_alignment():
    word_logits = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=np.float32)
    # [CLS] w0 w0' w1 [SEP]; with --label_all_tokens the continuation w0' is labelled 2
    out = token_teacher_logits([None, 0, 0, 1, None], [-100, 1, 2, 0, -100], word_logits, 3)
    expected = np.zeros((5, 3), dtype=np.float32)
    expected[1], expected[3] = word_logits[0], word_logits[1]
    expected[2] = one_hot_logits(2, 3)
    assert np.array_equal(out, expected)
    gold = token_teacher_logits([None, 0, 1, None], [-100, 2, 0, -100], None, 3)  # a gold sentence: one-hot
    assert np.array_equal(gold[1], one_hot_logits(2, 3)) and np.array_equal(gold[2], one_hot_logits(0, 3))
    assert not gold[0].any() and not gold[3].any()


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_collator_pads_teacher_logits_like_the_inputs(padding_side):
    tokenizer = word_tokenizer()
    tokenizer.padding_side = padding_side
    features = []
    for n, sentence in enumerate(["the cat sat", "a dog ran on the mat"]):
        enc = dict(tokenizer(sentence))
        length = len(enc["input_ids"])
        teacher = torch.arange(length * 3, dtype=torch.float32).reshape(length, 3) + 100 * n
        features.append({**enc, "labels": [0] * length, "teacher_logits": teacher.tolist()})
    collator = TeacherLogitsCollator(DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8), padding_side)
    batch = collator(features)
    assert batch["teacher_logits"].shape == (2, 8, 3) and batch["input_ids"].shape == (2, 8)
    for i, f in enumerate(features):
        real = batch["attention_mask"][i].bool()
        assert torch.equal(batch["teacher_logits"][i][real], torch.tensor(f["teacher_logits"]))
        assert not batch["teacher_logits"][i][~real].any()
    flat = TeacherLogitsCollator(DataCollatorWithPadding(tokenizer))(
        [{**dict(tokenizer("the cat")), "labels": 1, "teacher_logits": [0.5, -1.0]}] * 2
    )
    assert torch.equal(flat["teacher_logits"], torch.tensor([[0.5, -1.0]] * 2))


SENTENCES = ["the cat", "a dog ran on the mat", "the", "dog sat", "a cat sat on a mat", "ran", "the dog ran"]


def reference_logits(model, tokenizer, sentences):
    """One unpadded example at a time, in train mode set back: the plain reference."""
    out = []
    with torch.no_grad():
        for sentence in sentences:
            enc = tokenizer(sentence, return_tensors="pt")
            out.append(model(**enc).logits[0])
    return out


def test_soft_labels_are_the_teachers_logits():
    """predict_logits -> ner_pseudo_labels -> token_teacher_logits -> collator: teacher logits reach the batch."""
    tokenizer = word_tokenizer()
    model = bert_token_cls(num_labels=3, hidden_dropout_prob=0.3)  # dropout on: eval mode must switch it off
    model.train()
    rows = [dict(tokenizer(s)) for s in SENTENCES]
    logits = predict_logits(model, rows, DataCollatorWithPadding(tokenizer), batch_size=3)
    assert model.training  # mode restored
    model.eval()
    expected = reference_logits(model, tokenizer, SENTENCES)
    assert [len(x) for x in logits] == [len(r["input_ids"]) for r in rows]
    for got, ref in zip(logits, expected):
        # Batched with padding vs one unpadded example: masked attention gives the same values up to float32
        # summation order.
        torch.testing.assert_close(torch.from_numpy(got), ref, rtol=1e-5, atol=1e-5)
    word_ids = [tokenizer(s).word_ids() for s in SENTENCES]
    pseudo = ner_pseudo_labels(logits, word_ids)
    features = []
    for i, word_logits in zip(pseudo.indices, pseudo.logits):
        labels = [-100 if w is None else 0 for w in word_ids[i]]
        teacher = token_teacher_logits(word_ids[i], labels, word_logits, 3)
        features.append({**rows[i], "labels": labels, "teacher_logits": teacher.tolist()})
    batch = TeacherLogitsCollator(DataCollatorForTokenClassification(tokenizer))(features)
    for n, i in enumerate(pseudo.indices):
        words = [p for p, w in enumerate(word_ids[i]) if w is not None]  # one sub-token per word here
        # Exact: the stored soft labels are the teacher's float32 logits, moved, never recomputed.
        assert torch.equal(batch["teacher_logits"][n, words], torch.from_numpy(logits[i][words]))


def test_classification_logits_in_order():
    tokenizer = word_tokenizer()
    model = bert_seq_cls(num_labels=4).eval()
    logits = predict_logits(
        model, [dict(tokenizer(s)) for s in SENTENCES], DataCollatorWithPadding(tokenizer), batch_size=4
    )
    expected = torch.stack(reference_logits(model, tokenizer, SENTENCES))
    # Padding vs none: same values up to float32 summation order.
    torch.testing.assert_close(torch.from_numpy(np.stack(logits)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~45 s on a loaded 2-core CPU (two launched processes); the in-process tests check the values
def test_order_preserved_across_two_processes(tmp_path):
    launch_ddp_script("self_training_ddp.py", tmp_path, timeout=300)
    shares = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert shares[0]["world_size"] == 2 and shares[0]["mine"] + shares[1]["mine"] == list(range(len(SENTENCES)))
    tokenizer = word_tokenizer()
    model = bert_token_cls(num_labels=3).eval()  # the script's model: same seed, same config
    expected = reference_logits(model, tokenizer, SENTENCES)
    for rank in (0, 1):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert len(got) == len(SENTENCES)
        for i, ref in enumerate(expected):
            # Another process, batched with padding: same values up to float32 summation order.
            torch.testing.assert_close(got[f"logits_{i}"], ref, rtol=1e-5, atol=1e-5)


# ---- Unlabelled files ---------------------------------------------------------------------------------------------


def test_read_unlabeled_files(tmp_path):
    conll = tmp_path / "raw.conll"
    conll.write_text("-DOCSTART- -X- O\n\nJohn\nworks\n\n\nthe B-X\ncat O\n")  # a tag column is ignored
    assert read_unlabeled_file(conll, "ner", "tokens") == [
        {"tokens": ["John", "works"], "line": 3},
        {"tokens": ["the", "cat"], "line": 7},
    ]
    conll.write_text("# id 1\tdomain=en\nJohn\tB-PER\nworks\tO\n\n# id 2\tdomain=en\nin\tO\nNew York\tB-LOC\n")
    with pytest.raises(DataError, match=r"raw.conll:7: token 'New York' holds a space"):
        read_unlabeled_file(conll, "ner", "tokens")
    # .txt is plain text: one sentence per line, words split on whitespace (not each line's first word).
    text = tmp_path / "raw.txt"
    text.write_text("John works in Paris .\nthe cat sat\n")
    assert read_unlabeled_file(text, "ner", "tokens") == [
        {"tokens": ["John", "works", "in", "Paris", "."], "line": 1},
        {"tokens": ["the", "cat", "sat"], "line": 2},
    ]
    text.write_text("John\nworks\n\nthe\ncat\n")  # one word per line in a .txt: refused, not 4 sentences
    with pytest.raises(DataError, match=r"raw.txt: every line holds a single word.*rename .* to .conll"):
        read_unlabeled_file(text, "ner", "tokens")
    jsonl = tmp_path / "raw.jsonl"
    jsonl.write_text('{"tokens": ["a", "b"]}\n{"tokens": "a b"}\n')
    with pytest.raises(DataError, match=r"raw.jsonl:2: field 'tokens' must be a non-empty list of strings"):
        read_unlabeled_file(jsonl, "ner", "tokens")
    csv_path = tmp_path / "raw.csv"
    csv_path.write_text("body\nhello\n")
    with pytest.raises(DataError, match=r"raw.csv:1: no column 'text'"):
        read_unlabeled_file(csv_path, "classification", "text")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(DataError, match="empty file"):
        read_unlabeled_file(tmp_path / "empty.txt", "ner", "tokens")


# ---- The recipe end to end ----------------------------------------------------------------------------------------

UNLABELED_TEXT = "the cat sat on the mat\nJohn ran in Paris\nMary works at Google\n"  # one sentence per line
CLS_ROWS = [
    ("the cat sat on the mat", "animal"),
    ("a dog ran", "animal"),
    ("john works at acme", "place"),
    ("paris london new york", "place"),
    ("the dog sat on a mat", "animal"),
    ("mary works in paris", "place"),
    ("a cat ran", "animal"),
    ("google in london", "place"),
    ("the cat", "animal"),
    ("acme in new york", "place"),
]


def results_of(out: Path) -> dict:
    return json.loads((out / "self_training_results.json").read_text())


def test_recipe_ner_one_round_soft_labels(tiny_model, tmp_path):
    (tmp_path / "raw.txt").write_text(UNLABELED_TEXT)
    out = tmp_path / "out"
    files = [*ner_files(tmp_path), "--unlabeled_file", str(tmp_path / "raw.txt")]
    # Plain python (as `accelerate launch` runs one process); the 2-process test covers a launched job.
    args = tiny_args(tiny_model, out, "--task", "ner", *files, "--soft_labels", "true")
    proc = launch("self_training", args, launcher="python")
    assert_ok(proc)
    results = results_of(out)
    assert results["task"] == "ner" and results["soft_labels"] and results["distill_temperature"] == 2.0
    assert results["labelled"] == 3 and results["unlabeled"] == 3 and len(results["rounds"]) == 1
    round1 = results["rounds"][0]
    # Threshold 0 keeps every sentence: the student trains on 3 labelled + 3 pseudo-labelled sentences.
    assert round1["pseudo_labels"]["kept"] == 3 and round1["student"]["train_samples"] == 6
    assert round1["teacher"]["train_samples"] == 3
    for role in ("teacher", "student"):
        for key in ("eval_f1", "test_f1"):
            assert 0.0 <= round1[role][key] <= 1.0
    assert "accuracy_of_kept" not in round1["pseudo_labels"]  # an unlabelled file has no hidden gold
    for role in ("teacher", "student"):
        assert (out / "round_1" / role / "model.safetensors").is_file()
    table = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("round  model"))
    assert table[header + 1].split()[:2] == ["1", "teacher"] and table[header + 2].split()[:3] == [
        "1",
        "student",
        "3/3",
    ]


def test_recipe_classification_two_rounds_hard_labels_fraction(tiny_model, tmp_path):
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    write_csv(tmp_path / "dev.csv", CLS_ROWS[:4])
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "dev.csv")]
    extra = ["--task", "classification", *files, "--unlabeled_fraction", "0.6", "--rounds", "2"]
    proc = launch("self_training", tiny_args(tiny_model, out, *extra), launcher="python")
    assert_ok(proc)
    results = results_of(out)
    assert results["labelled"] == 4 and results["unlabeled"] == 6 and results["soft_labels"] is False
    round1 = results["rounds"][0]
    assert round1["pseudo_labels"]["kept"] == 6 and round1["student"]["train_samples"] == 10
    assert 0.0 <= round1["pseudo_labels"]["accuracy_of_kept"] <= 1.0  # measured against the held-out gold
    for role in ("teacher", "student"):
        assert 0.0 <= round1[role]["eval_accuracy"] <= 1.0 and "test_accuracy" not in round1[role]
    # Round 2: round 1's student is the teacher (its metrics, not a retrained model's) and labels again.
    round2 = results["rounds"][1]
    assert round2["round"] == 2 and round2["teacher"] == round1["student"]
    assert round2["pseudo_labels"]["kept"] == 6 and round2["student"]["train_samples"] == 10
    assert (out / "round_2" / "student" / "model.safetensors").is_file() and not (out / "round_2" / "teacher").exists()


@pytest.mark.parametrize(
    "content, where, message",
    [(b"John\nw\xe9rks\n", "raw.txt:2: ", "not valid UTF-8"), (b"\n\n", "raw.txt: ", "empty file: no sentences")],
)
def test_recipe_bad_unlabeled_file(content, where, message, tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    (tmp_path / "raw.txt").write_bytes(content)
    out = tmp_path / "out"
    files = ["--train_file", str(tmp_path / "train.conll"), "--unlabeled_file", str(tmp_path / "raw.txt")]
    assert run_in_process("self_training", tiny_args(tiny_model, out, *files), monkeypatch) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{tmp_path / where}") and message in err, err
    assert err.count("\n") == 1 and not (out / "self_training_results.json").exists()


def test_recipe_needs_one_unlabeled_source(tiny_model, tmp_path, monkeypatch, capsys):
    assert run_in_process("self_training", tiny_args(tiny_model, tmp_path / "out"), monkeypatch) == 2
    assert "give exactly one of unlabeled_file or unlabeled_fraction" in capsys.readouterr().err
