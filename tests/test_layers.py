"""Re-initialised top layers (against BERT's init written out; everything else bitwise the loaded weights) and frozen
bottom layers (bitwise unchanged, no optimizer state; after unfreeze_at_step their state counts from that step),
with layer-wise decay and LoRA."""

import pytest
import torch
from transformers import BertForSequenceClassification, LlamaForSequenceClassification, TrainerCallback

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.functional.layers import freeze_bottom_layers, reinit_top_layers, seeded
from tiny import bart_lm, bert_seq_cls, ema_of, seq_cls_data, tricks_args
from tiny_causal import llama_lm

FROZEN_BY_ONE = ("bert.embeddings.", "bert.encoder.layer.0.")


@pytest.fixture(scope="module")
def pretrained_bert(tmp_path_factory) -> str:
    """A saved BERT, so that loading marks its weights initialised (transformers' init then skips them)."""
    folder = tmp_path_factory.mktemp("bert")
    bert_seq_cls(num_labels=3, num_hidden_layers=3).save_pretrained(folder)
    return str(folder)


def _load(folder):
    return BertForSequenceClassification.from_pretrained(folder)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- reinit_layers ----------------------------------------------------------------------------------------------


def _bert_init_written_out(model, k: int, seed: int) -> dict[str, torch.Tensor]:
    """BERT's init for the top k layers and the pooler, drawn in module order: Linear weight ~ N(0, 0.02) and zero
    bias; LayerNorm weight 1 and bias 0."""
    std = model.config.initializer_range
    torch.manual_seed(seed)
    out = {}
    layers = model.bert.encoder.layer
    for prefix, root in [
        *((f"bert.encoder.layer.{i}", layers[i]) for i in range(len(layers) - k, len(layers))),
        ("bert.pooler", model.bert.pooler),
    ]:
        for name, module in root.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            if isinstance(module, torch.nn.Linear):
                out[f"{full}.weight"] = torch.empty_like(module.weight).normal_(0.0, std)
                out[f"{full}.bias"] = torch.zeros_like(module.bias)
            elif isinstance(module, torch.nn.LayerNorm):
                out[f"{full}.weight"] = torch.ones_like(module.weight)
                out[f"{full}.bias"] = torch.zeros_like(module.bias)
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_reinit_draws_berts_init_for_the_top_layers_and_keeps_every_other_weight(pretrained_bert, tmp_path, k):
    model = _load(pretrained_bert)
    loaded = _snapshot(model)
    expected = _bert_init_written_out(_load(pretrained_bert), k, seed=5)
    torch.manual_seed(99)  # the global RNG's state does not matter
    TricksTrainer(model=model, args=tricks_args(tmp_path, reinit_layers=k, seed=5))
    for name, param in model.named_parameters():
        if name in expected:
            assert torch.equal(param, expected[name]), f"{name} is not BERT's init under the seed"
        else:
            assert torch.equal(param, loaded[name]), f"{name} changed"
    assert any(n.startswith(f"bert.encoder.layer.{3 - k}.") for n in expected)
    assert not any(n.startswith(f"bert.encoder.layer.{2 - k}.") for n in expected)


def test_reinit_is_reproducible_under_the_seed(pretrained_bert, tmp_path):
    runs = []
    for seed in (3, 3, 4):
        model = _load(pretrained_bert)
        torch.manual_seed(1000 + len(runs))
        TricksTrainer(model=model, args=tricks_args(tmp_path, reinit_layers=1, seed=seed))
        runs.append(model.bert.encoder.layer[2].attention.self.query.weight.detach().clone())
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_reinit_under_seeded_leaves_the_rng_outside_as_it_was(pretrained_bert):
    model = _load(pretrained_bert)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    with seeded(8):
        reinit_top_layers(model, 1)
    assert torch.equal(torch.rand(3), expected)


def test_reinit_on_a_decoder_only_layout(tmp_path):
    lm = llama_lm()
    lm.save_pretrained(tmp_path / "llama")
    model = LlamaForSequenceClassification.from_pretrained(tmp_path / "llama", num_labels=3)
    before = _snapshot(model)
    names = reinit_top_layers(model, 1)
    assert names == ["model.layers.1"]  # Llama has no pooler
    for name, param in model.named_parameters():
        if name.startswith("model.layers.1."):
            if name.endswith("layernorm.weight"):
                assert torch.equal(param, torch.ones_like(param))  # RMSNorm's init
            else:
                assert not torch.equal(param, before[name]), f"{name} was not re-initialised"
                assert abs(float(param.detach().std()) - lm.config.initializer_range) < 0.01
        else:
            assert torch.equal(param, before[name]), f"{name} changed"


def test_reinit_settings_are_validated(pretrained_bert, tmp_path):
    with pytest.raises(ValueError, match="reinit_layers=-1 is not allowed"):
        TricksArguments(output_dir=str(tmp_path), reinit_layers=-1)
    with pytest.raises(ValueError, match="reinit_layers=4 is not allowed for BertForSequenceClassification: it has 3"):
        TricksTrainer(model=_load(pretrained_bert), args=tricks_args(tmp_path, reinit_layers=4))
    with pytest.raises(ValueError, match="encoder-decoder"):
        reinit_top_layers(bart_lm(), 1)


# ---- freeze_layers / freeze_embeddings / unfreeze_at_step -----------------------------------------------------------


def _train(tmp_path, model=None, callbacks=(), **settings):
    model = model if model is not None else bert_seq_cls()
    args = tricks_args(tmp_path, per_device_train_batch_size=2, **{"max_steps": 4, **settings})
    trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=16))
    for callback in callbacks:
        trainer.add_callback(callback)
    before = _snapshot(model)
    trainer.train()
    return trainer, before


def _optimizer_state(trainer):
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return optimizer.state


def _in_optimizer(trainer):
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize("settings", [{}, {"layer_decay": 0.8}], ids=["plain", "layer_decay"])
def test_frozen_layers_are_bitwise_unchanged_and_have_no_optimizer_state(tmp_path, settings):
    trainer, before = _train(tmp_path, freeze_layers=1, **settings)
    state = _optimizer_state(trainer)
    for name, param in trainer.model.named_parameters():
        if name.startswith(FROZEN_BY_ONE):
            assert torch.equal(param, before[name]), f"{name} changed"
            assert param not in state and id(param) not in _in_optimizer(trainer), name
            assert not param.requires_grad
        else:
            assert not torch.equal(param, before[name]), f"{name} did not change"
            assert state[param]["step"] == 4


def test_freeze_embeddings_alone(tmp_path):
    trainer, before = _train(tmp_path, freeze_embeddings=True)
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]) == name.startswith("bert.embeddings."), name


class _Snapshot(TrainerCallback):
    def __init__(self, at_step):
        self.at_step, self.weights, self.states = at_step, None, None

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.at_step:
            self.weights = _snapshot(model)
            inner = getattr(optimizer, "optimizer", optimizer)
            self.states = {id(p) for p in inner.state}


@pytest.mark.parametrize(
    "settings",
    [{}, {"gradient_accumulation_steps": 2}, {"layer_decay": 0.8}],
    ids=["plain", "accumulation", "layer_decay"],
)
def test_unfrozen_layers_train_from_the_step_with_state_counting_from_it(tmp_path, settings):
    snapshot = _Snapshot(at_step=2)
    trainer, before = _train(tmp_path, callbacks=[snapshot], freeze_layers=1, unfreeze_at_step=2, **settings)
    state = _optimizer_state(trainer)
    for name, param in trainer.model.named_parameters():
        frozen = name.startswith(FROZEN_BY_ONE)
        if frozen:
            assert torch.equal(snapshot.weights[name], before[name]), f"{name} changed before step 2"
            assert id(param) not in snapshot.states, f"{name} had optimizer state before step 2"
        assert not torch.equal(param, before[name]), f"{name} did not change"
        assert param.requires_grad
        assert state[param]["step"] == (2 if frozen else 4), name


def test_unfreezing_does_not_thaw_a_lora_models_frozen_base(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["query", "value"], modules_to_save=["classifier"])
    model = peft.get_peft_model(bert_seq_cls(), config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    snapshot = _Snapshot(at_step=2)
    trainer, before = _train(tmp_path, model=model, callbacks=[snapshot], freeze_layers=1, unfreeze_at_step=2)
    state = _optimizer_state(trainer)
    for name, param in model.named_parameters():
        if name not in trainable:
            assert not param.requires_grad and torch.equal(param, before[name]), f"{name}: the base thawed"
            continue
        assert not torch.equal(param, before[name]), f"{name} did not change"
        in_layer_0 = ".encoder.layer.0." in name
        if in_layer_0:
            assert torch.equal(snapshot.weights[name], before[name]), f"{name} changed before step 2"
        assert state[param]["step"] == (2 if in_layer_0 else 4), name


def test_freezing_settings_are_validated(tmp_path):
    with pytest.raises(ValueError, match="unfreeze_at_step=2 needs something frozen"):
        TricksArguments(output_dir=str(tmp_path), unfreeze_at_step=2)
    with pytest.raises(ValueError, match="unfreeze_at_step=0 is not allowed"):
        TricksArguments(output_dir=str(tmp_path), freeze_layers=1, unfreeze_at_step=0)
    with pytest.raises(ValueError, match="freeze_layers=-1 is not allowed"):
        TricksArguments(output_dir=str(tmp_path), freeze_layers=-1)
    with pytest.raises(ValueError, match="freeze_layers=3 is not allowed for BertForSequenceClassification"):
        TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path, freeze_layers=3))
    with pytest.raises(ValueError, match="freeze_layers=2 and reinit_layers=1 overlap"):
        TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path, freeze_layers=2, reinit_layers=1))


def test_freeze_bottom_layers_returns_what_it_froze():
    model = bert_seq_cls()
    frozen = freeze_bottom_layers(model, 1)
    names = {n for n, p in model.named_parameters() if any(p is f for f in frozen)}
    assert names == {n for n, _ in model.named_parameters() if n.startswith(FROZEN_BY_ONE)}


def test_an_ema_averages_the_layers_that_thaw_later_and_not_those_frozen_throughout(tmp_path):
    thawing, _ = _train(tmp_path / "thaw", freeze_layers=1, unfreeze_at_step=2, ema_decay=0.9)
    assert "bert.embeddings.word_embeddings.weight" in ema_of(thawing).names
    frozen, _ = _train(tmp_path / "frozen", freeze_layers=1, ema_decay=0.9)
    assert not any(name.startswith(FROZEN_BY_ONE) for name in ema_of(frozen).names)
    assert "bert.encoder.layer.1.output.dense.weight" in ema_of(frozen).names


def test_a_resumed_run_freezes_what_its_step_says(tmp_path):
    """Resumed at step 2 of unfreeze_at_step=3: still frozen, thawed after step 3; the end equals the unbroken run."""
    settings = dict(freeze_layers=1, unfreeze_at_step=3, max_steps=4, save_strategy="steps", save_steps=2)
    full, _ = _train(tmp_path / "full", **settings)
    resumed_args = tricks_args(tmp_path / "full", per_device_train_batch_size=2, **settings)
    resumed = TricksTrainer(model=bert_seq_cls(), args=resumed_args, train_dataset=seq_cls_data(n=16))
    snapshot = _Snapshot(at_step=3)
    resumed.add_callback(snapshot)
    checkpoint = str(tmp_path / "full" / "checkpoint-2")
    from safetensors.torch import load_file

    at_2 = load_file(f"{checkpoint}/model.safetensors")
    resumed.train(resume_from_checkpoint=checkpoint)
    state = _optimizer_state(resumed)
    for name, param in resumed.model.named_parameters():
        if name.startswith(FROZEN_BY_ONE):
            assert torch.equal(snapshot.weights[name], at_2[name]), f"{name} changed at step 3"
            assert state[param]["step"] == 1, name
        torch.testing.assert_close(param, dict(full.model.named_parameters())[name], rtol=0, atol=0)


def test_a_recipe_refuses_settings_beyond_the_models_layers_in_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    from recipe_helpers import CLS_ROWS, run_in_process, tiny_args, write_csv

    write_csv(tmp_path / "train.csv", CLS_ROWS)
    out = tmp_path / "out"
    args = tiny_args(tiny_model, out, "--train_file", str(tmp_path / "train.csv"), "--reinit_layers", "9")
    assert run_in_process("classification", args, monkeypatch) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("reinit_layers=9")]
    assert lines == ["reinit_layers=9 is not allowed for BertForSequenceClassification: it has 2 layers"], err[-2000:]
    assert not (out / "all_results.json").exists()
