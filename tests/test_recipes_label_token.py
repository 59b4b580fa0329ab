"""recipes/classification.py with --head label_token, --pair_swap, --truncation_side on tiny models: the files it
writes, a saved model reloaded, zero-shot predictions against the causal LM's own next-token logits, one-line
refusals, a k-fold ensemble of label-token folds."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kfold import run_here
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from recipe_helpers import CLS_ROWS, make_tiny_causal_model, run_in_process, write_csv

import kfold

LABEL_WORDS = ["--label_words", "animal=cat,work=works"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny Llama folder with a WordLevel tokenizer and a tiny chat template."""
    return make_tiny_causal_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def data(tmp_path) -> list[str]:
    write_csv(tmp_path / "train.csv", CLS_ROWS * 2)
    write_csv(tmp_path / "test.csv", CLS_ROWS[:4])
    test = str(tmp_path / "test.csv")
    return ["--train_file", str(tmp_path / "train.csv"), "--validation_file", test, "--test_file", test]


def flags(model: str, out: Path, *extra: str) -> list[str]:
    return [
        "--tricks", "none", "--model_name_or_path", model, "--output_dir", str(out), "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "2", "--learning_rate", "1e-2",
        "--disable_tqdm", "true", "--seed", "0", *extra,
    ]  # fmt: skip


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_label_token_run_writes_its_files_and_reloads_predicting_the_same(llama, data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert (
        run_in_process("classification", flags(llama, out, "--head", "label_token", *LABEL_WORDS, *data), monkeypatch)
        == 0
    )
    saved = json.loads((out / "label_token.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert saved["labels"] == ["animal", "work"] and saved["label_words"] == ["cat", "works"]
    assert saved["label_token_ids"] == [
        tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in ["cat", "works"]
    ]
    assert saved["prompt_template"].startswith("user : Text: {text}") and saved["prompt_template"].endswith(
        "assistant :"
    )
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "LlamaForCausalLM"  # a plain causal-LM folder

    probabilities = np.load(out / "test_probabilities.npy")
    assert probabilities.dtype == np.float32 and probabilities.shape == (4, 2)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-6)
    rows = read_rows(out / "test_predictions.csv")
    assert [(r["text"], r["label"]) for r in rows] == CLS_ROWS[:4]  # file order, though predicted sorted by length
    assert [r["predicted"] for r in rows] == [["animal", "work"][j] for j in probabilities.argmax(axis=1)]
    prompts = [json.loads(line)["prompt"] for line in (out / "test_prompts.jsonl").read_text().splitlines()]
    template = saved["prompt_template"]
    read = [tokenizer(template.format(text=text), add_special_tokens=False)["input_ids"] for text, _ in CLS_ROWS[:4]]
    assert prompts == [tokenizer.decode(ids) for ids in read]
    assert (out / "validation_prompts.jsonl").is_file()

    again = tmp_path / "again"  # the saved model's head, words and prompt, read from its folder
    args = ["--model_name_or_path", str(out), "--do_train", "false", "--output_dir", str(again), *data]
    assert run_in_process("classification", args, monkeypatch) == 0
    assert np.load(again / "test_probabilities.npy").tobytes() == probabilities.tobytes()


def test_zero_shot_predicts_the_lms_own_next_token_preference(llama, data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    template = "{text} :"
    args = flags(
        llama, out, "--head", "label_token", *LABEL_WORDS, "--prompt_template", template, "--do_train", "false"
    )
    assert run_in_process("classification", [*args, *data], monkeypatch) == 0
    lm, tokenizer = AutoModelForCausalLM.from_pretrained(llama).eval(), AutoTokenizer.from_pretrained(llama)
    tokens = [tokenizer.encode(" cat")[0], tokenizer.encode(" works")[0]]
    with torch.no_grad():
        expected = [
            lm(**tokenizer(template.format(text=text), return_tensors="pt")).logits[0, -1, tokens].softmax(-1)
            for text, _ in CLS_ROWS[:4]
        ]
    # The LM's full head on one unpadded prompt against two of its rows on a padded batch: float32 round-off.
    np.testing.assert_allclose(np.load(out / "test_probabilities.npy"), torch.stack(expected).numpy(), rtol=1e-5)


def test_classifier_head_probabilities_are_the_softmax_of_its_logits(tiny_model, data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert run_in_process("classification", flags(tiny_model, out, *data), monkeypatch) == 0
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        expected = [model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1) for text, _ in CLS_ROWS[:4]]
    np.testing.assert_allclose(np.load(out / "test_probabilities.npy"), torch.stack(expected).numpy(), rtol=1e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--label_words: label words 'animal', 'work' share their first token '<unk>'"),
        (["--label_words", "animal=cat,plant=works"], "--label_words: 'plant' is not a label of the data"),
        (["--prompt_template", "{text} {text_pair}"], "--prompt_template: the template has {text_pair} but"),
        (["--prompt_template", "{label}"], "--prompt_template: {label}: a template holds only"),
        ([*LABEL_WORDS, "--max_seq_length", "4"], "--max_seq_length 4: the prompt template's tokens fill it"),
    ],
)
def test_label_token_mistakes_are_one_line(llama, data, tmp_path, monkeypatch, capsys, extra, message):
    out = tmp_path / "out"
    args = flags(llama, out, "--head", "label_token", *extra, *data)
    assert run_in_process("classification", args, monkeypatch) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message), err[-3:]
    assert not (out / "all_results.json").exists()


@pytest.mark.parametrize("head", ["classifier", "label_token"])
def test_pairs_swapped_in_training_and_averaged_in_prediction(head, llama, tiny_model, tmp_path, monkeypatch):
    rows = [("the cat", "a dog ran", "a"), ("john works", "mary", "b"), ("paris", "london", "tie")] * 2
    with (tmp_path / "pairs.csv").open("w", newline="") as f:
        csv.writer(f).writerows([("premise", "hypothesis", "label"), *rows])
    pairs = str(tmp_path / "pairs.csv")
    out = tmp_path / "out"
    model = llama if head == "label_token" else tiny_model
    extra = ["--head", "label_token", "--label_words", "a=cat,b=dog,tie=mat"] if head == "label_token" else []
    args = flags(model, out, *extra, "--train_file", pairs, "--validation_file", pairs, "--test_file", pairs,
                 "--text_column", "premise", "--text_pair_column", "hypothesis", "--pair_swap", "a=b,b=a,tie=tie",
                 "--pair_swap_predict", "true", "--truncation_side", "middle", "--max_seq_length", "64")  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert results["train_samples"] == 6 and results["test_samples"] == 6
    probabilities = np.load(out / "test_probabilities.npy")
    assert probabilities.shape == (6, 3)
    np.testing.assert_allclose(probabilities[:3], probabilities[3:], rtol=1e-5)  # the same pairs twice
    if head == "label_token":
        records = [json.loads(line) for line in (out / "test_prompts.jsonl").read_text().splitlines()]
        assert "text a : the cat" in records[0]["prompt"] and "text a : a dog ran" in records[0]["prompt_swapped"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pair_swap", "symmetric"], "pair_swap needs text_pair_column"),
        (["--pair_swap_predict", "true"], "pair_swap_predict needs pair_swap"),
        (["--head_tokens", "3"], "head_tokens goes with truncation_side=head_tail"),
        (["--label_words", "a=b"], "label_words and prompt_template go with head=label_token"),
    ],
)
def test_flags_that_do_not_go_together_are_refused(tiny_model, data, tmp_path, monkeypatch, capsys, extra, message):
    assert run_in_process("classification", flags(tiny_model, tmp_path / "out", *extra, *data), monkeypatch) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("side", ["left", "head_tail"])
def test_truncation_side_counts_the_cut_texts(tiny_model, data, tmp_path, monkeypatch, side):
    out = tmp_path / "out"
    args = flags(tiny_model, out, "--truncation_side", side, "--max_seq_length", "5", *data)
    assert run_in_process("classification", args, monkeypatch) == 0
    results = json.loads((out / "all_results.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    longer = sum(len(tokenizer(text)["input_ids"]) > 5 for text, _ in CLS_ROWS[:4])
    assert results["test_truncated_examples"] == longer > 0


def test_kfold_of_label_token_folds(llama, tmp_path, monkeypatch):
    """The folds train with the label-token head; the ensemble loads each as one (its words, prompt and tokens) and
    predicts what the recipe predicts with that fold's folder."""
    write_csv(tmp_path / "train.csv", CLS_ROWS * 2)
    write_csv(tmp_path / "test.csv", CLS_ROWS[:3])
    out = tmp_path / "kf"
    fold_flags = flags(llama, out, "--head", "label_token", *LABEL_WORDS)
    fold_flags = fold_flags[: fold_flags.index("--output_dir")] + fold_flags[fold_flags.index("--output_dir") + 2 :]
    argv = ["--recipe", "classification", "--folds", "2", "--output_dir", str(out), "--", *fold_flags,
            "--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]  # fmt: skip
    assert kfold.main(argv, run=run_here) == 0
    folds = [np.load(out / f"fold{k}" / "test_probabilities.npy") for k in range(2)]
    np.testing.assert_allclose(np.load(out / "test_probabilities.npy"), (folds[0] + folds[1]) / 2, rtol=1e-6)
    alone = tmp_path / "alone"
    args = ["--model_name_or_path", str(out / "fold0"), "--do_train", "false", "--output_dir", str(alone),
            "--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 0
    np.testing.assert_allclose(np.load(alone / "test_probabilities.npy"), folds[0], rtol=1e-5)  # other batches


def test_multi_label_label_token_head_predicts_a_sigmoid_per_label_word(llama, tmp_path, monkeypatch):
    rows = [("the cat sat", "animal;home"), ("john works", "work"), ("the dog ran", "animal"), ("mary", "")] * 2
    write_csv(tmp_path / "tags.csv", rows)
    tags = str(tmp_path / "tags.csv")
    out = tmp_path / "out"
    words = ["--label_words", "animal=cat,home=mat,work=works"]
    args = flags(llama, out, "--head", "label_token", *words, "--multi_label", "true", "--train_file", tags,
                 "--validation_file", tags, "--test_file", tags)  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 0
    probabilities = np.load(out / "test_probabilities.npy")
    assert probabilities.shape == (8, 3) and ((probabilities > 0) & (probabilities < 1)).all()
    predicted = [r["predicted"] for r in read_rows(out / "test_predictions.csv")]
    labels = ["animal", "home", "work"]
    assert predicted == [";".join(label for label, p in zip(labels, row) if p > 0.5) for row in probabilities]
    assert "eval_micro_f1" in json.loads((out / "all_results.json").read_text())


def test_a_label_token_run_resumes_from_its_checkpoint(llama, data, tmp_path, monkeypatch):
    """A checkpoint holds the causal LM, its label_token.json in the manifest: resuming reaches the weights of the
    run that was not stopped."""
    head = [
        "--head",
        "label_token",
        *LABEL_WORDS,
        "--save_steps",
        "1",
        "--max_steps",
        "3",
        "--lr_scheduler_type",
        "constant",
        *data,
    ]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_in_process("classification", flags(llama, whole, *head), monkeypatch) == 0
    first = flags(llama, parts, *head)
    first[first.index("--max_steps", first.index("--head")) + 1] = "2"
    assert run_in_process("classification", first, monkeypatch) == 0
    assert (parts / "checkpoint-2" / "label_token.json").is_file()
    resumed = [*flags(llama, parts, *head), "--resume_from_checkpoint", "true", "--overwrite_output_dir", "true"]
    assert run_in_process("classification", resumed, monkeypatch) == 0
    np.testing.assert_allclose(
        np.load(parts / "test_probabilities.npy"), np.load(whole / "test_probabilities.npy"), rtol=1e-5
    )


@pytest.mark.parametrize("merge", ["true", "false"])
def test_lora_label_token_run_saves_a_model_or_an_adapter_that_reloads(llama, data, tmp_path, monkeypatch, merge):
    """--peft lora: an adapter on the body, the LM head frozen (no modules_to_save: its rows are the scores); merged,
    the folder is a causal LM; unmerged, the adapter alone with label_token.json, loaded on its base model."""
    out = tmp_path / "out"
    lora = ["--peft", "lora", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj", "--merge_lora", merge]
    args = flags(llama, out, "--head", "label_token", *LABEL_WORDS, *lora, *data)
    assert run_in_process("classification", args, monkeypatch) == 0
    assert (out / "label_token.json").is_file()
    if merge == "true":
        assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "LlamaForCausalLM"
    else:
        from safetensors import safe_open

        adapter = json.loads((out / "adapter_config.json").read_text())
        assert not adapter.get("modules_to_save") and adapter["base_model_name_or_path"] == str(Path(llama).resolve())
        with safe_open(out / "adapter_model.safetensors", "pt") as f:
            names = list(f.keys())
        assert names and all("lora_" in name and "lm_head" not in name for name in names)
    again = tmp_path / "again"
    args = ["--model_name_or_path", str(out), "--do_train", "false", "--output_dir", str(again), *data]
    assert run_in_process("classification", args, monkeypatch) == 0
    np.testing.assert_allclose(
        np.load(again / "test_probabilities.npy"), np.load(out / "test_probabilities.npy"), rtol=1e-5
    )  # merged on load or kept as an adapter: float32 round-off
