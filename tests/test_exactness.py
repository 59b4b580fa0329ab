"""What a split of the batch changes, trick by trick (benchmarks/exactness.py), and a loss whose training divisor is
not the one its help promises."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tiny import bert_token_cls, token_cls_data, tricks_args

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK = ROOT / "benchmarks" / "exactness.py"
DOCS = ROOT / "docs" / "tricks.md"


def _rows(*flags: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--json", *flags], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measured(rows: list[dict], split: str) -> dict[str, str]:
    return {r["case"]: r["measured"] for r in rows if r["split"].startswith(split)}


def _docs_table() -> dict[str, tuple[str, str]]:
    """docs/tricks.md's table of the section "Exact under accumulation and DDP": case -> (accumulation, DDP), each
    "differs" or "round-off"."""
    section = DOCS.read_text(encoding="utf-8").split("## Exact under accumulation and DDP", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) == 5 and cells[1].startswith("`"):
            verdicts = tuple("differs" if c.startswith("**differs**") else "round-off" for c in cells[2:4])
            table[cells[1].strip("`")] = verdicts
    return table


def test_the_docs_table_lists_every_case():
    sys.path.insert(0, str(BENCHMARK.parent))
    try:
        import exactness
    finally:
        sys.path.remove(str(BENCHMARK.parent))
    assert list(_docs_table()) == [case.name for case in exactness.CASES]


@pytest.mark.slow
def test_every_trick_under_accumulation_is_as_the_docs_say():
    """Each case's 2 x 2 step against its 4 x 1 step (the reference: one micro-batch, as upstream Trainer runs it):
    round-off where the code is split-invariant, a difference where the method depends on the split."""
    rows = _rows()
    assert rows and all(r["as_expected"] for r in rows), [r["case"] for r in rows if not r["as_expected"]]
    measured = _measured(rows, "accumulation")
    assert measured["fgm"] == "differs" and measured["fgm_example"] == "round-off"
    assert measured["rdrop"] == "differs" and measured["rdrop_example"] == "round-off"
    assert measured["sam"] == measured["class_weights"] == measured["crf"] == "round-off"
    assert {case: docs[0] for case, docs in _docs_table().items()} == measured


@pytest.mark.slow
def test_tricks_under_two_processes_are_as_the_docs_say():
    """2 processes x 2 examples (DDP, gloo on the CPU) against 1 process x 4."""
    cases = "plain,class_weights,fgm,fgm_example,sam,smart,smart_example"
    rows = _rows("--ddp", "--only", cases)
    assert len(rows) == 2 * len(cases.split(",")) and all(r["as_expected"] for r in rows)
    measured = _measured(rows, "ddp")
    assert measured["sam"] == measured["fgm"] == measured["smart"] == "differs"
    assert measured["plain"] == measured["class_weights"] == measured["fgm_example"] == "round-off"
    assert measured["smart_example"] == "round-off"
    assert {case: docs[1] for case, docs in _docs_table().items() if case in measured} == measured


def test_focal_alpha_training_loss_is_the_weighted_mean(tmp_path):
    """The training loss divides by the alpha weights' sum (a weighted mean like F.cross_entropy(weight=)), as
    evaluation does; it divided by the label count before."""
    from nlp_tricks import TricksTrainer

    alpha = [0.5, 1.0, 2.0, 1.0, 3.0]
    model, data = bert_token_cls(), token_cls_data(n=4)
    batch = torch.utils.data.default_collate([data[i] for i in range(4)])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # gamma = 0: focal loss with alpha is cross-entropy with alpha as its class weights (its docstring).
    want = F.cross_entropy(logits.reshape(-1, 5), batch["labels"].reshape(-1), weight=torch.tensor(alpha))
    args = tricks_args(tmp_path, max_steps=1, loss_type="focal", focal_gamma=0.0, focal_alpha=alpha)
    trainer = TricksTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    # The logged train_loss is the step's loss at the starting weights (no dropout: the same logits).
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(want.item(), rel=1e-4)
