"""load_state_dict_portable: every source format, wrapper prefixes, strict errors, tied weights, safe unpickling;
and the completeness checks of Trainer checkpoint folders."""

import json
import logging
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from transformers import BertForMaskedLM

from nlp_tricks import load_state_dict_portable
from nlp_tricks.runtime.checkpoint import CheckpointMismatchError
from nlp_tricks.runtime.resume import checkpoint_problem, get_last_complete_checkpoint
from tiny import bert_config, bert_seq_cls


def _reference(model: nn.Module) -> dict[str, torch.Tensor]:
    """The source's own weights by (unwrapped) name, copied before anything is loaded."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_loaded(model: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(reference)
    for name, value in reference.items():
        assert torch.equal(got[name], value), f"{name} was not loaded"


def _source_and_target(num_labels=3):
    source = bert_seq_cls(num_labels=num_labels)
    target = _fresh_seq_cls(num_labels)  # a different init, so every loaded weight must change
    assert not torch.equal(source.classifier.weight, target.classifier.weight)
    return source, target


def _fresh_seq_cls(num_labels=3):
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    return BertForSequenceClassification(bert_config(num_labels=num_labels))


# ---- Sources ---------------------------------------------------------------------------------------------------


def _write_bin_folder(folder, state, shards):
    os.makedirs(folder)
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in keys[i::shards]}
        torch.save(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


SOURCES = {
    "pt": lambda m, d: (torch.save(m.state_dict(), d / "w.pt"), d / "w.pt")[1],
    "bin": lambda m, d: (torch.save(m.state_dict(), d / "w.bin"), d / "w.bin")[1],
    "pth_model_wrapper": lambda m, d: (torch.save({"model": m.state_dict(), "epoch": 3}, d / "w.pth"), d / "w.pth")[1],
    "pt_state_dict_wrapper": lambda m, d: (
        torch.save({"state_dict": m.state_dict(), "step": 7, "lr": [1e-3]}, d / "w.pt"),
        d / "w.pt",
    )[1],
    "safetensors": lambda m, d: (save_file(m.state_dict(), str(d / "w.safetensors")), d / "w.safetensors")[1],
    "save_pretrained": lambda m, d: (m.save_pretrained(d / "sp"), d / "sp")[1],
    "save_pretrained_sharded": lambda m, d: (m.save_pretrained(d / "sh", max_shard_size="20KB"), d / "sh")[1],
    "bin_folder": lambda m, d: (_write_bin_folder(d / "bf", m.state_dict(), 1), d / "bf")[1],
    "bin_folder_sharded": lambda m, d: (_write_bin_folder(d / "bs", m.state_dict(), 3), d / "bs")[1],
    "memory": lambda m, d: m.state_dict(),
    "memory_nested_wrappers": lambda m, d: {"model": {"state_dict": m.state_dict()}, "config": {"x": 1}},
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_every_source_format_loads_every_weight(tmp_path, kind):
    source, target = _source_and_target()
    reference = _reference(source)
    src = SOURCES[kind](source, tmp_path)
    if kind == "save_pretrained_sharded":
        assert (src / "model.safetensors.index.json").is_file() and len(list(src.glob("*.safetensors"))) > 2
    returned = load_state_dict_portable(target, src)
    assert returned is target
    _assert_loaded(target, reference)
    assert all(p.device.type == "cpu" for p in target.parameters())


def test_path_given_as_str(tmp_path):
    source, target = _source_and_target()
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    load_state_dict_portable(target, str(tmp_path / "w.safetensors"))
    _assert_loaded(target, _reference(source))


# ---- Wrapper prefixes ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-process gloo group, so DistributedDataParallel can wrap a CPU model."""
    if dist.is_initialized():
        yield
        return
    init_file = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


WRAPPERS = {
    "plain": lambda m: m,
    "dp": nn.DataParallel,
    "ddp": nn.parallel.DistributedDataParallel,
    "compiled": torch.compile,
    "dp_of_compiled": lambda m: nn.DataParallel(torch.compile(m)),
    "compiled_of_dp": lambda m: torch.compile(nn.DataParallel(m)),
    "compiled_of_ddp": lambda m: torch.compile(nn.parallel.DistributedDataParallel(m)),
}
EXPECTED_PREFIX = {
    "plain": "",
    "dp": "module.",
    "ddp": "module.",
    "compiled": "_orig_mod.",
    "dp_of_compiled": "module._orig_mod.",
    "compiled_of_dp": "_orig_mod.module.",
    "compiled_of_ddp": "_orig_mod.module.",
}


class Encoder(nn.Module):
    """A submodule literally called ``module`` inside ``encoder``: its keys read ``encoder.module.weight``."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = Encoder()
        self.head = nn.Linear(4, 2)


@pytest.mark.parametrize("source_wrapper", list(WRAPPERS))
@pytest.mark.parametrize("target_wrapper", list(WRAPPERS))
def test_wrapper_prefixes_in_any_order_on_either_side(process_group, source_wrapper, target_wrapper):
    source, target = Net(0), Net(1)
    reference = _reference(source)
    wrapped_source = WRAPPERS[source_wrapper](source)
    state = wrapped_source.state_dict()
    prefix = EXPECTED_PREFIX[source_wrapper]
    # The keys really carry the wrappers' prefixes, and the inner `module.` stays in the reference names.
    assert set(state) == {prefix + k for k in reference}
    assert "encoder.module.weight" in reference
    wrapped_target = WRAPPERS[target_wrapper](target)
    assert load_state_dict_portable(wrapped_target, state) is wrapped_target
    _assert_loaded(target, reference)


def test_inner_module_key_survives_where_replace_breaks_it():
    source, target = Net(0), Net(1)
    state = nn.DataParallel(source).state_dict()
    naive = {k.replace("module.", ""): v for k, v in state.items()}  # the widely copied recipe
    assert "encoder.weight" in naive
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \(2\): encoder.module.weight, encoder.module.b"):
        load_state_dict_portable(target, naive)
    load_state_dict_portable(target, state)
    _assert_loaded(target, _reference(source))


class Holder(nn.Module):
    """A model whose only child is called ``module``: every key starts with ``module.`` without any wrapper."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.module = nn.Linear(3, 3)


@pytest.mark.parametrize("wrap", ["plain", "dp", "compiled"])
def test_model_with_a_child_called_module(wrap):
    source, target = Holder(0), Holder(1)
    reference = _reference(source)
    load_state_dict_portable(target, WRAPPERS[wrap](source).state_dict())
    _assert_loaded(target, reference)


# ---- Strict errors ---------------------------------------------------------------------------------------------


def test_strict_false_is_refused():
    source, target = _source_and_target()
    with pytest.raises(ValueError, match=r"strict=False is not allowed.*random"):
        load_state_dict_portable(target, source.state_dict(), strict=False)


def test_mismatch_error_names_missing_unexpected_and_shapes_with_counts():
    source, target = _source_and_target()
    state = source.state_dict()
    layer = [k for k in state if k.startswith("bert.encoder.layer.1.")]
    assert len(layer) == 16
    for k in layer:
        del state[k]
    state["bert.extra.weight"] = torch.zeros(2)
    state["pooler_typo.bias"] = torch.zeros(2)
    state["classifier.weight"] = torch.zeros(5, 32)
    state["classifier.bias"] = torch.zeros(5)
    with pytest.raises(CheckpointMismatchError) as error:
        load_state_dict_portable(target, state)
    message = str(error.value)
    assert "the state dict passed in does not match BertForSequenceClassification" in message
    assert f"missing keys (16): {', '.join(layer[:10])}, ... (first 10 of 16)" in message
    assert "unexpected keys (2): bert.extra.weight, pooler_typo.bias" in message
    assert "shape mismatches (2): classifier.weight: checkpoint (5, 32) vs model (3, 32), " in message
    assert "classifier.bias: checkpoint (5,) vs model (3,)" in message
    # Nothing was loaded: the target keeps its own weights.
    torch.testing.assert_close(target.state_dict()["bert.pooler.dense.bias"], _fresh_seq_cls().bert.pooler.dense.bias)


def test_mismatch_error_names_the_file_and_the_removed_prefixes(tmp_path):
    source, target = _source_and_target()
    state = nn.DataParallel(source).state_dict()
    del state["module.classifier.bias"]
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(CheckpointMismatchError) as error:
        load_state_dict_portable(target, tmp_path / "w.pt")
    assert str(tmp_path / "w.pt") in str(error.value)
    assert "missing keys (1): classifier.bias" in str(error.value)
    assert "checkpoint 'module.'" in str(error.value)


def test_non_tensor_values_without_a_wrapper_are_refused():
    with pytest.raises(TypeError, match=r"not a state dict: 1 values are not tensors \(epoch\)"):
        load_state_dict_portable(nn.Linear(2, 2), {"weight": torch.zeros(2, 2), "bias": torch.zeros(2), "epoch": 3})


def test_bad_arguments(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="map_location must be a device"):
        load_state_dict_portable(model, model.state_dict(), map_location={"cuda:0": "cpu"})
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        load_state_dict_portable(model, tmp_path / "nope.pt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"No model weights in .*model.safetensors.*it holds config.json"):
        load_state_dict_portable(model, tmp_path / "empty")


def test_old_checkpoints_with_non_persistent_buffers_load():
    """Older BERT checkpoints carry ``embeddings.position_ids``, a buffer the model builds itself and does not save."""
    source, target = _source_and_target()
    state = source.state_dict()
    assert "bert.embeddings.position_ids" not in state
    state["bert.embeddings.position_ids"] = torch.arange(64).unsqueeze(0)
    load_state_dict_portable(target, state)
    _assert_loaded(target, _reference(source))


# ---- Tied weights ----------------------------------------------------------------------------------------------


def _mlm(seed):
    torch.manual_seed(seed)
    return BertForMaskedLM(bert_config())


def test_tied_embeddings_load_from_save_pretrained_and_stay_tied(tmp_path):
    source, target = _mlm(0), _mlm(1)
    # Fine-tuning moved the shared tensor: the tie must carry the new values to both names.
    with torch.no_grad():
        source.bert.embeddings.word_embeddings.weight.add_(1.0)
    reference = _reference(source)
    embeddings = reference["bert.embeddings.word_embeddings.weight"]
    assert torch.equal(reference["cls.predictions.decoder.weight"], embeddings)
    source.save_pretrained(tmp_path / "mlm")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mlm" / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert "cls.predictions.decoder.weight" not in saved  # save_pretrained writes one name per tied tensor
    load_state_dict_portable(target, tmp_path / "mlm")
    _assert_loaded(target, reference)
    assert target.cls.predictions.decoder.weight is target.bert.embeddings.word_embeddings.weight


def test_tied_embeddings_load_from_a_full_state_dict_too():
    source, target = _mlm(0), _mlm(1)
    load_state_dict_portable(target, source.state_dict())
    _assert_loaded(target, _reference(source))


def test_tied_keys_missing_on_both_names_or_disagreeing_are_errors():
    source, target = _mlm(0), _mlm(1)
    state = source.state_dict()
    both = {k: v for k, v in state.items() if k not in ("bert.embeddings.word_embeddings.weight",)}
    both.pop("cls.predictions.decoder.weight")
    with pytest.raises(CheckpointMismatchError, match="missing keys \\(2\\)"):
        load_state_dict_portable(target, both)
    state = source.state_dict()
    state["cls.predictions.decoder.weight"] = state["cls.predictions.decoder.weight"] + 1
    with pytest.raises(CheckpointMismatchError, match="tied keys with different values"):
        load_state_dict_portable(target, state)


# ---- Safe unpickling -------------------------------------------------------------------------------------------


class CarriesCode:
    """Unpickling this object creates ``marker``: the stand-in for a checkpoint that carries code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", ["torch_save", "plain_pickle"])
def test_a_pickle_carrying_code_is_refused_and_its_code_never_runs(tmp_path, writer):
    # Control: the payload really runs when unpickled without protection.
    control = tmp_path / "control_marker"
    pickle.loads(pickle.dumps(CarriesCode(control))).close()
    assert control.exists()

    marker = tmp_path / "marker"
    path = tmp_path / "evil.bin"
    payload = {"model": {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, "extra": CarriesCode(marker)}
    if writer == "torch_save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=2)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match=r"Refusing to load .*evil.bin: it needs arbitrary unpickling"):
        load_state_dict_portable(nn.Linear(2, 2), path)
    assert not marker.exists()


# ---- Device ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_checkpoint_loads_on_cpu_and_cpu_checkpoint_on_gpu(tmp_path):
    source, target = _source_and_target()
    reference = _reference(source)
    wrapped = nn.DataParallel(torch.compile(source.cuda()))
    torch.save(wrapped.state_dict(), tmp_path / "gpu.pt")
    load_state_dict_portable(target, tmp_path / "gpu.pt", map_location="cpu")
    _assert_loaded(target, reference)
    assert all(p.device.type == "cpu" for p in target.parameters())
    load_state_dict_portable(target, tmp_path / "gpu.pt", map_location="cuda:0")
    assert all(p.device.type == "cuda" for p in target.parameters())
    _assert_loaded(target.cpu(), reference)
    load_state_dict_portable(target, wrapped.state_dict(), map_location="cpu")  # in memory, on the GPU
    assert all(p.device.type == "cpu" for p in target.parameters())
    _assert_loaded(target, reference)


# ---- Checkpoint folders ----------------------------------------------------------------------------------------


def _write_checkpoint(folder, model, step):
    """A checkpoint laid out as the Trainer writes it: weights, optimizer, scheduler, RNG, then trainer_state.json."""
    model.save_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    torch.save({"step": step}, folder / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


TEARS = {
    "no_trainer_state": (lambda d: (d / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    "trainer_state_cut": (lambda d: _truncate(d / "trainer_state.json"), "trainer_state.json is unreadable JSON"),
    "weights_cut": (lambda d: _truncate(d / "model.safetensors"), "model.safetensors is truncated"),
    "weights_cut_in_header": (lambda d: _truncate(d / "model.safetensors", 0.001), "model.safetensors is "),
    "weights_gone": (lambda d: (d / "model.safetensors").unlink(), "no model weights"),
    "optimizer_cut": (lambda d: _truncate(d / "optimizer.pt"), "optimizer.pt is truncated or unreadable"),
    "optimizer_last_bytes_cut": (lambda d: _truncate(d / "optimizer.pt", 0.999), "optimizer.pt is truncated"),
    "optimizer_empty": (lambda d: _truncate(d / "optimizer.pt", 0), "optimizer.pt is truncated or unreadable"),
    "rng_cut": (lambda d: _truncate(d / "rng_state.pth"), "rng_state.pth is truncated"),
}


@pytest.fixture(scope="module")
def complete_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "checkpoint-2"
    _write_checkpoint(folder, _mlm(0), 2)
    return folder


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_complete_checkpoint_has_no_problem(complete_checkpoint):
    assert checkpoint_problem(complete_checkpoint) is None


@pytest.mark.parametrize("tear", list(TEARS))
def test_each_torn_checkpoint_is_named_with_what_is_wrong(tmp_path, complete_checkpoint, tear):
    folder = _copy(complete_checkpoint, tmp_path / "checkpoint-4")
    damage, reason = TEARS[tear]
    damage(folder)
    problem = checkpoint_problem(folder)
    assert problem is not None and problem.startswith(reason), problem
    # The same damage really breaks loading (the checks are not stricter than the loaders).
    if tear.startswith("optimizer") or tear.startswith("rng"):
        name = "optimizer.pt" if tear.startswith("optimizer") else "rng_state.pth"
        with pytest.raises((RuntimeError, OSError, EOFError)):
            torch.load(folder / name, weights_only=True)
    if tear.startswith("weights_cut"):
        with pytest.raises(SafetensorError):
            load_state_dict_portable(_mlm(1), folder)


def test_a_missing_shard_is_a_problem(tmp_path):
    folder = tmp_path / "checkpoint-3"
    _mlm(0).save_pretrained(folder, max_shard_size="20KB")
    (folder / "trainer_state.json").write_text("{}")
    assert checkpoint_problem(folder) is None
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert checkpoint_problem(folder) == f"model.safetensors.index.json lists shards that are missing: {shard.name}"


def test_newest_complete_checkpoint_skips_torn_ones_with_a_warning(tmp_path, complete_checkpoint, caplog):
    _copy(complete_checkpoint, tmp_path / "checkpoint-2")
    _copy(complete_checkpoint, tmp_path / "checkpoint-9")
    TEARS["optimizer_cut"][0](_copy(complete_checkpoint, tmp_path / "checkpoint-10"))  # 10 > 9: numeric order
    TEARS["no_trainer_state"][0](_copy(complete_checkpoint, tmp_path / "checkpoint-12"))
    (tmp_path / "checkpoint-99.tmp").mkdir()  # not a checkpoint name
    (tmp_path / "runs").mkdir()
    with caplog.at_level(logging.WARNING, logger="nlp_tricks.runtime.resume"):
        assert get_last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-9")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert f"Skipping incomplete checkpoint {tmp_path / 'checkpoint-12'}: trainer_state.json is missing" in warnings[0]
    assert f"Skipping incomplete checkpoint {tmp_path / 'checkpoint-10'}: optimizer.pt is truncated" in warnings[1]


def test_no_complete_checkpoint(tmp_path, complete_checkpoint):
    assert get_last_complete_checkpoint(tmp_path / "absent") is None
    TEARS["weights_cut"][0](_copy(complete_checkpoint, tmp_path / "checkpoint-1"))
    assert get_last_complete_checkpoint(tmp_path) is None
