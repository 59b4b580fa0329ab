"""LoRA / PEFT: parameter groups by name, the causal-LM loss through the wrapper, FGM / PGD on frozen embeddings
against the classic weight-space recipe, and exact crash-safe resume of an adapter run."""

import copy
import json
import os
import re
import signal

import pytest
import torch
from peft import LoraConfig, PromptTuningConfig, get_peft_model
from safetensors.torch import load_file, save_file
from scripts.resume_run import CountingTrainer, KillAfterSave
from torch import nn
from transformers import default_data_collator

from classic_recipes import classic_fgm, classic_pgd
from nlp_tricks import FGM, PGD, TricksTrainer, build_param_groups
from resume_helpers import killed_in_child, truncate
from tiny import bert_token_cls, one_sgd_step_trainer, token_cls_data, tricks_args
from tiny_causal import causal_lm_data, gpt2_lm, llama_lm

LR = 1e-3


def lora_token_classifier(**overrides):
    config = dict(r=4, lora_alpha=8, target_modules=["query", "value"], modules_to_save=["classifier"])
    config.update(overrides)
    return get_peft_model(bert_token_cls(), LoraConfig(**config))


def lora_causal_lm(arch="llama", **overrides):
    """LoRA on the attention of a tiny Llama (q_proj, v_proj) or GPT-2 (c_attn, a Conv1D); B starts at 0 as usual,
    so a nonzero B is set here for the gradients of A to be nonzero in a one-step test."""
    if arch == "llama":
        base, config = llama_lm(), dict(target_modules=["q_proj", "v_proj"])
    else:
        base, config = gpt2_lm(), dict(target_modules=["c_attn"], fan_in_fan_out=True)
    config.update(r=4, lora_alpha=8, **overrides)
    model = get_peft_model(base, LoraConfig(**config))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return model


def _batch(data):
    return default_data_collator([data[i] for i in range(len(data))])


def _rates(groups):
    out = {}
    for g in groups:
        for name in g["names"]:
            assert name not in out, f"{name} is in two groups"
            out[name] = g["lr"]
    return out


def _trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ---- Parameter groups -----------------------------------------------------------------------------------------------


def test_lora_token_classifier_groups_by_name():
    """BERT, 2 layers, layer_decay 0.5, head 10: the LoRA A/B of layer i at 0.5^(2 - i), the modules_to_save copy of
    the classifier at 10; frozen weights (the base model, the original classifier) in no group."""
    model = lora_token_classifier()
    rates = _rates(build_param_groups(model, learning_rate=LR, weight_decay=0.01, layer_decay=0.5, head_lr_scale=10.0))
    assert set(rates) == _trainable(model)
    assert "base_model.model.classifier.original_module.weight" not in rates
    for name, lr in rates.items():
        m = re.fullmatch(
            r"base_model\.model\.bert\.encoder\.layer\.(\d)\.attention\.self\.(query|value)\."
            r"lora_[AB]\.default\.weight",
            name,
        )
        if m:
            assert lr == pytest.approx(LR * 0.5 ** (2 - int(m.group(1)))), name
        else:
            assert re.fullmatch(r"base_model\.model\.classifier\.modules_to_save\.default\.(weight|bias)", name), name
            assert lr == pytest.approx(LR * 10.0), name


@pytest.mark.parametrize(
    "arch,module,count",
    [("llama", r"model\.layers\.(\d)\.self_attn\.[qv]_proj", 8), ("gpt2", r"transformer\.h\.(\d)\.attn\.c_attn", 4)],
)
def test_lora_causal_lm_groups_by_name(arch, module, count):
    model = lora_causal_lm(arch)
    rates = _rates(build_param_groups(model, learning_rate=LR, weight_decay=0.0, layer_decay=0.5, head_lr_scale=10.0))
    assert set(rates) == _trainable(model) and len(rates) == count  # 2 layers x (2 or 1 modules) x (A, B)
    for name, lr in rates.items():
        m = re.fullmatch(rf"base_model\.model\.{module}\.lora_[AB]\.default\.weight", name)
        assert m, name
        assert lr == pytest.approx(LR * 0.5 ** (2 - int(m.group(1)))), name


def test_prompt_tuning_parameters_train_at_the_base_rate():
    """PEFT's own parameters outside the wrapped model (a soft prompt) are neither head nor a layer."""
    model = get_peft_model(llama_lm(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    groups = build_param_groups(model, learning_rate=LR, weight_decay=0.0, layer_decay=0.5, head_lr_scale=10.0)
    assert [(g["label"], g["lr"]) for g in groups] == [("peft", LR)]
    assert set(_rates(groups)) == _trainable(model)


def test_trainer_optimizer_holds_exactly_the_trainable_parameters(tmp_path):
    model = lora_token_classifier()
    args = tricks_args(tmp_path, layer_decay=0.5, head_lr_scale=10.0)
    trainer = TricksTrainer(model=model, args=args, train_dataset=token_cls_data())
    trainer.create_optimizer()
    owned = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(owned) == len({id(p) for p in owned})
    assert {id(p) for p in owned} == {id(p) for p in model.parameters() if p.requires_grad}
    assert sorted({g["lr_scale"] for g in trainer.optimizer.param_groups}) == [0.25, 0.5, 10.0]


# ---- The causal-LM loss through the wrapper -------------------------------------------------------------------------


def test_peft_causal_lm_shifts_labels_like_its_own_loss(tmp_path):
    model = lora_causal_lm("gpt2")
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path))
    assert trainer.loss_shifts_labels  # decided on the wrapped GPT2LMHeadModel
    batch = _batch(causal_lm_data())
    torch.testing.assert_close(trainer.compute_loss(model, batch), model(**batch).loss)


# ---- FGM / PGD on frozen embeddings -------------------------------------------------------------------------------


def _classic_reference(model):
    """A copy on which the classic recipe can run: it perturbs the embedding weight by its gradient, so the weight
    must get one (requires_grad); an lm_head tied to it is untied and frozen, so only the input side moves."""
    ref = copy.deepcopy(model)
    inner = ref.get_base_model()
    weight = inner.get_input_embeddings().weight
    if inner.get_output_embeddings().weight is weight:
        inner.get_output_embeddings().weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    weight.requires_grad_(True)
    return ref, weight


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


ATTACKS = {
    "fgm": (lambda m: FGM(m, epsilon=1.0), lambda m, f, w: classic_fgm(m, f, w, epsilon=1.0)),
    "pgd": (
        lambda m: PGD(m, epsilon=1.0, alpha=0.6, steps=3),
        lambda m, f, w: classic_pgd(m, f, w, epsilon=1.0, alpha=0.6, steps=3),
    ),
}


@pytest.mark.parametrize("method", list(ATTACKS))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_attack_on_a_peft_causal_lm_equals_the_classic_recipe(arch, method):
    """GPT-2 ties lm_head to the embedding, Llama does not; both embeddings are frozen under LoRA."""
    ours_attack, classic = ATTACKS[method]
    model = lora_causal_lm(arch)
    batch = _batch(causal_lm_data())
    ref, weight = _classic_reference(model)
    classic(ref, lambda: ref(**batch).loss, weight)
    assert not model.get_input_embeddings().weight.requires_grad
    clean, adv = ours_attack(model).step(lambda: model(**batch).loss)
    ours, want = _lora_grads(model), _lora_grads(ref)
    assert set(ours) == set(want) and len(ours) > 0
    for name in want:
        torch.testing.assert_close(ours[name], want[name], msg=name)
    assert adv > clean
    assert model.get_input_embeddings().weight.grad is None  # frozen: attacked, never updated


def _classic_causal_sgd_step(model, weight, data, micro_batch, lr, attack):
    """Per micro-batch the classic attack on the model's own (shifted) loss over the step's shifted label count; the
    micro-batches' LoRA gradients summed; one SGD step on the LoRA weights."""
    items = [data[i] for i in range(len(data))]
    total = torch.tensor(sum(int(item["labels"][1:].ne(-100).sum()) for item in items))
    summed = {}
    for start in range(0, len(items), micro_batch):
        batch = default_data_collator(items[start : start + micro_batch])
        model.zero_grad()
        attack(model, lambda batch=batch: model(**batch, num_items_in_batch=total).loss, weight)
        for name, grad in _lora_grads(model).items():
            summed[name] = summed.get(name, 0) + grad
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in summed:
                p -= lr * summed[name]


@pytest.mark.parametrize("method", list(ATTACKS))
def test_trainer_step_on_a_peft_causal_lm_equals_the_classic_recipe(tmp_path, method):
    data = causal_lm_data(n=8)
    model = lora_causal_lm("gpt2")
    ref, weight = _classic_reference(model)
    _classic_causal_sgd_step(ref, weight, data, micro_batch=4, lr=0.5, attack=ATTACKS[method][1])
    trainer = one_sgd_step_trainer(
        tmp_path,
        model,
        data,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        adversarial=method,
        adv_epsilon=1.0,
        adv_alpha=0.6,
        adv_steps=3,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    for name, p in ref.named_parameters():
        if "lora_" in name:
            assert not torch.equal(p, before[name]), f"{name} did not train"
            # Summation order differs (Trainer vs reference): float32 round-off only.
            torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)
        elif name in before:
            assert torch.equal(model.get_parameter(name), before[name]), f"{name} is frozen but changed"


# ---- Save and crash-safe resume of an adapter run -----------------------------------------------------------------

MAX_STEPS, SAVE_STEPS = 8, 2
ADAPTER_CASES = {
    # model, data, TricksArguments, the file torn after the kill
    "token_classifier_focal_layer_decay": (
        lambda: lora_token_classifier(lora_dropout=0.1),
        lambda: token_cls_data(n=12),
        {"loss_type": "focal", "layer_decay": 0.8, "head_lr_scale": 5.0, "warmup_ratio": 0.25},
        "adapter_model.safetensors",
    ),
    "causal_lm_fgm_accumulation": (
        lambda: lora_causal_lm("llama", lora_dropout=0.1),
        lambda: causal_lm_data(n=12),
        {"adversarial": "fgm", "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
        "optimizer.pt",
    ),
}


def _adapter_run(out, case, kill_after_save=None, resume=False):
    make_model, make_data, config, _ = ADAPTER_CASES[case]
    model = make_model()
    args = tricks_args(out, max_steps=MAX_STEPS, save_strategy="steps", save_steps=SAVE_STEPS, **config)
    callbacks = [KillAfterSave(kill_after_save)] if kill_after_save else []
    trainer = CountingTrainer(model=model, args=args, train_dataset=make_data(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if resume else None)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    save_file(trained, os.path.join(out, "final.safetensors"))
    with open(os.path.join(out, "final_trick_state.json"), "w") as f:
        json.dump(trainer.trick_state, f)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("case", list(ADAPTER_CASES))
@pytest.mark.usefixtures("one_thread")
def test_adapter_run_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, case):
    torn = ADAPTER_CASES[case][3]
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    _adapter_run(reference, case)
    status = killed_in_child(lambda: _adapter_run(crashed, case, kill_after_save=6))
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"wait status {status}"
    checkpoint = crashed / "checkpoint-6"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(checkpoint))
    assert not any(name.startswith("model.") for name in os.listdir(checkpoint))  # the adapter only
    truncate(checkpoint / torn)  # as a crash in the middle of the save leaves it: resume falls back to checkpoint-4
    _adapter_run(crashed, case, resume=True)

    want, got = load_file(reference / "final.safetensors"), load_file(crashed / "final.safetensors")
    initial = {n: p for n, p in ADAPTER_CASES[case][0]().named_parameters() if p.requires_grad}
    assert set(got) == set(want) == set(initial)
    for name in want:
        assert not torch.equal(want[name], initial[name]), f"{name} did not train"
        # Same kernels in the same order on one thread: any difference is float32 round-off at most.
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    state = json.loads((crashed / "final_trick_state.json").read_text())
    assert state == json.loads((reference / "final_trick_state.json").read_text())
    passes = 2 if ADAPTER_CASES[case][2].get("adversarial") == "fgm" else 1
    accumulation = ADAPTER_CASES[case][2].get("gradient_accumulation_steps", 1)
    assert state["loss_calls"] == MAX_STEPS * accumulation * passes


# ---- LoRA+ -------------------------------------------------------------------------------------------------------


def _by_parameter(model, groups):
    """{name: (lr, weight_decay)} of an optimizer's groups; every trainable parameter in exactly one."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in groups:
        for p in group["params"]:
            assert names[id(p)] not in out, f"{names[id(p)]} is in two groups"
            out[names[id(p)]] = (group["lr"], group["weight_decay"])
    assert set(out) == {n for n, p in model.named_parameters() if p.requires_grad}
    return out


def _assert_same_rates(ours: dict, want: dict) -> None:
    assert set(ours) == set(want)
    for name, (lr, wd) in want.items():
        assert ours[name][0] == pytest.approx(lr, rel=1e-12) and ours[name][1] == wd, f"{name}: {ours[name]}"


LORAPLUS_MODELS = {
    "llama q/v": lambda: lora_causal_lm(),
    "llama dora": lambda: lora_causal_lm(use_dora=True),
    "llama lora biases": lambda: lora_causal_lm(lora_bias=True),
    "bert classifier (modules_to_save: a head bias)": lambda: lora_token_classifier(),
}


@pytest.mark.parametrize("name", list(LORAPLUS_MODELS))
def test_loraplus_groups_equal_peft_create_loraplus_optimizer(tmp_path, name):
    """With no other group rule on, every trainable parameter gets the learning rate and weight decay that PEFT's own
    create_loraplus_optimizer gives it: B matrices (and every other trainable 1-D parameter: DoRA's magnitudes,
    LoRA's and the head's biases) at ratio x lr, the rest at lr."""
    from peft.optimizers import create_loraplus_optimizer

    model = LORAPLUS_MODELS[name]()
    args = tricks_args(tmp_path, learning_rate=LR, weight_decay=0.01, loraplus_lr_ratio=16.0)
    ours = _by_parameter(model, TricksTrainer(model=model, args=args).create_optimizer().param_groups)
    peft_groups = create_loraplus_optimizer(
        model, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=16.0, loraplus_weight_decay=0.01
    ).param_groups
    _assert_same_rates(ours, _by_parameter(model, peft_groups))
    assert sorted({round(lr / LR, 9) for lr, _ in ours.values()}) == [1.0, 16.0]


def test_loraplus_embedding_adapters_train_at_their_own_rate(tmp_path):
    """lora.Embedding's A and B at loraplus_lr_embedding, as PEFT's function gives them where it finds them (its
    releases before the fix put none in its embedding group: there the rule written out is the reference)."""
    from peft.optimizers import create_loraplus_optimizer

    model = lora_causal_lm(target_modules=["q_proj", "embed_tokens"])
    args = tricks_args(tmp_path, learning_rate=LR, loraplus_lr_ratio=4.0, loraplus_lr_embedding=1e-4)
    ours = _by_parameter(model, TricksTrainer(model=model, args=args).create_optimizer().param_groups)
    want = {
        name: (1e-4 if "lora_embedding_" in name else 4 * LR if "lora_B" in name else LR, 0.0)
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    _assert_same_rates(ours, want)
    peft_groups = create_loraplus_optimizer(
        model, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=4.0, loraplus_lr_embedding=1e-4
    ).param_groups
    if peft_groups[1]["params"]:  # PEFT's embedding group
        _assert_same_rates(ours, _by_parameter(model, peft_groups))


def test_loraplus_multiplies_with_layer_decay(tmp_path):
    """A B matrix of layer i at lr * decay^(L - i) * ratio, its A matrix at lr * decay^(L - i) (Llama: L = 2)."""
    model = lora_causal_lm()
    args = tricks_args(tmp_path, learning_rate=LR, layer_decay=0.5, loraplus_lr_ratio=16.0)
    ours = _by_parameter(model, TricksTrainer(model=model, args=args).create_optimizer().param_groups)
    for name, (lr, _) in ours.items():
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        want = LR * 0.5 ** (2 - layer) * (16.0 if "lora_B" in name else 1.0)
        assert lr == pytest.approx(want, rel=1e-12), name


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"loraplus_lr_ratio": 0.0}, "loraplus_lr_ratio=0.0 is not allowed; it must be > 0"),
        ({"loraplus_lr_embedding": 1e-5}, "loraplus_lr_embedding applies with loraplus_lr_ratio, which is not set"),
        ({"loraplus_lr_ratio": 4.0, "loraplus_lr_embedding": -1.0}, "loraplus_lr_embedding=-1.0 is not allowed"),
    ],
)
def test_loraplus_bad_values_name_the_field(tmp_path, settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tricks_args(tmp_path, **settings)


def test_loraplus_on_a_model_without_lora_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no trainable lora_B parameter"):
        TricksTrainer(model=llama_lm(), args=tricks_args(tmp_path, loraplus_lr_ratio=16.0))


def test_layer_decay_puts_dora_magnitudes_in_their_layers(tmp_path):
    """DoRA's magnitude vectors (`...q_proj.lora_magnitude_vector.default.weight`) belong to the layer their name
    numbers: layer i of L at lr * decay^(L - i), like its A and B (Llama: L = 2); with weight decay, as upstream's
    rule gives a 1-D parameter that is neither a bias nor a norm."""
    model = lora_causal_lm(use_dora=True)
    args = tricks_args(tmp_path, learning_rate=LR, weight_decay=0.01, layer_decay=0.5)
    groups = TricksTrainer(model=model, args=args).create_optimizer().param_groups
    ours = _by_parameter(model, groups)
    magnitudes = [name for name in ours if "lora_magnitude_vector" in name]
    assert len(magnitudes) == 4
    for name in magnitudes:
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        assert ours[name] == (pytest.approx(LR * 0.5 ** (2 - layer), rel=1e-12), 0.01), name
    labels = {g["label"] for g in groups for p in g["params"] if any(p is model.get_parameter(n) for n in magnitudes)}
    assert labels == {"layer_0", "layer_1"}
