"""Model soups: the weights of several fine-tuned models of one architecture averaged into one model, which predicts at
one model's cost (Wortsman et al. 2022, "Model soups", https://arxiv.org/abs/2203.05482).

- :func:`uniform_soup`: the element-wise mean of state dicts with the same keys and shapes.
- :func:`greedy_soup`: Wortsman's greedy soup: members in order of their own selection score, each kept only when
  the soup's selection score does not drop; the score function is the caller's (a held-out split, out-of-fold rows).
- :func:`soup_folders`: the command ``nlp-tricks average --soup {uniform,greedy}``: model folders (``save_pretrained``
  output) or PEFT LoRA adapter folders of one model, checked alike (:func:`check_soup_members`), averaged and written
  as one folder of the same kind.

LoRA adapters are averaged tensor by tensor (``lora_A``, ``lora_B`` and the ``modules_to_save`` copies, each the
element-wise mean), as the LMSYS 1st-place solution averaged its fold adapters: the soup stays one rank-r adapter. The
mean of the A and B matrices is not the mean of the updates they make: ``mean(B) @ mean(A) = mean(B_i @ A_i) +``
the cross terms ``B_i @ A_j`` (i != j) over M^2, so an adapter soup is its own model, close to the mean of the updates
only where the members' adapters stay close to each other (the same starting adapter, similar data). The exact mean of
the updates is the soup of the merged models (``merge_and_unload`` each member, then a soup of the full models),
which loses the adapter's small size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "SOUPS",
    "GreedySoup",
    "uniform_soup",
    "greedy_soup",
    "check_soup_members",
    "read_member_state",
    "soup_folders",
    "SoupError",
]

SOUPS = ("uniform", "greedy")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SOUP_INFO = "soup.json"
# config.json fields that make two models of the same shapes different models.
MODEL_FIELDS = ("architectures", "model_type", "problem_type", "id2label", "crf", "span_head", "span_flat", "pooling")
# adapter_config.json fields that make two adapters of one base different models.
ADAPTER_FIELDS = ("peft_type", "task_type", "base_model_name_or_path", "r", "lora_alpha", "target_modules",
                  "modules_to_save", "use_rslora", "use_dora", "bias")  # fmt: skip
# The files that define what a tokenizer maps text to (tokenizer_config.json also holds names and paths).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model", "added_tokens.json")  # fmt: skip


class SoupError(ValueError):
    """Members that do not make a soup (another architecture, labels, tokenizer, keys or shapes): one line."""


def uniform_soup(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of ``states`` (state dicts with the same keys, shapes and dtypes).

    Floating-point tensors are computed as ``x_0 + sum_i (x_i - x_0) / M`` in float64 and cast back to their dtype:
    identical members give back ``x_0`` bitwise (every difference is 0), and float32 / bfloat16 members lose nothing
    before the final rounding. Other tensors (integer ids, boolean masks) must be equal in every member and are
    kept.
    """
    if not states:
        raise SoupError("a soup needs at least one member")
    first = states[0]
    for i, state in enumerate(states[1:], start=1):
        if set(state) != set(first):
            extra, missing = sorted(set(state) - set(first)), sorted(set(first) - set(state))
            raise SoupError(f"member {i} has other weights than member 0 (extra {extra[:3]}, missing {missing[:3]})")
    out = {}
    for key, anchor in first.items():
        tensors = [state[key] for state in states]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1 or len({t.dtype for t in tensors}) != 1:
            raise SoupError(f"{key}: the members' shapes / dtypes differ ({sorted(shapes)})")
        if not anchor.is_floating_point():
            if any(not torch.equal(t, anchor) for t in tensors[1:]):
                raise SoupError(f"{key}: a non-float tensor that differs between members cannot be averaged")
            out[key] = anchor.clone()
            continue
        base = anchor.double()
        total = torch.zeros_like(base)
        for t in tensors[1:]:
            total += t.double() - base
        out[key] = (base + total / len(tensors)).to(anchor.dtype)
    return out


@dataclass
class GreedySoup:
    """The greedy soup's choice.

    Attributes:
        members (`list[int]`): the kept members' indices, in the order they were added.
        score (`float`): the selection score of the soup of ``members``.
        member_scores (`list[float]`): every member's own selection score.
        trials (`list[dict]`): each member tried, in order: ``{"member", "score", "kept"}``.
    """

    members: list[int]
    score: float
    member_scores: list[float]
    trials: list[dict] = field(default_factory=list)


def greedy_soup(
    count: int, score: Callable[[list[int]], float], member_scores: Sequence[float] | None = None
) -> GreedySoup:
    """Wortsman et al.'s greedy soup over ``count`` members.

    ``score(indices)`` is the selection score (higher is better) of the soup of those members. The members are tried
    in order of their own score (``member_scores``, else ``score([i])``; ties by index); the best starts the soup,
    and each next one is kept when the soup with it scores at least as well as without it. The result never scores
    below its best member on the selection set: it starts as that member and only takes steps that do not lower the
    score.
    """
    if count < 1:
        raise SoupError("a soup needs at least one member")
    own = [float(s) for s in member_scores] if member_scores is not None else [score([i]) for i in range(count)]
    if len(own) != count:
        raise SoupError(f"{len(own)} member scores for {count} members")
    order = sorted(range(count), key=lambda i: (-own[i], i))
    members, best = [order[0]], own[order[0]]
    trials = [{"member": order[0], "score": best, "kept": True}]
    for i in order[1:]:
        value = float(score([*members, i]))
        kept = value >= best
        trials.append({"member": i, "score": value, "kept": kept})
        if kept:
            members, best = [*members, i], value
    return GreedySoup(members=members, score=best, member_scores=own, trials=trials)


# ---- Folders ------------------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise SoupError(f"{path}: cannot read it ({err})") from None


def _tokenizer_digest(folder: str) -> dict[str, str]:
    """A digest of each vocabulary file; ``tokenizer.json`` without its ``truncation`` / ``padding`` state (the last
    call's settings, saved with it)."""
    digests = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if name == "tokenizer.json":
            try:
                saved = json.loads(data)
            except ValueError as err:
                raise SoupError(f"{path}: cannot read it ({err})") from None
            data = json.dumps({k: v for k, v in saved.items() if k not in ("truncation", "padding")}).encode()
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a PEFT adapter (``adapter_config.json``) rather than a whole model."""
    return os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))


def check_soup_members(folders: Sequence[str | os.PathLike]) -> str:
    """Refuse members that do not make one soup, in one :class:`SoupError` line naming two of them and what differs:
    whole models mixed with adapters, another architecture / model type / problem type / label set or order / CRF /
    span head / pooling (``config.json``), another adapter setup (``adapter_config.json``: base model, rank, alpha,
    target modules), or another tokenizer (its vocabulary files). Returns ``"model"`` or ``"adapter"``."""
    folders = [os.fspath(f) for f in folders]
    if not folders:
        raise SoupError("a soup needs at least one member")
    for folder in folders:
        if not os.path.isdir(folder):
            raise SoupError(f"{folder}: not a model folder")
    kinds = {is_adapter_folder(f) for f in folders}
    if len(kinds) != 1:
        raise SoupError("the members mix whole models and PEFT adapters; soup one kind")
    kind = "adapter" if kinds.pop() else "model"
    config_name, fields = (ADAPTER_CONFIG, ADAPTER_FIELDS) if kind == "adapter" else ("config.json", MODEL_FIELDS)
    described = []
    for folder in folders:
        path = os.path.join(folder, config_name)
        if not os.path.isfile(path):
            raise SoupError(f"{folder}: no {config_name}; a soup member is a save_pretrained folder")
        values = _read_json(path)
        described.append({name: _normalized(name, values.get(name)) for name in fields})
        described[-1]["tokenizer"] = _tokenizer_digest(folder)
    for folder, values in zip(folders[1:], described[1:]):
        for name, value in values.items():
            if value != described[0][name]:
                what = "tokenizer files" if name == "tokenizer" else f"{config_name} {name!r}"
                shown = "" if name == "tokenizer" else f" ({described[0][name]!r} vs {value!r})"
                raise SoupError(f"{folders[0]} and {folder} differ in their {what}{shown}; a soup averages one model")
    return kind


def _normalized(name: str, value):
    if name == "crf":
        return bool(value)
    if name == "architectures" and isinstance(value, list):  # a CRF model saved again names its subclass
        return [str(v).removesuffix("WithCRF") for v in value]
    if name in ("target_modules", "modules_to_save") and isinstance(value, list):
        return sorted(value)
    return value


def read_member_state(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A member's weights as saved: the adapter's tensors, or the model's state dict (sharded too), on the CPU."""
    from .runtime.checkpoint import read_state_dict

    folder = os.fspath(folder)
    if is_adapter_folder(folder):
        path = os.path.join(folder, ADAPTER_WEIGHTS)
        if not os.path.isfile(path):
            raise SoupError(f"{folder}: no {ADAPTER_WEIGHTS} (adapters saved as safetensors are averaged)")
        from safetensors.torch import load_file

        return load_file(path)
    return read_state_dict(folder)


def write_soup(state: Mapping[str, torch.Tensor], template: str | os.PathLike, output: str | os.PathLike, info: dict):
    """Write ``state`` as a folder of the template member's kind: its config / tokenizer files copied beside
    ``model.safetensors`` (or ``adapter_model.safetensors``), and ``soup.json`` (``info``)."""
    from safetensors.torch import save_file

    template, output = os.fspath(template), os.fspath(output)
    os.makedirs(output, exist_ok=True)
    from .runtime.checkpoint import DESCRIPTION_FILES

    weights = ADAPTER_WEIGHTS if is_adapter_folder(template) else "model.safetensors"
    for name in ("config.json", ADAPTER_CONFIG, "README.md", *DESCRIPTION_FILES):
        source = os.path.join(template, name)
        if os.path.isfile(source):
            shutil.copy2(source, os.path.join(output, name))
    # safetensors refuses tensors that share memory; a soup's tensors are fresh ones, one per key.
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(output, weights), metadata={"format": "pt"})
    with open(os.path.join(output, SOUP_INFO), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
        f.write("\n")


def soup_folders(
    folders: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    soup: str = "uniform",
    score: Callable[[str], float] | None = None,
) -> dict:
    """Average model (or LoRA adapter) folders of one model into ``output``; the record written to its ``soup.json``.

    Args:
        folders: ``save_pretrained`` folders of one architecture, label set and tokenizer
            (:func:`check_soup_members`), or PEFT adapter folders of one base and setup.
        output: the soup's folder (a new one: not one of ``folders``).
        soup (`str`): ``"uniform"`` (every member) or ``"greedy"`` (:func:`greedy_soup`).
        score: for ``"greedy"``: the selection score of a model folder (higher is better); each candidate soup is
            written to a scratch folder beside ``output`` and scored.
    """
    if soup not in SOUPS:
        raise SoupError(f"soup={soup!r} is not allowed; choose one of {', '.join(SOUPS)}")
    if soup == "greedy" and score is None:
        raise SoupError("a greedy soup needs a selection score (nlp-tricks average --select_command)")
    folders = [os.fspath(f) for f in folders]
    output = os.fspath(output)
    for folder in folders:
        if os.path.exists(output) and os.path.samefile(folder, output):
            raise SoupError(f"output {output} is one of the members; write the soup to a new folder")
    kind = check_soup_members(folders)
    states = [read_member_state(f) for f in folders]
    info = {"soup": soup, "kind": kind, "members": folders}
    if soup == "greedy":
        scratch = output.rstrip(os.sep) + ".candidate"

        def score_of(indices: list[int]) -> float:
            shutil.rmtree(scratch, ignore_errors=True)
            write_soup(uniform_soup([states[i] for i in indices]), folders[0], scratch, {"members": indices})
            return float(score(scratch))

        try:
            chosen = greedy_soup(len(folders), score_of)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        info.update(kept=[folders[i] for i in chosen.members], selection_score=chosen.score,
                    member_scores=chosen.member_scores, trials=chosen.trials)  # fmt: skip
        states = [states[i] for i in chosen.members]
    write_soup(uniform_soup(states), folders[0], output, info)
    return info
