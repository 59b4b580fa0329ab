"""The summarization recipe's demo path: generation that ends at EOS, its length from the data, the LoRA adapter
(only the adapter trains; the merged or adapter-only model reloads and predicts the same), the demo defaults and the
new flags' checks.

Tiny Llama folders from config (recipe_helpers.make_tiny_causal_model); no download, seconds per run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nlp_tricks.seq2seq import Seq2SeqTricksArguments
from recipe_helpers import make_tiny_causal_model, run_in_process, tiny_args

import summarization
from common import parse_recipe_args

DOCS = [
    "john works at acme in paris",
    "the cat sat on the mat",
    "mary ran in london , the dog sat on a mat in new york",
]
SUMMARIES = ["john works at acme", "the cat sat", "mary ran in london and the dog sat on a mat"]
INSTRUCTION = "summarize the following text ."


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_causal_model(tmp_path_factory.mktemp("tiny_llama_lora"), "llama", chat_template=True)


def load(folder: str):
    return summarization.load_model_and_tokenizer(summarization.SummarizationModelArguments(model_name_or_path=folder))


def data_args(**overrides) -> summarization.SummarizationDataArguments:
    kwargs = dict(max_source_length=16, max_target_length=12, instruction=INSTRUCTION, **overrides)
    return summarization.SummarizationDataArguments(**kwargs)


def examples() -> list[dict]:
    return [{"text": d, "summary": s} for d, s in zip(DOCS, SUMMARIES)]


def write_jsonl(path: Path, pairs) -> str:
    path.write_text("".join(json.dumps({"text": d, "summary": s}) + "\n" for d, s in pairs), encoding="utf-8")
    return str(path)


# ---- Generation that ends ------------------------------------------------------------------------------------------


def force_eos_after(model, eos: int, stops: list[int | None], forwards_before: int = 0, never: tuple[int, ...] = ()):
    """Make row i's greedy choice EOS at its generated token ``stops[i]`` (None: never), and the tokens ``never``
    never: a forward hook on the output head counts the forwards of one ``generate`` call (the first reads the prompt
    and gives token 0), after ``forwards_before`` others (the prediction step's loss)."""
    calls = {"n": -forwards_before}

    def hook(module, inputs, output):
        step = calls["n"]
        calls["n"] += 1
        output = output.clone()
        for row, stop in enumerate(stops):
            if stop == step:
                output[row, -1, eos] = 1e4
            else:  # no early EOS by chance
                output[row, -1, eos] = -1e4
            output[row, -1, list(never)] = -1e4
        return output

    return model.lm_head.register_forward_hook(hook), calls


def test_generation_stops_at_the_tokenizers_eos_not_only_the_models(tiny_llama, tmp_path):
    """The completion ends with the tokenizer's EOS (what every training completion ends with; an Instruct model's
    end-of-turn token), even when the model's generation config names another EOS: row i stops at its forced token,
    the batch stops when every row has, and plain `generate` (the model's EOS only) runs to the limit."""
    model, tokenizer = load(tiny_llama)
    model.eval()
    eos = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.bos_token_id  # a base model's <|endoftext|>, say
    assert summarization.stop_token_ids(tokenizer, model) == [eos, tokenizer.bos_token_id]
    dataset = summarization.tokenize_prompt_completion(examples(), tokenizer, data_args(), for_generation=True)
    collator = summarization.PromptCompletionCollator(tokenizer.pad_token_id)
    batch = collator([dataset[i] for i in range(3)])
    args = Seq2SeqTricksArguments(
        output_dir=str(tmp_path), generation_max_length=20, report_to="none", use_cpu=True, predict_with_generate=True
    )
    trainer = summarization.PromptCompletionTrainer(
        model=model, args=args, processing_class=tokenizer, data_collator=collator
    )
    stops = [3, 0, 5]
    handle, calls = force_eos_after(model, eos, stops, 1, never=(tokenizer.bos_token_id,))
    _, completions, _ = trainer.prediction_step(model, dict(batch), prediction_loss_only=False)
    handle.remove()
    assert completions.shape == (3, max(stops) + 1)  # one forward per generated token, none after the last EOS
    assert calls["n"] == max(stops) + 1
    for row, stop in zip(completions.tolist(), stops):
        assert eos not in row[:stop] and row[stop] == eos
        assert all(token == tokenizer.pad_token_id for token in row[stop + 1 :])
    lengths, stopped = summarization.summary_lengths(completions.numpy(), [eos], tokenizer.pad_token_id)
    assert lengths.tolist() == stops and stopped.all()

    handle, _ = force_eos_after(model, eos, stops, never=(tokenizer.bos_token_id,))
    with torch.no_grad():
        plain = model.generate(
            input_ids=batch["prompt_input_ids"],
            attention_mask=batch["prompt_attention_mask"],
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    handle.remove()
    assert plain.shape[1] - batch["prompt_input_ids"].shape[1] == 20


def test_summary_lengths_by_hand():
    """Tokens before the first EOS, padding or -100; 'stopped' only where that first token is an EOS."""
    eos, pad = 2, 0
    predictions = np.array(
        [
            [5, 6, 2, 0, 0],  # EOS after 2 tokens, then padding
            [5, 6, 7, 8, 9],  # ran to the limit
            [5, 2, -100, -100, -100],  # a shorter batch, padded across batches with -100
            [5, 6, 0, 0, 0],  # padding without EOS (a model whose padding token is not its EOS)
            [2, 0, 0, 0, 0],  # empty summary
        ]
    )
    lengths, stopped = summarization.summary_lengths(predictions, [eos, 3], pad)
    assert lengths.tolist() == [2, 5, 1, 2, 0]
    assert stopped.tolist() == [True, False, True, False, True]
    # A second stop token (the model's own EOS) ends a summary too.
    lengths, stopped = summarization.summary_lengths(np.array([[5, 3, 0]]), [eos, 3], pad)
    assert lengths.tolist() == [1] and stopped.tolist() == [True]


def test_generation_length_is_the_99th_percentile_capped():
    assert summarization.GENERATION_LENGTH_PERCENTILE == 99
    # The 99th percentile of n sorted lengths sits at position 0.99 (n - 1), rounded up to an observed length.
    lengths = list(range(1, 201))  # position 197.01 -> the 199th length
    assert summarization.generation_length(lengths, 256) == 199
    assert summarization.generation_length(lengths, 50) == 50
    assert summarization.generation_length(list(range(1, 101)), 256) == 100  # 98.01 -> the longest of 100
    assert summarization.generation_length([7] * 200 + [500], 1000) == 7  # exactly position 198: a 7
    assert summarization.generation_length([], 64) == 64


# ---- Flags ---------------------------------------------------------------------------------------------------------


def parse(*argv):
    return parse_recipe_args(
        (
            summarization.SummarizationDataArguments,
            summarization.SummarizationModelArguments,
            Seq2SeqTricksArguments,
        ),
        "summarization",
        summarization.RECIPE_DEFAULTS,
        argv=list(argv),
        dependent_defaults=(summarization.uses_demo_model, {"demo": summarization.DEMO_DEFAULTS}),
    )


def test_the_default_model_brings_the_demo_defaults_and_others_keep_the_recipes():
    data, model, training = parse()
    assert model.model_name_or_path == "smollm2-demo" and model.peft == "lora"
    assert (model.lora_r, model.lora_alpha, model.lora_dropout, model.lora_target_modules) == (
        16,
        32.0,
        0.0,  # PEFT's default
        ["all-linear"],
    )
    assert training.chunked_lm_loss
    assert training.learning_rate == summarization.DEMO_DEFAULTS["learning_rate"]
    assert data.max_source_length == summarization.DEMO_DEFAULTS["max_source_length"]
    assert training.eval_strategy == "no" and training.generation_max_length is None  # from the data
    # Flags still win over the demo defaults.
    data, model, training = parse("--peft", "none", "--learning_rate", "1e-4", "--max_source_length", "128")
    assert (model.peft, training.learning_rate, data.max_source_length) == ("none", 1e-4, 128)
    assert model.lora_r is None
    # Another model: the recipe's own defaults (the BERT2BERT demo's), full fine-tuning.
    data, model, training = parse("--model_name_or_path", "minilm-demo")
    assert model.peft == "none" and training.learning_rate == summarization.RECIPE_DEFAULTS["learning_rate"]
    assert data.max_source_length == 256 and training.eval_strategy == "epoch"
    _, model, _ = parse(
        "--model_name_or_path", "some/llama", "--peft", "lora", "--lora_target_modules", "q_proj", "v_proj"
    )
    assert model.lora_target_modules == ["q_proj", "v_proj"] and model.lora_r == 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--peft", "none", "--lora_r", "8"], "lora_r applies to a LoRA adapter; add --peft lora"),
        (["--model_name_or_path", "x", "--lora_alpha", "8"], "lora_alpha applies to a LoRA adapter"),
        (["--lora_r", "0"], "lora_r=0 is not allowed; it must be >= 1"),
        (["--lora_alpha", "0"], "lora_alpha=0.0 is not allowed; it must be > 0"),
        (["--lora_dropout", "1"], "lora_dropout=1.0 is not allowed; it must be in [0, 1)"),
        (["--peft", "qlora"], "invalid choice: 'qlora'"),
    ],
)
def test_bad_lora_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_lora_on_a_model_that_is_not_a_causal_lm_is_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", zip(DOCS, SUMMARIES))
    args = tiny_args(tiny_model, tmp_path / "out", "--train_file", train, "--peft", "lora")
    assert run_in_process("summarization", args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("--")] == [
        f"--peft lora: this recipe trains LoRA adapters on causal LMs; {tiny_model} is not one (give --peft none)"
    ]
    assert not (tmp_path / "out" / "all_results.json").exists()


def test_a_missing_target_module_is_one_line(tiny_llama, tmp_path, monkeypatch, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", zip(DOCS, SUMMARIES))
    args = tiny_args(tiny_llama, tmp_path / "out", "--train_file", train, "--peft", "lora")
    assert run_in_process("summarization", [*args, "--lora_target_modules", "c_attn"], monkeypatch) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("--")]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("--lora_target_modules c_attn: ")


# ---- The LoRA path in the recipe -----------------------------------------------------------------------------------


LORA_FLAGS = ["--peft", "lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0"]
LORA_FLAGS += ["--lora_target_modules", "q_proj", "v_proj", "--learning_rate", "5e-2", "--max_steps", "3"]


def lora_run(tiny_llama, tmp_path, monkeypatch, name, *extra):
    pairs = [(DOCS[i % 3], SUMMARIES[i % 3]) for i in range(6)]
    files = [write_jsonl(tmp_path / f"{split}.jsonl", pairs[:n]) for split, n in (("train", 6), ("dev", 3))]
    out = tmp_path / name
    args = tiny_args(tiny_llama, out, "--train_file", files[0], "--validation_file", files[1], "--test_file", files[1])
    args += ["--instruction", INSTRUCTION, "--max_source_length", "16", *LORA_FLAGS, *extra]
    assert run_in_process("summarization", args, monkeypatch) == 0
    predictions = [
        json.loads(line)["prediction"] for line in (out / "test_predictions.jsonl").read_text().split("\n")[:-1]
    ]
    return out, json.loads((out / "all_results.json").read_text()), predictions


def test_lora_trains_only_the_adapter_and_the_saved_models_predict_the_same(tiny_llama, tmp_path, monkeypatch):
    """Two runs, the same seed: --merge_lora true saves a plain model whose weights are the base's, bit for bit,
    except the adapted q_proj / v_proj, which are W + (alpha / r) B A with the A, B the --merge_lora false run saved
    (adapter only). The merged model reloaded by the recipe (--do_train false) writes the same test predictions as the
    run that trained it, and so does the adapter on its base reloaded with peft."""
    from peft import PeftModel

    merged_dir, merged_results, merged_predictions = lora_run(tiny_llama, tmp_path, monkeypatch, "merged")
    adapter_dir, adapter_results, adapter_predictions = lora_run(
        tiny_llama, tmp_path, monkeypatch, "adapter", "--merge_lora", "false"
    )
    base = load_file(str(Path(tiny_llama) / "model.safetensors"))
    merged = load_file(str(merged_dir / "model.safetensors"))
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert not (adapter_dir / "model.safetensors").exists() and not (merged_dir / "adapter_config.json").exists()
    n_layers = 2
    # q_proj and v_proj of each layer, an A and a B each: nothing else is in the adapter
    assert len(adapter) == 2 * 2 * n_layers and all("lora_" in key for key in adapter)
    assert merged_results["trainable_parameters"] == sum(t.numel() for t in adapter.values())
    assert sorted(merged) == sorted(base)
    adapted = 0
    for key, weight in base.items():
        module = key.removesuffix(".weight")
        a_key = f"base_model.model.{module}.lora_A.weight"
        if a_key not in adapter:
            assert torch.equal(merged[key], weight), f"{key} changed without an adapter"
            continue
        delta = (8 / 4) * adapter[a_key.replace("lora_A", "lora_B")] @ adapter[a_key]
        assert delta.abs().max() > 1e-4, f"{key}: the adapter did not train"
        # float32 round-off of W + delta, and of the two runs' separate (identical) training
        torch.testing.assert_close(merged[key], weight + delta, rtol=1e-5, atol=1e-6)
        adapted += 1
    assert adapted == 2 * n_layers

    # The same training: predictions of the merged model and of the unmerged adapter are the same.
    assert merged_predictions == adapter_predictions
    assert merged_results["test_rougeL"] == adapter_results["test_rougeL"]

    reload_dir = tmp_path / "reloaded"
    test_file = str(tmp_path / "dev.jsonl")
    args = tiny_args(str(merged_dir), reload_dir, "--train_file", str(tmp_path / "train.jsonl"))
    args += [
        "--test_file",
        test_file,
        "--do_train",
        "false",
        "--instruction",
        INSTRUCTION,
        "--max_source_length",
        "16",
    ]
    args += ["--generation_max_length", str(merged_results["generation_max_length"])]
    assert run_in_process("summarization", args, monkeypatch) == 0
    reloaded = [
        json.loads(line)["prediction"] for line in (reload_dir / "test_predictions.jsonl").read_text().split("\n")[:-1]
    ]
    assert reloaded == merged_predictions

    # The adapter folder on its base model, with peft: the merged model's logits.
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), str(adapter_dir)).eval()
    merged_model = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, merged_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_generation_length_and_lengths_are_recorded(tiny_llama, tmp_path, monkeypatch):
    """Without --generation_max_length the run uses the 99th percentile of its training summaries' token counts
    (EOS included; one token per word here), and all_results.json holds it with the mean generated and reference
    lengths and the share of summaries that ended with EOS."""
    out, results, _ = lora_run(tiny_llama, tmp_path, monkeypatch, "lengths", "--max_target_length", "8")
    words = [min(len(SUMMARIES[i % 3].split()) + 1, 8) for i in range(6)]
    assert results["generation_max_length"] == int(np.percentile(words, 99, method="higher")) == 8
    for prefix in ("eval", "test"):
        assert results[f"{prefix}_ref_len"] == pytest.approx(np.mean([len(s.split()) for s in SUMMARIES]))
        assert 0 <= results[f"{prefix}_gen_len"] <= 8 and 0 <= results[f"{prefix}_gen_stopped"] <= 1


# ---- PEFT's LoRA variants as flags ---------------------------------------------------------------------------------

VARIANT_FLAGS = ["--model_name_or_path", "some/llama", "--peft", "lora", "--lora_r", "4", "--lora_alpha", "8"]
VARIANT_FLAGS += ["--lora_target_modules", "q_proj", "v_proj"]


def adapter(*flags):
    """A tiny Llama with the adapter the recipe builds for ``flags``, and a copy of the Llama before."""
    from tiny_causal import llama_lm

    _, model_args, _ = parse(*VARIANT_FLAGS, *flags)
    base = llama_lm()
    original = {name: p.detach().clone() for name, p in base.named_parameters()}
    return summarization.add_lora(base, model_args), original


def adapted_layers(model):
    from peft.tuners.lora import LoraLayer

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    assert len(layers) == 4  # q_proj and v_proj of 2 layers
    return layers


def original_weight(original, name):
    return original[name.removeprefix("base_model.model.") + ".weight"]


def test_lora_use_rslora_scales_by_alpha_over_sqrt_r():
    for flags, want in (([], 8 / 4), (["--lora_use_rslora"], 8 / math.sqrt(4))):
        model, _ = adapter(*flags)
        for _, layer in adapted_layers(model):
            assert layer.scaling["default"] == pytest.approx(want)


def test_lora_use_dora_adds_a_magnitude_per_output_starting_at_the_weights_norm():
    """DoRA (Liu et al. 2024): W' = m (W + s BA) / ||W + s BA|| per output row; m starts at ||W|| (B = 0)."""
    model, original = adapter("--lora_use_dora")
    for name, layer in adapted_layers(model):
        magnitude = layer.lora_magnitude_vector["default"].weight
        assert magnitude.requires_grad
        torch.testing.assert_close(magnitude, torch.linalg.norm(original_weight(original, name), dim=1))
    plain, _ = adapter()
    assert not any("lora_magnitude_vector" in n for n, _ in plain.named_parameters())


def test_lora_init_pissa_moves_the_principal_part_into_the_adapter():
    """PiSSA (Meng et al. 2024): s B A is the rank-r truncated SVD of W (torch's), the layer keeps W - s B A, so the
    model is unchanged at the start."""
    model, original = adapter("--lora_init", "pissa")
    for name, layer in adapted_layers(model):
        w = original_weight(original, name)
        u, sv, vh = torch.linalg.svd(w, full_matrices=False)
        principal = u[:, :4] @ torch.diag(sv[:4]) @ vh[:4]
        update = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close(update, principal, rtol=1e-4, atol=1e-5)  # two SVDs of one matrix: round-off
        torch.testing.assert_close(layer.base_layer.weight + update, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("init", ["olora", "orthogonal", "gaussian"])
def test_lora_init_is_peft_init_lora_weights(init):
    """Each --lora_init value is LoraConfig's init_lora_weights, and the adapted model computes what the original
    did (OLoRA moves a QR part of W into the adapter; gaussian and orthogonal start with B A = 0)."""
    model, original = adapter("--lora_init", init)
    assert model.peft_config["default"].init_lora_weights == init
    for name, layer in adapted_layers(model):
        update = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        moved = not torch.equal(layer.base_layer.weight, original_weight(original, name))
        assert moved == (init == "olora")
        torch.testing.assert_close(layer.base_layer.weight + update, original_weight(original, name))
    default, _ = adapter()
    assert default.peft_config["default"].init_lora_weights is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--peft", "lora", "--lora_init", "eva"], "lora_init='eva' is not allowed; choose one of default, gaussian"),
        (["--peft", "lora", "--lora_init", "olora", "--merge_lora", "false"], "lora_init='olora' moves the weights'"),
        (["--lora_use_dora"], "lora_use_dora applies to a LoRA adapter; add --peft lora"),
    ],
)
def test_bad_lora_variant_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*VARIANT_FLAGS[:2], *argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
