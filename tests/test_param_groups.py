"""Parameter-group rules, each checked against names and formulas written out here."""

import re

import pytest
import torch
from transformers import (
    DistilBertConfig,
    DistilBertForSequenceClassification,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
)

from nlp_tricks import TricksTrainer, build_param_groups
from tiny import bart_lm, bert_seq_cls, seq_cls_data, tricks_args
from tiny_causal import gpt2_lm, llama_lm, neox_lm

LR = 1e-3


def _lr_of(groups):
    """name -> (lr, weight_decay), asserting each name is in exactly one group."""
    out = {}
    for g in groups:
        for name in g["names"]:
            assert name not in out, f"{name} is in two groups"
            out[name] = (g["lr"], g["weight_decay"])
    return out


def test_no_decay_matches_trainer_and_every_param_once(tmp_path):
    model = bert_seq_cls()
    model.bert.embeddings.position_embeddings.weight.requires_grad_(False)
    groups = build_param_groups(model, learning_rate=LR, weight_decay=0.01)
    lrs = _lr_of(groups)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(lrs) == trainable  # frozen one in no group, all others in one
    upstream = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True))
    expected_decay = set(upstream.get_decay_parameter_names(model)) & trainable
    assert {n for n, (_, wd) in lrs.items() if wd == 0.01} == expected_decay
    assert all(wd == 0.0 for n, (_, wd) in lrs.items() if n.endswith(".bias") or "LayerNorm" in n)
    # the group's tensors are the model's own parameters (no copies)
    params = dict(model.named_parameters())
    for g in groups:
        for name, p in zip(g["names"], g["params"]):
            assert p is params[name]


def test_head_lr_scale():
    model = bert_seq_cls()
    lrs = _lr_of(build_param_groups(model, learning_rate=LR, weight_decay=0.0, head_lr_scale=10.0))
    for name, (lr, _) in lrs.items():
        expected = LR * 10.0 if name.startswith("classifier.") else LR
        assert lr == pytest.approx(expected), name


def _bert_layer_scale(name, num_layers, decay):
    if name.startswith("bert.embeddings."):
        return decay ** (num_layers + 1)
    m = re.match(r"bert\.encoder\.layer\.(\d+)\.", name)
    if m:
        return decay ** (num_layers - int(m.group(1)))
    return 1.0  # pooler and head (head_lr_scale 1)


def test_layer_decay_bert():
    model = bert_seq_cls(num_hidden_layers=3)
    lrs = _lr_of(build_param_groups(model, learning_rate=LR, weight_decay=0.0, layer_decay=0.5, head_lr_scale=2.0))
    for name, (lr, _) in lrs.items():
        scale = 2.0 if name.startswith("classifier.") else _bert_layer_scale(name, 3, 0.5)
        assert lr == pytest.approx(LR * scale), name
    assert lrs["bert.encoder.layer.0.attention.self.query.weight"][0] == pytest.approx(LR * 0.125)
    assert lrs["bert.embeddings.word_embeddings.weight"][0] == pytest.approx(LR * 0.0625)


def test_layer_decay_bart_counts_decoder_after_encoder():
    model = bart_lm()  # 2 encoder + 2 decoder layers: L = 4
    lrs = _lr_of(build_param_groups(model, learning_rate=LR, weight_decay=0.0, layer_decay=0.5))
    assert lrs["model.shared.weight"][0] == pytest.approx(LR * 0.5**5)
    assert lrs["model.encoder.embed_positions.weight"][0] == pytest.approx(LR * 0.5**5)
    assert lrs["model.encoder.layers.0.fc1.weight"][0] == pytest.approx(LR * 0.5**4)
    assert lrs["model.encoder.layers.1.fc1.weight"][0] == pytest.approx(LR * 0.5**3)
    assert lrs["model.decoder.layers.0.fc1.weight"][0] == pytest.approx(LR * 0.5**2)
    assert lrs["model.decoder.layers.1.fc1.weight"][0] == pytest.approx(LR * 0.5**1)


def test_layer_decay_t5_and_distilbert():
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=99, d_model=16, d_kv=4, d_ff=20, num_layers=2, num_decoder_layers=1, num_heads=2)
    )
    lrs = _lr_of(build_param_groups(t5, learning_rate=LR, weight_decay=0.0, layer_decay=0.5))
    assert lrs["shared.weight"][0] == pytest.approx(LR * 0.5**4)
    assert lrs["encoder.block.0.layer.0.SelfAttention.q.weight"][0] == pytest.approx(LR * 0.5**3)
    assert lrs["decoder.block.0.layer.1.EncDecAttention.q.weight"][0] == pytest.approx(LR * 0.5**1)
    assert lrs["encoder.final_layer_norm.weight"][0] == pytest.approx(LR)

    distil = DistilBertForSequenceClassification(
        DistilBertConfig(vocab_size=99, dim=16, n_layers=2, n_heads=2, hidden_dim=20, max_position_embeddings=32)
    )
    lrs = _lr_of(build_param_groups(distil, learning_rate=LR, weight_decay=0.0, layer_decay=0.5, head_lr_scale=3.0))
    assert lrs["distilbert.embeddings.word_embeddings.weight"][0] == pytest.approx(LR * 0.5**3)
    assert lrs["distilbert.transformer.layer.0.ffn.lin1.weight"][0] == pytest.approx(LR * 0.5**2)
    assert lrs["distilbert.transformer.layer.1.ffn.lin1.weight"][0] == pytest.approx(LR * 0.5)
    assert lrs["classifier.weight"][0] == pytest.approx(LR * 3.0)


def test_layer_decay_unknown_layout_names_the_class():
    class Mystery(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)

    with pytest.raises(ValueError, match="Mystery"):
        build_param_groups(Mystery(), learning_rate=LR, weight_decay=0.0, layer_decay=0.9)
    # layer_decay 1 works on any module
    assert len(_lr_of(build_param_groups(Mystery(), learning_rate=LR, weight_decay=0.1))) == 2


def test_trainer_optimizer_uses_groups_and_scheduler_keeps_ratios(tmp_path):
    model = bert_seq_cls()
    args = tricks_args(
        tmp_path, layer_decay=0.5, head_lr_scale=4.0, warmup_ratio=0.5, max_steps=4, optim="adamw_torch"
    )
    trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data())
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    groups = trainer.optimizer.param_groups
    base = [g["initial_lr"] / g["lr_scale"] for g in groups]
    assert base == pytest.approx([LR] * len(groups))
    assert {g["lr_scale"] for g in groups} >= {4.0, 0.125, 1.0}
    # linear warmup over ceil(0.5 * 4) = 2 steps then linear decay; every group gets the same factor
    expected_factor = [0.0, 0.5, 1.0, 0.5]
    for step in range(4):
        for g in groups:
            assert g["lr"] == pytest.approx(g["initial_lr"] * expected_factor[step])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()


# ---- Decoder-only layouts ---------------------------------------------------------------------------------------


def _decoder_scale(name, layers_prefix, embeddings, top, num_layers, decay, head=10.0):
    """The rate of a decoder-only parameter, from its name: embeddings decay^(L+1), layer i decay^(L-i), the final
    norm 1, the untied lm_head the head scale."""
    if name in embeddings:
        return decay ** (num_layers + 1)
    m = re.match(re.escape(layers_prefix) + r"\.(\d+)\.", name)
    if m:
        return decay ** (num_layers - int(m.group(1)))
    if name in top:
        return 1.0
    assert name in ("lm_head.weight", "embed_out.weight"), name
    return head


DECODER_LAYOUTS = {
    # model builder, layer prefix, embeddings, final norm, L
    "llama": (lambda: llama_lm(), "model.layers", {"model.embed_tokens.weight"}, {"model.norm.weight"}, 2),
    "mistral": (
        lambda: _same_config_as_llama(MistralConfig, MistralForCausalLM),
        "model.layers",
        {"model.embed_tokens.weight"},
        {"model.norm.weight"},
        2,
    ),
    "qwen2": (
        lambda: _same_config_as_llama(Qwen2Config, Qwen2ForCausalLM),
        "model.layers",
        {"model.embed_tokens.weight"},
        {"model.norm.weight"},
        2,
    ),
    "gpt2": (
        lambda: gpt2_lm(),
        "transformer.h",
        {"transformer.wte.weight", "transformer.wpe.weight"},
        {"transformer.ln_f.weight", "transformer.ln_f.bias"},
        2,
    ),
    "gpt_neox": (
        lambda: neox_lm(),
        "gpt_neox.layers",
        {"gpt_neox.embed_in.weight"},
        {"gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias"},
        3,
    ),
}


def _same_config_as_llama(config_cls, model_cls):
    kwargs = llama_lm().config.to_diff_dict()
    kwargs.pop("architectures", None)
    kwargs.pop("model_type", None)
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs))


@pytest.mark.parametrize("layout", list(DECODER_LAYOUTS))
def test_layer_decay_decoder_layouts(layout):
    make, prefix, embeddings, top, num_layers = DECODER_LAYOUTS[layout]
    model = make()
    groups = build_param_groups(model, learning_rate=LR, weight_decay=0.0, layer_decay=0.5, head_lr_scale=10.0)
    lrs = _lr_of(groups)
    assert set(lrs) == {n for n, _ in model.named_parameters()}
    assert any(re.match(re.escape(prefix) + rf"\.{num_layers - 1}\.", n) for n in lrs)  # every layer was read
    for name, (lr, _) in lrs.items():
        assert lr == pytest.approx(LR * _decoder_scale(name, prefix, embeddings, top, num_layers, 0.5)), name


def test_tied_lm_head_is_one_parameter_in_the_embeddings_group():
    model = gpt2_lm()
    assert model.lm_head.weight is model.transformer.wte.weight
    groups = build_param_groups(model, learning_rate=LR, weight_decay=0.0, layer_decay=0.5, head_lr_scale=10.0)
    holding = [g for g in groups for p in g["params"] if p is model.lm_head.weight]
    assert len(holding) == 1 and holding[0]["label"] == "embeddings"
    assert all(len({id(p) for p in g["params"]}) == len(g["params"]) for g in groups)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))  # each parameter once
