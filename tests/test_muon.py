"""Muon for the hidden matrices (``muon`` / ``muon_lr``): one trainer step against ``torch.optim.Muon`` and
``torch.optim.AdamW`` on the same tensors, which parameters each optimizer gets (tiny BERT, Llama, GPT-2, a PEFT LoRA
model), the learning rates with layer-wise decay and LoRA+, exact resume, and the refusals."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainerCallback

from nlp_tricks import TricksConfig, TricksTrainer, with_tricks
from nlp_tricks.functional.muon import MUON_SINCE, MuonWithAdamW
from nlp_tricks.trick import capability_problem
from nlp_tricks.tricks.muon import MuonTrick
from tiny import bert_seq_cls, bert_token_cls, seq_cls_data, tricks_args
from tiny_causal import gpt2_lm, llama_lm

needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason=f"torch.optim.Muon needs torch {MUON_SINCE}")

LR, WD = 1e-2, 0.1

# Which optimizer each parameter belongs on, written out per layout: the layers' attention / MLP matrices (and BERT's
# pooler, a hidden dense layer) on Muon; embeddings, heads, norms and biases on AdamW.
BERT_MATRICES = (
    r"bert\.encoder\.layer\.\d\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense"
    r"|output\.dense)\.weight|bert\.pooler\.dense\.weight"
)
LAYOUTS = {
    "bert": (lambda: bert_seq_cls(), BERT_MATRICES),
    "llama": (lambda: llama_lm(), r"model\.layers\.\d\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"),
    "gpt2": (lambda: gpt2_lm(), r"transformer\.h\.\d\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight"),
    "bert lora (query, value, word embeddings; classifier saved)": (
        lambda: lora_classifier(target_modules=["query", "value", "word_embeddings"]),
        r"base_model\.model\.bert\.encoder\.layer\.\d\.attention\.self\.(query|value)\.lora_[AB]\.default\.weight",
    ),
}


def lora_classifier(**overrides):
    config = dict(r=4, lora_alpha=8, target_modules=["query", "value"], modules_to_save=["classifier"])
    config.update(overrides)
    return get_peft_model(bert_token_cls(), LoraConfig(**config))


def _optimizer_names(trainer) -> dict[str, set[str]]:
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {
        key: {names[id(p)] for group in inner.param_groups for p in group["params"]}
        for key, inner in optimizer.optimizers.items()
    }


@needs_muon
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_matrices_go_to_muon_and_the_rest_to_adamw(tmp_path, layout):
    build, matrices = LAYOUTS[layout]
    model = build()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, muon=True), train_dataset=seq_cls_data(n=4))
    got = _optimizer_names(trainer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert got["muon"] == {n for n in trainable if re.fullmatch(matrices, n)}
    assert got["adamw"] == trainable - got["muon"]
    assert got["muon"] and got["adamw"]
    if "lora" in layout:
        assert any("lora_embedding_A" in n for n in got["adamw"]) and any("classifier" in n for n in got["adamw"])


class BeforeSteps(TrainerCallback):
    """The trainable weights and their gradients right before each optimizer step."""

    def __init__(self):
        self.weights, self.grads = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.weights.append({n: p.detach().clone() for n, p in named})
        self.grads.append({n: p.grad.detach().clone() for n, p in named})


@needs_muon
def test_three_steps_equal_torch_muon_and_adamw_on_the_same_tensors(tmp_path):
    """The trainer's steps under upstream's linear schedule, from the gradients it had: Muon (match_rms_adamw, the
    group's lr and weight decay) on the matrices, AdamW with upstream's arguments for --optim and its decay rule (none
    on biases and LayerNorm) on the rest, both at the scheduled lr of each step, bitwise."""
    steps, model, probe = 3, bert_seq_cls(), BeforeSteps()
    args = tricks_args(tmp_path, max_steps=steps, muon=True, learning_rate=LR, weight_decay=WD, max_grad_norm=0.0)
    TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=12), callbacks=[probe]).train()

    copies = {n: torch.nn.Parameter(w.clone()) for n, w in probe.weights[0].items()}
    matrices = [p for n, p in copies.items() if re.fullmatch(BERT_MATRICES, n)]
    rest = {n: p for n, p in copies.items() if not re.fullmatch(BERT_MATRICES, n)}
    decay = [p for n, p in rest.items() if not re.search(r"bias|LayerNorm", n)]
    no_decay = [p for n, p in rest.items() if re.search(r"bias|LayerNorm", n)]
    assert len(matrices) == 13 and decay and no_decay
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")
    adamw_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)  # upstream's --optim (adamw_torch_fused here)
    assert adamw_cls is torch.optim.AdamW
    adamw = adamw_cls([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], **kwargs)
    for step in range(steps):
        for name, p in copies.items():
            assert torch.equal(p.detach(), probe.weights[step][name]), (step, name)
            p.grad = probe.grads[step][name].clone()
        for group in [*muon.param_groups, *adamw.param_groups]:
            group["lr"] = LR * (float(steps - step) / float(steps))  # upstream's linear schedule, no warmup
        muon.step()
        adamw.step()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), copies[name].detach()), name


@needs_muon
def test_group_factors_apply_in_both_optimizers(tmp_path):
    """layer_decay 0.5, LoRA+ ratio 4 and muon_lr = 3 x learning_rate on a LoRA model (2 layers): each parameter's
    learning rate written out."""
    model = lora_classifier()
    args = tricks_args(tmp_path, muon=True, muon_lr=3 * LR, learning_rate=LR, layer_decay=0.5, loraplus_lr_ratio=4.0)
    trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=4))
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in model.named_parameters()}
    rates = {names[id(p)]: (g["lr"], g.get("optimizer")) for g in optimizer.param_groups for p in g["params"]}
    expected = {}
    for name in rates:
        layer = re.search(r"layer\.(\d)\.", name)
        if layer:  # LoRA's A / B of layer i of 2: decay^(2 - i), B x 4, Muon's lr x 3
            factor = 0.5 ** (2 - int(layer.group(1))) * (4.0 if "lora_B" in name else 1.0)
            expected[name] = (3 * LR * factor, "muon")
        else:  # the saved classifier: the head's lr; LoRA+ puts its bias (1-D) at x 4, as PEFT's rule
            expected[name] = (LR * (4.0 if name.endswith("bias") else 1.0), None)
    assert rates.keys() == expected.keys()
    for name, (lr, which) in expected.items():
        assert rates[name][1] == which and rates[name][0] == pytest.approx(lr, rel=1e-12), name
    assert optimizer.param_groups[0].get("optimizer") is None  # group 0 (upstream's logged lr) is AdamW's


@needs_muon
def test_resume_equals_the_uninterrupted_run_bitwise(tmp_path, one_thread):
    def run(out, resume=None):
        model = bert_seq_cls()
        args = tricks_args(
            out, max_steps=4, muon=True, learning_rate=LR, weight_decay=WD, save_strategy="steps", save_steps=2,
            train_sampling_strategy="sequential",
        )  # fmt: skip
        TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=16)).train(resume_from_checkpoint=resume)
        return model

    reference = run(tmp_path / "reference")
    run(tmp_path / "crashed")
    resumed = run(tmp_path / "crashed", resume=str(tmp_path / "crashed" / "checkpoint-2"))
    for (name, a), b in zip(reference.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    saved = torch.load(tmp_path / "crashed" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert set(saved) == {"adamw", "muon"} and saved["muon"]["state"]  # Muon's momentum buffers were restored


@needs_muon
def test_a_full_fine_tune_warns_in_one_line_and_lora_does_not(tmp_path, caplog):
    for model, warns in ((bert_seq_cls(), True), (lora_classifier(), False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nlp_tricks.tricks.muon"):
            TricksTrainer(model=model, args=tricks_args(tmp_path, muon=True), train_dataset=seq_cls_data(n=4))
        messages = [r.getMessage() for r in caplog.records if r.name == "nlp_tricks.tricks.muon"]
        assert len(messages) == int(warns)
        if warns:
            assert "\n" not in messages[0] and "Adam-pretrained" in messages[0] and "LoRA" in messages[0]


@needs_muon
def test_refusals_name_the_settings(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="muon_lr applies with muon=True"):
        tricks_args(tmp_path, muon_lr=1e-3)
    with pytest.raises(ValueError, match=r"muon_lr=-1.0 is not allowed"):
        tricks_args(tmp_path, muon=True, muon_lr=-1.0)
    model = bert_seq_cls()
    given = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="the trainer was given one"):
        TricksTrainer(model=model, args=tricks_args(tmp_path, muon=True), optimizers=(given, None))
    host, host_args = with_tricks(Seq2SeqTrainer), Seq2SeqTrainingArguments(str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="keeps its host's optimizer"):
        host(model=model, args=host_args, tricks_config=TricksConfig(muon=True))
    # An optim that builds its own groups, as upstream's GaLore handler answers (galore_torch is not installed here).
    galore = staticmethod(lambda args, model=None: (torch.optim.AdamW, {"params": [], "lr": 1e-3}))
    monkeypatch.setattr(TricksTrainer, "get_optimizer_cls_and_kwargs", galore)
    with pytest.raises(ValueError, match="optim='galore_adamw', which builds its own groups"):
        TricksTrainer(model=model, args=tricks_args(tmp_path, muon=True, optim="galore_adamw"))


def test_refused_in_one_line_on_a_torch_without_muon(tmp_path, monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    with pytest.raises(ValueError, match=rf"muon=True needs torch.optim.Muon, which torch {MUON_SINCE} added") as err:
        tricks_args(tmp_path, muon=True)
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match=rf"torch {MUON_SINCE}"):
        MuonWithAdamW([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "optimizer": "muon"}])
    tricks_args(tmp_path)  # muon off: nothing refused


def test_refused_under_deepspeed_and_fsdp_naming_why():
    trick = MuonTrick(SimpleNamespace(muon=True, muon_lr=None))  # the flags alone: any torch
    for engine, setting in (("DeepSpeed", dict(deepspeed=True)), ("FSDP", dict(fsdp=True))):
        problem = capability_problem(trick, **setting)
        assert problem.startswith(f"muon=True is not supported with {engine}: "), problem
        assert "flat shards" in problem and "muon=False" in problem and "\n" not in problem
    assert capability_problem(trick) is None  # DDP / one process
