"""Helpers of the recipe tests: tiny files and models, running a recipe (in process or under `accelerate launch`).

A tiny BERT folder (hidden 32, 2 layers) with a WordLevel tokenizer stands in for the demo's MiniLM, so a run is
seconds. The `tiny_model` fixture (tests/conftest.py) builds it once per session.
"""

from __future__ import annotations

import csv
import json
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIG = str(ROOT / "accelerate_configs" / "cpu.yaml")
WORDS = "the a cat dog sat ran on mat in paris london john mary works at acme google new york . , - ! ? @".split()

TRAIN_CONLL = """\
-DOCSTART- -X- -X- O

John NNP B-NP B-PER
works VBZ B-VP O
at IN B-PP O
Acme NNP B-NP B-ORG
. . O O

Mary B-PER
ran O
in O
New-York B-LOC

the O
cat O
sat O
on O
Paris B-LOC
"""

TEST_CONLL = "Mary\tB-PER\nworks\tO\nat\tO\nGoogle\tB-ORG\n\nthe\tO\ndog\tO\nran\tO\n"


def demo_installed(*names):
    import importlib.util

    return all(importlib.util.find_spec(n) is not None for n in names)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }


def launch(recipe: str, args: list[str], launcher: str = "cpu", timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a recipe with `accelerate launch`: cpu.yaml (one process) or `--multi_gpu --num_processes 2` (CPU, gloo)."""
    return launch_script(ROOT / "recipes" / f"{recipe}.py", args, launcher, timeout)


def launch_script(
    script: Path, args: list[str], launcher: str = "cpu", timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run a script as :func:`launch` runs a recipe (``ddp2``: `--multi_gpu` starts 2 processes without GPUs)."""
    if launcher == "cpu":
        prefix = ["-m", "accelerate.commands.launch", "-q", "--config_file", CPU_CONFIG]
    elif launcher == "ddp2":
        prefix = [
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
        ]
    else:  # plain python, as `accelerate launch` runs a single process
        prefix = []
    cmd = [sys.executable, *prefix, str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def ner_files(tmp_path: Path, *, validate: bool = True, predict: bool = True) -> list[str]:
    """TRAIN_CONLL and TEST_CONLL written to ``tmp_path``, as the NER recipe's data flags: the test file is the
    ``--validation_file`` unless ``validate=False``, and the ``--test_file`` unless ``predict=False``."""
    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    (tmp_path / "test.conll").write_text(TEST_CONLL)
    test = str(tmp_path / "test.conll")
    flags = ["--train_file", str(tmp_path / "train.conll")]
    flags += ["--validation_file", test] if validate else []
    return flags + ["--test_file", test] if predict else flags


def tiny_args(model: str, out: Path, *extra: str) -> list[str]:
    """A short run of a tiny model; ``--tricks none``: the plain recipe, plus the tricks in ``extra`` (the tests of
    the recipes' evidence defaults leave it out)."""
    return [
        "--tricks",
        "none",
        "--model_name_or_path",
        model,
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--learning_rate",
        "1e-3",
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "1",
        "--seed",
        "0",
        *extra,
    ]


def assert_ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def launch_ddp_script(script: str, out: Path, timeout: int = 600) -> Path:
    """``tests/scripts/{script} OUT`` under `accelerate launch` with 2 processes (DDP, gloo on CPU); fails the test
    with the script's output unless it exits 0. Returns ``out``, where it wrote its files."""
    assert_ok(launch_script(ROOT / "tests" / "scripts" / script, [str(out)], "ddp2", timeout))
    return out


def rank_report(out: Path, name: str, rank: int) -> dict:
    """The ``{name}_rank{rank}.json`` that tests/ddp_helpers.save_rank wrote."""
    return json.loads((out / f"{name}_rank{rank}.json").read_text())


def assert_saved(out: Path, predictions: str, keys: list[str]) -> dict:
    for name in ("model.safetensors", "config.json", "tokenizer.json", "trainer_state.json", predictions):
        assert (out / name).is_file(), f"{name} missing in {sorted(p.name for p in out.iterdir())}"
    results = json.loads((out / "all_results.json").read_text())
    for key in keys:
        assert key in results, f"{key} missing in all_results.json: {sorted(results)}"
        assert 0.0 <= results[key] <= 1.0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    return results


CLS_ROWS = [
    ("the cat sat on the mat", "animal"),
    ("john works at google", "work"),
    ("the dog ran", "animal"),
    ("mary works at acme in paris", "work"),
    ("a cat ran in london", "animal"),
    ("john works", "work"),
]


# Nested entities, one span of two types (bank of new york: LOC and GPE), a sentence without entities: JSON lines
# records of the span-head recipes.
NESTED = [
    {"tokens": "john works at the bank of new york".split(), "entities": [
        {"start": 0, "end": 1, "type": "PER"}, {"start": 3, "end": 8, "type": "ORG"},
        {"start": 6, "end": 8, "type": "LOC"}, {"start": 6, "end": 8, "type": "GPE"}]},
    {"tokens": "mary ran in paris".split(), "entities": [
        {"start": 0, "end": 1, "type": "PER"}, {"start": 3, "end": 4, "type": "LOC"}]},
    {"tokens": "the cat sat on the mat".split(), "entities": []},
    {"tokens": "acme in london".split(), "entities": [
        {"start": 0, "end": 3, "type": "ORG"}, {"start": 2, "end": 3, "type": "LOC"}]},
]  # fmt: skip


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def write_csv(path: Path, rows: list[tuple[str, str]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(rows)


def assert_one_line_error(proc, out: Path, expected_prefix: str):
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith(expected_prefix)]
    assert len(error_lines) == 1, proc.stderr[-3000:]
    assert not (out / "all_results.json").exists()
    return error_lines[0]


def run_in_process(recipe: str, args: list[str], monkeypatch) -> int:
    """Run `python recipes/<recipe>.py ARGS` in this process; its exit status (0 when it returns)."""
    monkeypatch.setattr(sys, "argv", [f"{recipe}.py", *args])
    try:
        runpy.run_path(str(ROOT / "recipes" / f"{recipe}.py"), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code or 0
    return 0


def make_tiny_model(path: Path) -> str:
    """A BERT folder (config + safetensors) and a tokenizer saved as `save_pretrained` writes them."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",  # token_type_ids 1 on the second segment, as BERT's tokenizer
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],  # as BERT's tokenizer
    ).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=512,
        pad_token_id=0,
    )
    BertModel(config).save_pretrained(path)
    return str(path)


# A tiny chat template that keeps to the tiny vocabulary: "user : <message> . assistant :".
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
CAUSAL_WORDS = ["summarize", "following", "text", "summary", ":", "user", "assistant", "system"]


def make_tiny_causal_model(path: Path, arch: str = "llama", chat_template: bool = True) -> str:
    """A causal LM folder (tiny Llama or GPT-2 from config, safetensors) and a WordLevel tokenizer (pad 0, BOS 1, EOS
    2), with the tiny chat template or (GPT-2) none and no padding token, as GPT-2's own tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny_causal import gpt2_lm, llama_lm

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + CAUSAL_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template:
        special["pad_token"] = "<pad>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    if chat_template:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    if arch == "llama":
        model = llama_lm(vocab_size=len(vocab), max_position_embeddings=256)
    else:
        model = gpt2_lm(vocab_size=len(vocab), n_positions=256)
    model.save_pretrained(path)
    return str(path)
