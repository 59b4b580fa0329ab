"""Tricks on the trainers users already have: ``with_tricks(Host)`` against the host alone, on tiny models offline.

Per host: with no trick, losses, logged metrics and weights equal the host alone (bitwise: same kernels, same data
order); with FGM / EMA / layer decay the trick takes effect while the host's metrics come from the clean pass; the
tricks a host's loss cannot take are refused in one line. The hosts are an optional extra (``pip install -e
".[hosts]"``): a test skips, saying why, where its host is not installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import math
import pathlib
import tempfile
import textwrap

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from nlp_tricks import Trick, TricksConfig, with_tricks
from tiny import bart_lm, seq2seq_data
from tiny_causal import VOCAB, llama_lm

COMMON = dict(
    max_steps=2, per_device_train_batch_size=4, report_to="none", use_cpu=True, logging_steps=1, seed=0,
    dataloader_num_workers=0, disable_tqdm=True, save_strategy="no",
)  # fmt: skip


# The trl tests skip, saying why, where trl is not installed (the floors end of CI tests without the hosts extra).
needs_trl = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install -e '.[hosts]')"
)


def _needs(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[hosts]')")


def causal_tokenizer():
    """A word-level tokenizer with an end-of-sequence token, as the trl trainers need."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]", "the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


def _logs(trainer, keys):
    return [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]


def _same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---- trl: SFT -----------------------------------------------------------------------------------------------------


def _sft(cls, **kwargs):
    trl = _needs("trl")
    from datasets import Dataset

    data = Dataset.from_list([{"text": "the cat sat on a mat"[: 9 + 3 * (i % 4)]} for i in range(8)])
    args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), **{**COMMON, **kwargs.pop("args", {})})
    trainer = cls(
        model=llama_lm(vocab_size=VOCAB), args=args, train_dataset=data, processing_class=causal_tokenizer(), **kwargs
    )
    trainer.train()
    return trainer


SFT_METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens", "learning_rate")


@needs_trl
def test_sft_with_no_trick_is_the_host(tmp_path):
    from trl import SFTTrainer

    host, ours = _sft(SFTTrainer), _sft(with_tricks(SFTTrainer))
    assert _logs(ours, SFT_METRICS) == _logs(host, SFT_METRICS)
    assert ours.args.learning_rate == host.args.learning_rate == 2e-5  # SFT's own default, kept
    assert _same_weights(ours.model, host.model)


@needs_trl
def test_sft_fgm_logs_the_attack_and_the_hosts_metrics_of_the_clean_pass():
    from trl import SFTTrainer

    host = _sft(SFTTrainer)
    ours = _sft(with_tricks(SFTTrainer), tricks_config=TricksConfig(adversarial="fgm"))
    logs, plain = _logs(ours, (*SFT_METRICS, "loss_adv")), _logs(host, SFT_METRICS)
    assert all("loss_adv" in entry for entry in logs)
    # Step 1 runs from the same weights: the clean pass is the host's own step, metrics and all.
    assert {k: logs[0][k] for k in SFT_METRICS} == plain[0]
    assert [e["num_tokens"] for e in logs] == [e["num_tokens"] for e in plain]  # not doubled by the attack's pass


@needs_trl
def test_a_users_penalty_counts_once_per_step_on_a_host():
    """SGD is linear in the gradient: a constant c * ||W||^2 on the clean pass of each of 2 micro-batches moves W by
    -lr * 2c * W0 once (the host normalises its loss by the step's token count)."""
    from trl import SFTTrainer

    class Penalty(Trick):
        def adjust_loss(self, trainer, inputs, outputs, loss):
            if trainer.loss_context.pass_kind != "clean":
                return loss
            return loss + 0.1 * trainer.model.get_parameter("lm_head.weight").pow(2).sum()

    sgd = {
        "max_steps": 1,
        "optim": "sgd",
        "learning_rate": 0.5,
        "max_grad_norm": 0.0,
        "per_device_train_batch_size": 2,
    }
    sgd.update(gradient_accumulation_steps=2, weight_decay=0.0)
    w0 = llama_lm(vocab_size=VOCAB).get_parameter("lm_head.weight").detach()
    plain = _sft(with_tricks(SFTTrainer), args=sgd)
    penalised = _sft(with_tricks(SFTTrainer), args=sgd, tricks=[Penalty()])
    diff = penalised.model.get_parameter("lm_head.weight") - plain.model.get_parameter("lm_head.weight")
    torch.testing.assert_close(diff, -0.5 * 2 * 0.1 * w0, rtol=1e-4, atol=1e-6)  # float32 SGD round-off


@needs_trl
def test_sft_ema_is_the_saved_model(tmp_path):
    from trl import SFTTrainer

    from nlp_tricks.tricks.ema import ExponentialMovingAverage

    trainer = _sft(with_tricks(SFTTrainer), tricks_config=TricksConfig(ema_decay=0.5))
    ema = trainer.get_trick(ExponentialMovingAverage).ema
    assert ema.num_updates == 2
    trainer.save_model(str(tmp_path / "final"))
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "final" / "model.safetensors")
    raw = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    averaged = dict(trainer.averaged_model().named_parameters())
    for name, value in ema.state_dict()["shadow"].items():
        torch.testing.assert_close(saved[name].float(), value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(averaged[name].detach().float(), value, rtol=0, atol=0, msg=name)
    # trainer.model keeps the raw weights (training goes on from them), untouched by averaged_model()
    assert all(torch.equal(p, raw[name]) for name, p in trainer.model.named_parameters())
    assert not all(torch.equal(averaged[name], raw[name]) for name in raw)


@needs_trl
def test_sft_layer_decay_and_head_lr_scale_the_hosts_groups():
    from trl import SFTTrainer

    config = TricksConfig(layer_decay=0.5, head_lr_scale=10.0)
    trainer = with_tricks(SFTTrainer)(
        model=llama_lm(vocab_size=VOCAB),
        args=__import__("trl").SFTConfig(output_dir=tempfile.mkdtemp(), **COMMON),
        train_dataset=__import__("datasets").Dataset.from_list([{"text": "the cat"}] * 4),
        processing_class=causal_tokenizer(),
        tricks_config=config,
    )
    trainer.create_optimizer()
    lr = trainer.args.learning_rate
    names = {id(p): n for n, p in trainer.model.named_parameters()}

    def expected(name: str) -> float:  # the rule written out for Llama's layout (2 layers)
        if name == "lm_head.weight":
            return 10.0
        if name == "model.embed_tokens.weight":
            return 0.5**3
        if name.startswith("model.layers."):
            return 0.5 ** (2 - int(name.split(".")[2]))
        return 1.0

    seen = 0
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            assert math.isclose(group["lr"], lr * expected(names[id(p)])), names[id(p)]
            seen += 1
    assert seen == sum(1 for p in trainer.model.parameters() if p.requires_grad)


@needs_trl
def test_a_loss_trick_on_a_host_is_refused_in_one_line():
    from trl import SFTTrainer

    with pytest.raises(
        ValueError, match=r"^loss_type='focal' cannot apply to SFTTrainer: the host computes its own"
    ) as info:
        _sft(with_tricks(SFTTrainer), tricks_config=TricksConfig(loss_type="focal"))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^chunked_lm_loss=True cannot apply to SFTTrainer: the host computes"):
        _sft(with_tricks(SFTTrainer), tricks_config=TricksConfig(chunked_lm_loss=True))  # it did nothing, silently
    with pytest.raises(TypeError, match="tricks_config takes nlp_tricks.TricksConfig"):
        _sft(with_tricks(SFTTrainer), tricks_config={"adversarial": "fgm"})


# ---- trl: DPO, reward ------------------------------------------------------------------------------------------


def _preferences():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": "the cat", "chosen": " sat on a mat", "rejected": " ran"}] * 8)


def _dpo(cls, **kwargs):
    trl = _needs("trl")
    args = trl.DPOConfig(output_dir=tempfile.mkdtemp(), **{**COMMON, **kwargs.pop("args", {})})
    trainer = cls(
        llama_lm(vocab_size=VOCAB), ref_model=llama_lm(vocab_size=VOCAB), args=args, train_dataset=_preferences(),
        processing_class=causal_tokenizer(), **kwargs,
    )  # fmt: skip
    trainer.train()
    return trainer


DPO_METRICS = ("loss", "rewards/margins", "rewards/chosen", "logps/chosen", "num_tokens")


@needs_trl
def test_dpo_with_no_trick_is_the_host_and_fgm_keeps_the_clean_passs_rewards():
    from trl import DPOTrainer

    host, ours = _dpo(DPOTrainer), _dpo(with_tricks(DPOTrainer))  # ref_model by keyword, model positional
    assert _logs(ours, DPO_METRICS) == _logs(host, DPO_METRICS)
    assert _same_weights(ours.model, host.model)
    attacked = _dpo(with_tricks(DPOTrainer), tricks_config=TricksConfig(adversarial="fgm"))
    first = _logs(attacked, (*DPO_METRICS, "loss_adv"))[0]
    assert "loss_adv" in first and {k: first[k] for k in DPO_METRICS} == _logs(host, DPO_METRICS)[0]
    assert first["rewards/margins"] == 0.0  # the policy is the reference at step 1: the clean pass's margin


def _reward(cls, **kwargs):
    trl = _needs("trl")
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    config = llama_lm(vocab_size=VOCAB).config
    config.num_labels, config.pad_token_id = 1, 0
    model = LlamaForSequenceClassification(config)
    args = trl.RewardConfig(output_dir=tempfile.mkdtemp(), **{**COMMON, **kwargs.pop("args", {})})
    data = _preferences().map(lambda e: {k: e["prompt"] + e[k] for k in ("chosen", "rejected")})
    data = data.remove_columns("prompt")
    trainer = cls(model=model, args=args, train_dataset=data, processing_class=causal_tokenizer(), **kwargs)
    trainer.train()
    return trainer


@needs_trl
def test_reward_trainer_fgm_keeps_the_clean_passs_accuracy_and_margin():
    from trl import RewardTrainer

    keys = ("loss", "accuracy", "margin", "mean_reward")
    host, ours = _reward(RewardTrainer), _reward(with_tricks(RewardTrainer))
    assert _logs(ours, keys) == _logs(host, keys)
    attacked = _reward(with_tricks(RewardTrainer), tricks_config=TricksConfig(adversarial="fgm"))
    first = _logs(attacked, (*keys, "loss_adv"))[0]
    assert "loss_adv" in first and {k: first[k] for k in keys} == _logs(host, keys)[0]


TABLE = {
    "pgd": ({"adversarial": "pgd"}, "loss_adv"),
    "awp": ({"adversarial": "awp"}, "loss_adv"),
    "freelb": ({"adversarial": "freelb"}, "loss_adv"),
    "sam": ({"sam_rho": 0.05}, "loss_sam"),
    "ema": ({"ema_decay": 0.5}, None),
    "swa": ({"swa_last_k": 2}, None),
    "freeze": ({"freeze_layers": 1}, None),
    "reinit": ({"reinit_layers": 1}, None),
    "layer_decay": ({"layer_decay": 0.9, "head_lr_scale": 2.0}, "lr/head"),
}


@pytest.mark.slow  # 27 tiny trainings of 2 steps
@pytest.mark.parametrize("name", sorted(TABLE))
@pytest.mark.parametrize("host", ["sft", "dpo", "reward"])
@needs_trl
def test_every_trick_of_the_docs_table_trains_on_the_trl_hosts(host, name):
    from trl import DPOTrainer, RewardTrainer, SFTTrainer

    settings, logged = TABLE[name]
    run, cls = {"sft": (_sft, SFTTrainer), "dpo": (_dpo, DPOTrainer), "reward": (_reward, RewardTrainer)}[host]
    kwargs = {"args": {"save_strategy": "steps", "save_steps": 1}} if name == "swa" else {}
    trainer = run(with_tricks(cls), tricks_config=TricksConfig(**settings), **kwargs)
    assert trainer.state.global_step == 2
    if logged is not None:
        assert any(logged in e for e in trainer.state.log_history), logged


# ---- trl: GRPO, RLOO (a training_step of their own) -------------------------------------------------------------


def _rl(name: str, cls=None, **kwargs):
    """A 2-step GRPO / RLOO run (2 completions of 4 tokens per prompt, a reward of the completion's length); the host
    alone when ``cls`` is None."""
    trl = _needs("trl")
    from datasets import Dataset

    host, config = {"grpo": (trl.GRPOTrainer, trl.GRPOConfig), "rloo": (trl.RLOOTrainer, trl.RLOOConfig)}[name]
    settings = dict(num_generations=2, max_completion_length=4, beta=0.0)  # beta 0: no reference model to load
    args = config(output_dir=tempfile.mkdtemp(), **COMMON, **settings)
    torch.manual_seed(0)
    trainer = (cls or host)(
        model=llama_lm(vocab_size=VOCAB), args=args, train_dataset=Dataset.from_list([{"prompt": "the cat"}] * 8),
        processing_class=causal_tokenizer(), reward_funcs=lambda completions, **_: [len(c) for c in completions],
        **kwargs,
    )  # fmt: skip
    trainer.train()
    return trainer


RL_METRICS = ("loss", "reward", "reward_std", "num_tokens", "entropy")


@needs_trl
@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_grpo_and_rloo_run_their_own_training_step_around_the_attack(name):
    """Both count their micro-batches in their own ``training_step`` (``_step``) to pick the slice of the generation
    batch: with no trick the run is the host's, and an attack's passes run inside that step, not instead of it."""
    from trl import GRPOTrainer, RLOOTrainer

    host_cls = {"grpo": GRPOTrainer, "rloo": RLOOTrainer}[name]
    host, ours = _rl(name), _rl(name, with_tricks(host_cls))
    assert _logs(ours, RL_METRICS) == _logs(host, RL_METRICS) and _same_weights(ours.model, host.model)
    attacked = _rl(name, with_tricks(host_cls), tricks_config=TricksConfig(adversarial="fgm"))
    logs = _logs(attacked, (*RL_METRICS, "loss_adv", "step_time"))
    assert all("loss_adv" in e and "step_time" in e for e in logs)  # step_time: the host's training_step ran
    assert attacked._step == host._step == 2  # the host's count of micro-batches
    assert {k: logs[0][k] for k in RL_METRICS} == _logs(host, RL_METRICS)[0]  # the clean pass's metrics


def _names_set(source: str) -> set[str]:
    """The names a class body defines and those its methods set on ``self`` (``self.x = ...``,
    ``setattr(self, "x", ...)``)."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                for target in getattr(item, "targets", [getattr(item, "target", None)]):
                    if isinstance(target, ast.Name):
                        names.add(target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1:
            owner, name = node.args[0], node.args[1]
            if getattr(owner, "id", None) == "self" and isinstance(name, ast.Constant):
                names.add(name.value)
    return names - {"__doc__", "__module__", "__qualname__", "__init__"}


def _host_classes() -> list[type]:
    """Every Trainer subclass trl and sentence-transformers define, in their modules named *trainer*."""
    import pkgutil

    from transformers import Trainer

    found = []
    for package in ("trl", "sentence_transformers"):
        if importlib.util.find_spec(package) is None:
            continue
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if not info.name.rsplit(".", 1)[-1].endswith("trainer"):
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an optional dependency of that trainer missing: not a host here
                continue
            found += [
                obj
                for obj in vars(module).values()
                if isinstance(obj, type) and issubclass(obj, Trainer) and obj.__module__ == module.__name__
            ]
    return found


def test_no_attribute_of_ours_shadows_a_hosts():
    """What TricksTrainer, its mixins, the host glue and the tricks define or set on the trainer, against what each
    host class (trl, sentence-transformers) defines or sets: names upstream's Trainer has are deliberate overrides;
    any other name both set is one the host's code would read as its own (trl's ``_step`` was one)."""
    from transformers import Trainer

    import nlp_tricks

    upstream = _names_set(inspect.getsource(Trainer))
    ours = set()
    for cls in with_tricks(Seq2SeqTrainer).__mro__[1:]:  # [0]: made by with_tricks, with no body
        if cls.__module__.startswith("nlp_tricks"):
            ours |= _names_set(inspect.getsource(cls))
    for path in pathlib.Path(nlp_tricks.__file__).parent.rglob("*.py"):  # the tricks and helpers: trainer.x = ...
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if getattr(node.value, "id", None) == "trainer":
                    ours.add(node.attr)
    ours -= upstream
    hosts = _host_classes()
    if not hosts:
        pytest.skip("neither trl nor sentence-transformers is installed (pip install -e '.[hosts]')")
    clashes = {}
    for host in hosts:
        theirs = set()
        for cls in host.__mro__:
            if cls.__module__.split(".")[0] in ("trl", "sentence_transformers"):
                theirs |= _names_set(inspect.getsource(cls))
        if ours & theirs:
            clashes[f"{host.__module__}.{host.__qualname__}"] = sorted(ours & theirs)
    assert not clashes, clashes


# ---- sentence-transformers, Seq2SeqTrainer, SetFit -------------------------------------------------------------


def test_sentence_transformer_trainer_takes_fgm_ema_and_layer_decay(tiny_model):
    st = _needs("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    def model():
        torch.manual_seed(0)
        return st.SentenceTransformer(tiny_model, device="cpu")  # the tiny BERT folder, mean pooling added

    data = Dataset.from_list([{"anchor": "the cat sat", "positive": "a cat sat on a mat"}] * 8)

    def run(cls, **kwargs):
        m = model()
        args = st.SentenceTransformerTrainingArguments(output_dir=tempfile.mkdtemp(), **COMMON)
        loss = MultipleNegativesRankingLoss(m)
        trainer = cls(model=m, args=args, train_dataset=data, loss=loss, **kwargs)
        trainer.train()
        return trainer

    host, ours = run(st.SentenceTransformerTrainer), run(with_tricks(st.SentenceTransformerTrainer))
    assert _logs(ours, ("loss",)) == _logs(host, ("loss",)) and _same_weights(ours.model, host.model)
    config = TricksConfig(adversarial="fgm", ema_decay=0.5, layer_decay=0.5)
    trick = run(with_tricks(st.SentenceTransformerTrainer), tricks_config=config)
    assert all("loss_adv" in e for e in trick.state.log_history if "loss" in e)  # no adv_target needed
    scales = {g["lr_scale"] for g in trick.optimizer.param_groups}
    assert {0.5**3, 0.5**2, 0.5, 1.0} <= scales  # the host's groups split by layer (embeddings 0.5^(L+1))


def test_a_cached_loss_refuses_the_embedding_attacks_and_trains_awp_and_sam_as_uncached(tiny_model):
    """GradCache takes the loss from embeddings computed without gradients; the embedding attacks would see only the
    forward inside backward (``loss_adv`` == ``loss``, a wrong gradient): refused. AWP and SAM perturb the weights,
    which both forwards see: one SGD step with the cached loss equals it with the plain loss (dropout off, one
    batch: the same numbers in another order)."""
    st = _needs("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )

    data = Dataset.from_list([{"anchor": "the cat sat", "positive": "a cat sat on a mat"}, {"anchor": "john works",
                             "positive": "mary works at acme"}] * 4)  # fmt: skip

    def run(cached: bool, **config):
        torch.manual_seed(0)
        model = st.SentenceTransformer(tiny_model, device="cpu")
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        loss = (
            CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
            if cached
            else MultipleNegativesRankingLoss(model)
        )
        args = st.SentenceTransformerTrainingArguments(
            output_dir=tempfile.mkdtemp(), **{**COMMON, "max_steps": 1, "optim": "sgd", "learning_rate": 1.0}
        )
        trainer = with_tricks(st.SentenceTransformerTrainer)(
            model=model, args=args, train_dataset=data, loss=loss, tricks_config=TricksConfig(**config)
        )
        trainer.train()
        return trainer

    for attack in ("fgm", "pgd", "freelb"):
        with pytest.raises(ValueError) as info:
            run(True, adversarial=attack)
        loss, host = "CachedMultipleNegativesRankingLoss", "SentenceTransformerTrainer"
        assert str(info.value).startswith(
            f"adversarial={attack!r} cannot apply to {loss} on {host}: the loss caches gradients (GradCache)"
        ) and "\n" not in str(info.value)
    for config in ({"adversarial": "awp"}, {"sam_rho": 0.05}):
        plain, cached = run(False, **config), run(True, **config)
        for p, q in zip(plain.model.parameters(), cached.model.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6)  # float32 sums in another order (mini-batches)


def test_seq2seq_trainer_with_no_trick_is_the_host(tmp_path):
    def run(cls):
        args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / cls.__name__), **COMMON)
        trainer = cls(model=bart_lm(), args=args, train_dataset=seq2seq_data())
        trainer.train()
        return trainer

    host, ours = run(Seq2SeqTrainer), run(with_tricks(Seq2SeqTrainer))
    assert _logs(ours, ("loss",)) == _logs(host, ("loss",)) and _same_weights(ours.model, host.model)


def test_plain_trainer_with_no_trick_is_the_host_and_takes_fgm(tmp_path):
    """with_tricks(Trainer) itself: upstream's step below it (no second Trainer in its bases)."""
    from transformers import Trainer, TrainingArguments

    def run(cls, **kwargs):
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), **COMMON)
        trainer = cls(model=bart_lm(), args=args, train_dataset=seq2seq_data(), **kwargs)
        trainer.train()
        return trainer

    host, ours = run(Trainer), run(with_tricks(Trainer))
    assert _logs(ours, ("loss",)) == _logs(host, ("loss",)) and _same_weights(ours.model, host.model)
    attacked = run(with_tricks(Trainer), tricks_config=TricksConfig(adversarial="fgm"))
    assert "loss_adv" in attacked.state.log_history[0] and not _same_weights(attacked.model, host.model)


def test_a_trainer_that_is_not_a_transformers_trainer_is_refused_with_what_to_do():
    class Trainer:  # setfit.Trainer runs its own loop
        pass

    Trainer.__module__ = "setfit.trainer"
    with pytest.raises(
        TypeError, match=r"^with_tricks takes a transformers.Trainer subclass, got setfit\.trainer\.Trainer; "
    ):
        with_tricks(Trainer)
