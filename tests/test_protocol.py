"""The trick protocol as declared (nlp_tricks/trick.py) and as a user meets it: the docs' tables against the code,
order, one state store, fresh trials, and the tricks users wrote that hit walls before (each written out here)."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nlp_tricks import HOOK_RULES, Trick, TricksTrainer
from nlp_tricks import trick as protocol
from nlp_tricks._moved import MOVED
from nlp_tricks.tricks import BUILT_IN_TRICKS
from tiny import bert_seq_cls, bert_token_cls, ema_of, one_sgd_step_trainer, seq_cls_data, token_cls_data, tricks_args

DOCS = Path(__file__).parents[1] / "docs" / "tricks.md"
MARKER = "<!-- the test extracts the next python block and runs it on a tiny model -->"


def _table(text: str, heading: str, nth: int = 0) -> list[list[str]]:
    """The rows of the ``nth`` markdown table after ``heading`` (cells stripped, ``\\|`` inside a cell kept, header and
    rule dropped)."""
    tables, table = [], []
    for line in text.split(heading, 1)[1].splitlines() + [""]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            tables.append(table)
            table = []
    cells = [re.split(r"(?<!\\)\|", line.strip().strip("|")) for line in tables[nth][2:]]
    return [[cell.strip().replace("\\|", "|") for cell in row] for row in cells]


def _signature(hook: str) -> str:
    text = str(inspect.signature(getattr(Trick, hook))).replace("self, ", "").replace("(self)", "()")
    return re.sub(r"'([^']*)'", r"\1", text)


# ---- The spec against the docs -------------------------------------------------------------------------------------


def test_the_docs_hook_table_is_the_protocol():
    rows = _table(DOCS.read_text(encoding="utf-8"), "### Hooks")
    assert [row[0].strip("`") for row in rows] == list(HOOK_RULES)
    for name, signature, rule, users in rows:
        hook = name.strip("`")
        assert signature.strip("`") == f"{hook}{_signature(hook)}", hook
        assert rule == HOOK_RULES[hook] and rule in protocol.RULES, hook
        implementers = [cls.__name__ for cls in BUILT_IN_TRICKS if getattr(cls, hook) is not getattr(Trick, hook)]
        assert users == (", ".join(implementers) or "-"), hook
    assert len(HOOK_RULES) <= 18


def test_the_docs_show_the_loop_order_and_rules_of_the_protocol():
    text = DOCS.read_text(encoding="utf-8")
    loop = protocol.__doc__.split("::\n\n", 1)[1].split("\n\nLoss hooks", 1)[0]
    loop = "\n".join(line[4:] for line in loop.splitlines())
    assert f"```text\n{loop}\n```" in text
    orders = _table(text, "### Order, flags and requests")
    assert [(int(o), n.strip("`")) for o, n in orders] == sorted((cls.order, cls.__name__) for cls in BUILT_IN_TRICKS)
    assert f"runs at {protocol.DEFAULT_ORDER}" in text
    rules = _table(text, "### Hooks", nth=1)
    assert {r: d for r, d in rules} == protocol.RULES | {}  # every rule, described as the code describes it


def test_the_math_package_imports_no_trainer():
    """Every module of nlp_tricks.functional imports, in a fresh interpreter, without transformers' Trainer."""
    package = Path(__file__).parents[1] / "nlp_tricks" / "functional"
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    code = (
        "import sys\n"
        + "".join(f"import nlp_tricks.functional.{m}\n" for m in modules)
        + "bad = [m for m in sys.modules if m in ('transformers.trainer', 'transformers.trainer_callback')]\n"
        + "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
    for module in modules:
        source = (package / f"{module}.py").read_text(encoding="utf-8")
        assert not re.search(r"import .*\bTrainer(Callback)?\b", source), module


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_import_paths_are_the_moved_modules(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


# ---- Building -----------------------------------------------------------------------------------------------------


class Counter(Trick):
    """Counts optimizer steps; its count is its state."""

    def __init__(self):
        self.steps = 0

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_two_tricks_with_one_state_name_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"keep state under one name, 'Counter'; give each its own"):
        TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path), tricks=[Counter(), Counter()])
    second = Counter()
    second.name = "Counter2"
    trainer = TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path), tricks=[Counter(), second])
    assert [t.state_name for t in trainer.tricks if isinstance(t, Counter)] == ["Counter", "Counter2"]


def test_removed_hooks_and_a_second_forward_are_refused(tmp_path):
    class Old(Trick):
        def micro_batch(self, trainer):
            return None

    with pytest.raises(TypeError, match=r"implements micro_batch, which tricks no longer have; use trainer"):
        TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path), tricks=[Old()])

    class MyForward(Trick):
        def forward(self, trainer, model, inputs, labels):
            return None

    with pytest.raises(ValueError, match="each replace the forward pass; only one trick of a run may"):
        TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path), tricks=[MyForward(), MyForward()])


def test_a_trick_with_extra_backwards_is_refused_with_an_optimizer_that_steps_inside_backward(tmp_path):
    class TwoPasses(Trick):
        extra_backwards = True

        def summary(self):
            return ["two_passes=True"]

    with pytest.raises(ValueError, match=r"^two_passes=True runs several backward passes per step, but optim='lomo'"):
        TricksTrainer(model=bert_seq_cls(), args=tricks_args(tmp_path, optim="lomo"), tricks=[TwoPasses()])


def test_each_hyperparameter_trial_starts_from_a_fresh_copy_of_the_users_tricks(tmp_path, monkeypatch):
    from transformers.trainer_utils import HPSearchBackend

    monkeypatch.setattr("transformers.integrations.hp_params", lambda trial: trial.params)
    counter = Counter()
    trainer = TricksTrainer(
        model_init=lambda: bert_seq_cls(),
        args=tricks_args(tmp_path, max_steps=3),
        train_dataset=seq_cls_data(n=12),
        tricks=[counter],
    )
    trainer.hp_search_backend = HPSearchBackend.OPTUNA
    trainer.hp_space = lambda trial: dict(trial.params)
    for number in range(2):
        trainer.train(trial=SimpleNamespace(number=number, params={"learning_rate": 1e-3}))
        assert trainer.get_trick(Counter).steps == 3  # not 6: the second trial did not inherit the first's count
    assert counter.steps == 0  # the object passed in is the template, left as it was


# ---- Order ------------------------------------------------------------------------------------------------------


class Lookahead(Trick):
    """Lookahead (Zhang et al. 2019) over the trainable parameters: every k optimizer steps the slow weights move
    alpha of the way to the fast ones and the fast weights restart from them; the slow weights are its state."""

    def __init__(self, k=2, alpha=0.5, order=None):
        self.k, self.alpha, self.count, self.slow = k, alpha, 0, None
        if order is not None:
            self.order = order

    def setup(self, trainer):
        self.params = dict(trainer.model.named_parameters())

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.slow is None:
            self.slow = {n: p.detach().clone() for n, p in self.params.items()}  # (the weights after step 1)
        self.count += 1
        if self.count % self.k == 0:
            with torch.no_grad():
                for n, p in self.params.items():
                    self.slow[n].add_(p.detach() - self.slow[n], alpha=self.alpha)
                    p.copy_(self.slow[n])

    def state_dict(self):
        return {"count": self.count, "slow": self.slow}

    def load_state_dict(self, state):
        self.count, self.slow = state["count"], state["slow"]


class Probe(Trick):
    """Records the classifier's weight each time the optimizer-step event reaches it."""

    def __init__(self, order):
        self.order, self.seen = order, []

    def setup(self, trainer):
        self.weight = trainer.model.get_parameter("classifier.weight")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.seen.append(self.weight.detach().clone())


def test_order_places_a_users_lookahead_before_or_after_the_ema(tmp_path):
    """The EMA (order 1100) averages what the weights are when its event comes: after the sync of a Lookahead ordered
    before it, before the sync of one ordered after it. A probe right before the EMA (order 1099) records those
    weights; the EMA written out over them is the trainer's, and the two orders give two different averages."""
    averages = {}
    for order in (1050, 1150):
        probe, model = Probe(order=1099), bert_seq_cls()
        initial = model.get_parameter("classifier.weight").detach().clone()
        args = tricks_args(tmp_path / str(order), max_steps=4, optim="sgd", learning_rate=0.5, ema_decay=0.5)
        args.ema_warmup = False
        tricks = [Lookahead(order=order), probe]
        trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=16), tricks=tricks)
        names = [type(t).__name__ for t in trainer.tricks][-3:]
        expected = ["Lookahead", "Probe", "EMATrick"]
        assert names == (expected if order < 1100 else expected[1:] + expected[:1])
        trainer.train()
        ema = initial.float()
        for weight in probe.seen:
            ema = 0.5 * ema + 0.5 * weight.float()
        got = ema_of(trainer).state_dict()["shadow"]["classifier.weight"]
        torch.testing.assert_close(got, ema, rtol=0, atol=1e-7)  # float32 lerp vs the written-out mean
        averages[order] = got
    assert (averages[1050] - averages[1150]).abs().max() > 1e-4


# ---- Frictions of user tricks, each written out ------------------------------------------------------------------


class Penalty(Trick):
    """An L2 penalty on the classifier's weight, c * ||W||^2, once per optimizer step (the clean pass only), or in
    every pass (``clean_only=False``: what a trick without the loss context did)."""

    def __init__(self, c=0.1, clean_only=True):
        self.c, self.clean_only, self.kinds = c, clean_only, []

    def adjust_loss(self, trainer, inputs, outputs, loss):
        self.kinds.append(trainer.loss_context.pass_kind)
        if self.clean_only and trainer.loss_context.pass_kind != "clean":
            return loss
        return loss + self.c * trainer.model.get_parameter("classifier.weight").pow(2).sum()


@pytest.mark.parametrize("clean_only,times", [(True, 1), (False, 2)])
def test_a_parameter_penalty_counts_once_per_step_under_fgm(tmp_path, clean_only, times):
    """SGD is linear in the gradient: the penalty's step is -lr * 2c * W0 once (on the clean pass), twice when every
    pass adds it (the FGM passes are otherwise the same in both runs)."""
    data = seq_cls_data(n=4)
    plain_model, model = bert_seq_cls(), bert_seq_cls()
    w0 = model.get_parameter("classifier.weight").detach().clone()
    one_sgd_step_trainer(tmp_path / "a", plain_model, data, adversarial="fgm").train()
    penalty = Penalty(clean_only=clean_only)
    one_sgd_step_trainer(tmp_path / "b", model, data, [penalty], adversarial="fgm").train()
    assert penalty.kinds == ["clean", "adversarial"]
    diff = model.get_parameter("classifier.weight") - plain_model.get_parameter("classifier.weight")
    torch.testing.assert_close(diff, -0.5 * times * 2 * 0.1 * w0, rtol=1e-4, atol=1e-6)  # float32 SGD round-off


class Poly1(Trick):
    """Poly-1 (Leng et al. 2022): + eps * (1 - p_target), on the logits the loss used and their labels."""

    def __init__(self, eps=1.0):
        self.eps, self.seen = eps, []

    def adjust_loss(self, trainer, inputs, outputs, loss):
        context = trainer.loss_context
        p = F.softmax(context.logits.float(), dim=-1).gather(-1, context.labels.unsqueeze(-1)).squeeze(-1)
        self.seen.append((inputs["labels"].shape[0], outputs.logits.shape[0], context.logits, outputs.logits))
        return loss + self.eps * (1 - p).mean()


class SupCon(Trick):
    """Supervised contrastive term (Khosla et al. 2020) on the pooled features and their labels."""

    outputs_needed = frozenset({"pooled"})

    def __init__(self):
        self.rows = []

    def adjust_loss(self, trainer, inputs, outputs, loss):
        z = F.normalize(trainer.loss_context.pooled.float(), dim=-1)
        labels = trainer.loss_context.labels
        self.rows.append((z.shape[0], labels.shape[0], inputs["input_ids"].shape[0]))
        sim = z @ z.T / 0.1
        same = (labels[:, None] == labels[None, :]).float().fill_diagonal_(0)
        log_p = sim - torch.logsumexp(sim.masked_fill(torch.eye(len(z), dtype=torch.bool), -1e9), dim=-1, keepdim=True)
        return loss + 0.1 * -(log_p * same).sum() / same.sum().clamp(min=1)


def test_poly1_and_supcon_see_aligned_rows_under_rdrop_and_the_logits_after_temperature(tmp_path):
    poly, supcon = Poly1(), SupCon()
    model = bert_seq_cls(hidden_dropout_prob=0.1)
    args = tricks_args(tmp_path, max_steps=2, rdrop_alpha=1.0, temperature=2.0)
    TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=8), tricks=[poly, supcon]).train()
    assert len(poly.seen) == 2 and len(supcon.rows) == 2
    for label_rows, output_rows, used, raw in poly.seen:
        assert label_rows == output_rows == 8  # the doubled batch of 4: inputs, labels and outputs alike
        assert torch.equal(used, raw / 2.0)  # the logits the loss used: after temperature
    assert supcon.rows == [(8, 8, 8)] * 2


class SentenceTerm(Trick):
    """A per-sentence term (the mean squared logit of each labelled sentence), summed over the step's sentences and
    divided by their number: its own items, not the loss's tokens."""

    def adjust_loss(self, trainer, inputs, outputs, loss):
        context = trainer.loss_context
        labelled = inputs["labels"].ne(-100)
        per_sentence = (outputs.logits.pow(2).mean(-1) * labelled).sum(-1) / labelled.sum(-1).clamp(min=1)
        sentences = context.step_count(lambda b: b["labels"].ne(-100).any(-1).sum(), key="sentences")
        # What the trick adds is weighed by the micro-batch's share: divide it out so the step gets sum / sentences.
        return loss + per_sentence.sum() / sentences / context.share


def test_a_term_with_its_own_denominator_is_exact_under_accumulation(tmp_path):
    """Token classification (the loss counts tokens, the micro-batches hold different token counts): one SGD step
    on 4 sentences equals 2 micro-batches of 2 accumulated."""
    data = token_cls_data(n=4)
    whole, split = bert_token_cls(), bert_token_cls()
    one_sgd_step_trainer(tmp_path / "a", whole, data, [SentenceTerm()], per_device_train_batch_size=4).train()
    one_sgd_step_trainer(
        tmp_path / "b", split, data, [SentenceTerm()], per_device_train_batch_size=2, gradient_accumulation_steps=2
    ).train()
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-7, msg=name)  # float32 sums in another order


def test_lookahead_resumes_mid_cycle_to_the_uninterrupted_run(tmp_path, one_thread):
    def run(out, resume=None):
        model = bert_seq_cls()
        args = tricks_args(
            out, max_steps=6, optim="sgd", learning_rate=0.5, save_strategy="steps", save_steps=3,
            train_sampling_strategy="sequential",
        )  # fmt: skip
        trainer = TricksTrainer(model=model, args=args, train_dataset=seq_cls_data(n=24), tricks=[Lookahead(k=4)])
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer.get_trick(Lookahead)

    reference, ref_trick = run(tmp_path / "reference")
    run(tmp_path / "crashed")  # the same run; its checkpoint-3 is mid-cycle (3 of 4 steps)
    resumed, trick = run(tmp_path / "crashed", resume=str(tmp_path / "crashed" / "checkpoint-3"))
    assert trick.count == ref_trick.count == 6
    for (name, a), b in zip(reference.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)
    for name in ref_trick.slow:
        torch.testing.assert_close(trick.slow[name], ref_trick.slow[name], rtol=0, atol=1e-7, msg=name)


# ---- A user's multi-pass trick, a data stream, captured outputs ----------------------------------------------------


def _docs_example(index: int) -> dict:
    code = DOCS.read_text(encoding="utf-8").split(MARKER)[index].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/tricks.md", "exec"), namespace)
    return namespace


def test_the_docs_multi_pass_trick_equals_one_and_a_half_plain_steps(tmp_path):
    """Two passes of one micro-batch, the second at half weight: the gradient is 1.5x the plain one, so one SGD step
    equals a plain step at 1.5x the learning rate."""
    half_again = _docs_example(2)["HalfAgain"]
    data = seq_cls_data(n=4)
    plain, two_pass = bert_seq_cls(), bert_seq_cls()
    one_sgd_step_trainer(tmp_path / "a", plain, data, learning_rate=0.75).train()
    trainer = one_sgd_step_trainer(tmp_path / "b", two_pass, data, [half_again()], learning_rate=0.5)
    trainer.train()
    for (name, a), b in zip(plain.named_parameters(), two_pass.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)  # 0.75 g vs 0.5 * 1.5 g in float32
    assert trainer.state.log_history[0]["loss"] > 0


class StreamReader(Trick):
    """Reads one batch of its own data stream per micro-batch and records which rows it got."""

    def __init__(self, rows):
        self.rows, self.seen = rows, []

    def setup(self, trainer):
        self.stream = trainer.data_stream(
            "unlabelled", self.rows, batch_size=2, collate_fn=lambda xs: {"id": torch.tensor(xs)}
        )

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(self.stream.next_batch()["id"].tolist())


def test_a_tricks_data_stream_resumes_where_it_stopped(tmp_path):
    def run(out, resume=None):
        args = tricks_args(out, max_steps=6, save_strategy="steps", save_steps=3)
        reader = StreamReader(list(range(10)))
        TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=24), tricks=[reader]).train(
            resume_from_checkpoint=resume
        )
        return reader.seen

    reference = run(tmp_path / "reference")
    assert len(reference) == 6 and sorted(sum(reference[:5], [])) == list(range(10))  # an epoch of 5 batches
    resumed = run(tmp_path / "reference", resume=str(tmp_path / "reference" / "checkpoint-3"))
    assert resumed == reference[3:]


def test_outputs_needed_are_captured_in_training_forwards(tmp_path):
    class Looks(Trick):
        outputs_needed = frozenset({"hidden_states", "embedding_output", "pooled"})

        def __init__(self):
            self.ok = []

        def adjust_loss(self, trainer, inputs, outputs, loss):
            context, model = trainer.loss_context, trainer.model
            words = model.bert.embeddings.word_embeddings(inputs["input_ids"])
            self.ok.append(
                torch.equal(context.embedding_output, words)
                and len(context.hidden_states) == model.config.num_hidden_layers + 1
                and torch.equal(context.pooled, model.bert.pooler(context.hidden_states[-1]))
            )
            return loss

    looks = Looks()
    model = bert_seq_cls()
    TricksTrainer(
        model=model, args=tricks_args(tmp_path, max_steps=2), train_dataset=seq_cls_data(n=8), tricks=[looks]
    ).train()
    assert looks.ok == [True, True]


def test_sams_second_pass_replays_the_clean_passs_neftune_noise(tmp_path):
    """NEFTune draws fresh noise at every forward under upstream's hook; SAM's passes of one micro-batch share one
    draw (the noise is the captured embedding output minus the lookup at the pass's own weights)."""

    class Noise(Trick):
        outputs_needed = frozenset({"embedding_output"})

        def __init__(self):
            self.noise = {}

        def adjust_loss(self, trainer, inputs, outputs, loss):
            lookup = trainer.model.bert.embeddings.word_embeddings(inputs["input_ids"])
            context = trainer.loss_context
            self.noise[(context.micro_batch, context.pass_kind)] = (context.embedding_output - lookup).detach()
            return loss

    noise = Noise()
    args = tricks_args(
        tmp_path, max_steps=1, sam_rho=0.05, neftune_noise_alpha=5.0, per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )  # fmt: skip
    TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=4), tricks=[noise]).train()
    assert sorted(noise.noise) == [(0, "clean"), (0, "sam"), (1, "clean"), (1, "sam")]
    for micro_batch in (0, 1):
        clean, sam = noise.noise[(micro_batch, "clean")], noise.noise[(micro_batch, "sam")]
        assert clean.abs().max() > 0
        torch.testing.assert_close(sam, clean, rtol=0, atol=1e-6)  # the lookup at perturbed weights, subtracted
    assert not torch.equal(noise.noise[(0, "clean")], noise.noise[(1, "clean")])


# ---- State restored into what on_train_begin built; the raw loss beside the adjusted one ---------------------------


class RunningMean(Trick):
    """The running mean of the classifier's weight over the optimizer steps, started in ``on_train_begin`` from the
    weights training starts from (as the EMA is): resuming restores the saved mean into that tensor."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.weight = model.get_parameter("classifier.weight")
        self.mean, self.count = self.weight.detach().clone(), 0

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.count += 1
        self.mean += (self.weight.detach() - self.mean) / (self.count + 1)

    def state_dict(self):
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state):
        self.mean.copy_(state["mean"])  # the tensor on_train_begin built: restored after it, not overwritten by it
        self.count = state["count"]


def test_a_resumed_state_fills_what_on_train_begin_built(tmp_path, one_thread):
    def run(out, resume=None):
        args = tricks_args(
            out, max_steps=4, optim="sgd", learning_rate=0.5, save_strategy="steps", save_steps=2,
            train_sampling_strategy="sequential",
        )  # fmt: skip
        trick = RunningMean()
        TricksTrainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=16), tricks=[trick]).train(
            resume_from_checkpoint=resume
        )
        return trick

    reference = run(tmp_path / "reference")
    resumed = run(tmp_path / "reference", resume=str(tmp_path / "reference" / "checkpoint-2"))
    assert resumed.count == reference.count == 4
    # Restored before on_train_begin, the mean would restart from the checkpoint's weights (count 2 kept).
    torch.testing.assert_close(resumed.mean, reference.mean, rtol=0, atol=1e-7)  # the same float32 updates


class PlusConstant(Trick):
    """Adds 0.5 to the loss on the clean pass of every micro-batch: once per optimizer step, no gradient."""

    def adjust_loss(self, trainer, inputs, outputs, loss):
        return loss + 0.5 if trainer.loss_context.pass_kind == "clean" else loss


@pytest.mark.parametrize("adversarial", ["none", "fgm"])
def test_the_raw_loss_is_logged_beside_the_adjusted_one(tmp_path, adversarial):
    """Token classification with 2 accumulated micro-batches of different token counts: ``loss_raw`` is the logged
    ``loss`` of the same run without the trick (a constant changes no gradient), and ``loss`` is 0.5 above it."""
    logs = {}
    for name, tricks in (("plain", []), ("constant", [PlusConstant()])):
        args = tricks_args(
            tmp_path / name, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            adversarial=adversarial,
        )  # fmt: skip
        trainer = TricksTrainer(model=bert_token_cls(), args=args, train_dataset=token_cls_data(n=12), tricks=tricks)
        trainer.train()
        logs[name] = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs["plain"]) == len(logs["constant"]) == 3
    for plain, adjusted in zip(logs["plain"], logs["constant"]):
        assert "loss_raw" not in plain
        # Both are logged rounded to 4 decimals.
        assert adjusted["loss_raw"] == pytest.approx(plain["loss"], abs=1.1e-4)
        assert adjusted["loss"] - adjusted["loss_raw"] == pytest.approx(0.5, abs=1.1e-4)
