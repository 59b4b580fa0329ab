"""Weight averaging: an exponential moving average of the weights during training, and checkpoint averaging.

- :class:`EMA`: a float32 moving average of a model's trainable parameters, updated after every optimizer step with
  one fused ``torch._foreach_lerp_``; it swaps in for evaluation and back out bitwise, and saves to / loads from a
  safetensors file. :class:`EMACallback` wires it into any ``transformers.Trainer`` (TricksTrainer adds it for
  ``--ema_decay``).
- :func:`average_into` / :func:`average_checkpoints`: the uniform average of several checkpoints of one model
  (stochastic weight averaging over the last saves, "model soups" of one run), loaded strictly through
  :func:`~nlp_tricks.checkpoint.load_state_dict_portable`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from transformers import TrainerCallback

from .checkpoint import DESCRIPTION_FILES, CheckpointMismatchError, load_state_dict_portable, unwrap_model
from .resume import CHECKPOINT_RE, checkpoint_problem

__all__ = [
    "EMA",
    "EMACallback",
    "ema_decay_at",
    "validate_ema_decay",
    "ema_unsupported_reason",
    "average_into",
    "average_checkpoints",
    "last_complete_checkpoints",
    "EMA_STATE_NAME",
    "AVERAGING_INFO_NAME",
]

logger = logging.getLogger(__name__)

# Written into every checkpoint-N folder of a run with EMA: the average and its update count.
EMA_STATE_NAME = "ema_state.safetensors"
# Written beside a saved model whose weights are an average: {"weights": "ema" | "swa" | "average", ...}.
AVERAGING_INFO_NAME = "averaging.json"


# ---- EMA ------------------------------------------------------------------------------------------------------------


def validate_ema_decay(decay: float, name: str = "decay", *, allow_off: bool = False) -> None:
    """Raise ``ValueError`` naming the argument (``name``) unless ``decay`` is in (0, 1) (``[0, 1)`` with 0 = off)."""
    if not ((decay >= 0 if allow_off else decay > 0) and decay < 1):
        allowed = "[0, 1) (0 turns EMA off)" if allow_off else "(0, 1)"
        raise ValueError(f"{name}={decay} is not allowed; it must be in {allowed}, e.g. 0.999")


def ema_decay_at(decay: float, t: int, warmup: bool = True) -> float:
    """The decay of the EMA update that follows ``t`` earlier updates: ``min(decay, (1 + t) / (10 + t))``.

    The warm-up (Tensorflow's ``ExponentialMovingAverage(num_updates=...)``) keeps the first updates from averaging
    mostly the random-ish starting weights: 0.1 at the first update, 0.5 at the ninth, ``decay`` from
    ``t = (10 * decay - 1) / (1 - decay)`` on (989 steps for 0.99, 9,989 for 0.999). Without warm-up it is ``decay``.
    """
    return min(decay, (1.0 + t) / (10.0 + t)) if warmup else decay


class EMA:
    """Exponential moving average of a model's trainable parameters, kept in float32.

    Starts as the weights when it is built; each :meth:`update` (call it after every optimizer step) does::

        ema = decay_t * ema + (1 - decay_t) * w        decay_t = min(decay, (1 + t) / (10 + t))

    with ``t`` the number of earlier updates (0 at the first) and ``decay_t = decay`` when ``warmup=False``. The
    update is one fused ``torch._foreach_lerp_`` over all tensors. Only parameters with ``requires_grad`` when the EMA
    is built are averaged: each tensor once, so tied weights (one tensor under two names) are averaged once under
    their first name; buffers (e.g. BatchNorm statistics) are left alone. The average is float32 whatever the
    parameters' dtype, on the parameters' device: memory is one float32 copy of the trainable parameters.

    Evaluate with the average through :meth:`swapped_in` (or :meth:`swap_in` / :meth:`swap_out`): the raw weights are
    copied aside and copied back afterwards, bitwise. Save / restore with :meth:`state_dict` / :meth:`load_state_dict`
    or the file helpers :meth:`save` / :meth:`load` (safetensors).

    Paper: Polyak & Juditsky 1992 (averaging); the warm-up is TensorFlow's ``ExponentialMovingAverage``.

    Args:
        model (`nn.Module`): the model, wrapped (DDP, DataParallel, ``torch.compile``) or not.
        decay (`float`, defaults to 0.999): the decay in (0, 1); the average spans about ``1 / (1 - decay)`` steps.
        warmup (`bool`, defaults to ``True``): use ``min(decay, (1 + t) / (10 + t))`` instead of ``decay``.

    Example::

        ema = EMA(model, decay=0.999)
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update()
        with ema.swapped_in():
            evaluate(model)  # with the averaged weights; the raw ones are back afterwards
    """

    def __init__(self, model: nn.Module, decay: float = 0.999, *, warmup: bool = True):
        validate_ema_decay(decay)
        self.decay = float(decay)
        self.warmup = bool(warmup)
        # named_parameters() yields each tensor once: a tied weight appears under its first name only.
        named = [(n, p) for n, p in unwrap_model(model).named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to average")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [
                torch.empty_like(p, dtype=torch.float32, memory_format=torch.contiguous_format).copy_(p)
                for p in self.params
            ]
        self._float32 = all(p.dtype == torch.float32 for p in self.params)
        self.num_updates = 0
        self._backup: list[torch.Tensor] | None = None

    def decay_now(self) -> float:
        """The decay the next :meth:`update` uses."""
        return ema_decay_at(self.decay, self.num_updates, self.warmup)

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the current weights: ``ema = decay_t * ema + (1 - decay_t) * w``."""
        if self._backup is not None:
            raise RuntimeError("EMA.update() while the average is swapped in; call swap_out() first")
        weight = 1.0 - self.decay_now()
        # lerp_(ema, w, 1 - d) = ema + (1 - d) * (w - ema): one fused kernel over all tensors.
        if self._float32:
            torch._foreach_lerp_(self.shadow, self.params, weight)
        else:
            torch._foreach_lerp_(self.shadow, [p.float() for p in self.params], weight)
        self.num_updates += 1

    # ---- Swapping ----

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the average into the model's parameters, keeping a copy of the raw weights for :meth:`swap_out`."""
        if self._backup is not None:
            raise RuntimeError("the EMA weights are already swapped in")
        self._backup = [p.detach().clone() for p in self.params]
        torch._foreach_copy_(self.params, self.shadow)

    @torch.no_grad()
    def swap_out(self) -> None:
        """Restore the raw weights :meth:`swap_in` set aside (bitwise: a copy, no arithmetic)."""
        if self._backup is None:
            raise RuntimeError("the EMA weights are not swapped in")
        torch._foreach_copy_(self.params, self._backup)
        self._backup = None

    @contextmanager
    def swapped_in(self) -> Iterator[EMA]:
        """Context manager: the average in the model inside, the raw weights back (bitwise) on exit."""
        self.swap_in()
        try:
            yield self
        finally:
            self.swap_out()

    @torch.no_grad()
    def copy_to(self, model: nn.Module | None = None) -> None:
        """Overwrite the parameters with the average for good (no way back; see :meth:`swapped_in`)."""
        params = self.params if model is None else _match_params(self, model)
        torch._foreach_copy_(params, self.shadow)

    # ---- State ----

    def state_dict(self) -> dict:
        """``{"shadow": {name: float32 tensor}, "num_updates": int, "decay": float, "warmup": bool}``."""
        return {
            "shadow": dict(zip(self.names, self.shadow)),
            "num_updates": self.num_updates,
            "decay": self.decay,
            "warmup": self.warmup,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, where: str = "the EMA state") -> None:
        """Load a :meth:`state_dict`: names and shapes must match this EMA's exactly (an error names any that differ).

        The update count comes from ``state``; ``decay`` / ``warmup`` stay this EMA's (a warning says if they differ).
        """
        shadow = state["shadow"]
        missing = [n for n in self.names if n not in shadow]
        unexpected = [n for n in shadow if n not in set(self.names)]
        mismatched = [
            f"{n}: saved {tuple(shadow[n].shape)} vs model {tuple(s.shape)}"
            for n, s in zip(self.names, self.shadow)
            if n in shadow and shadow[n].shape != s.shape
        ]
        if missing or unexpected or mismatched:
            lines = [f"{where} does not match the model's trainable parameters:"]
            for title, items in [("missing", missing), ("unexpected", unexpected), ("shape mismatches", mismatched)]:
                if items:
                    lines.append(f"  {title} ({len(items)}): {', '.join(items[:10])}")
            raise CheckpointMismatchError("\n".join(lines))
        torch._foreach_copy_(self.shadow, [shadow[n] for n in self.names])
        self.num_updates = int(state["num_updates"])
        saved = (float(state.get("decay", self.decay)), bool(state.get("warmup", self.warmup)))
        if saved != (self.decay, self.warmup):
            logger.warning(
                f"{where} was built with decay={saved[0]}, warmup={saved[1]}; continuing with decay={self.decay}, "
                f"warmup={self.warmup}"
            )

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to a safetensors file (the update count, decay and warm-up in its metadata)."""
        from safetensors.torch import save_file

        metadata = {"format": "pt", "num_updates": str(self.num_updates), "decay": repr(self.decay)}
        metadata["warmup"] = str(self.warmup).lower()
        save_file(dict(zip(self.names, self.shadow)), os.fspath(path), metadata=metadata)

    def load(self, path: str | os.PathLike) -> None:
        """Read a file :meth:`save` wrote (strict names and shapes, see :meth:`load_state_dict`)."""
        from safetensors import safe_open

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist: no EMA state to restore")
        device = self.shadow[0].device
        with safe_open(path, framework="pt", device=str(device)) as f:
            metadata = f.metadata() or {}
            shadow = {name: f.get_tensor(name) for name in f.keys()}
        if "num_updates" not in metadata:
            raise ValueError(f"{path} has no 'num_updates' in its metadata: it was not written by EMA.save()")
        state = {
            "shadow": shadow,
            "num_updates": int(metadata["num_updates"]),
            "decay": float(metadata.get("decay", self.decay)),
            "warmup": metadata.get("warmup", str(self.warmup).lower()) == "true",
        }
        self.load_state_dict(state, where=path)


def _match_params(ema: EMA, model: nn.Module) -> list[torch.Tensor]:
    params = dict(unwrap_model(model).named_parameters())
    absent = [n for n in ema.names if n not in params]
    if absent:
        raise CheckpointMismatchError(f"the model has no parameters named {', '.join(absent[:10])}")
    return [params[n] for n in ema.names]


def ema_unsupported_reason(trainer) -> str | None:
    """Why EMA cannot run under this Trainer's distribution setup, or ``None``.

    FSDP and DeepSpeed ZeRO-3 shard the parameters: each process holds a slice (or a flat shard) of the weights, not
    the model, so an average of ``model.parameters()`` would average placeholders. Both are refused. DDP, DataParallel
    and DeepSpeed ZeRO-1/2 keep whole, identical parameters on every process: each process updates its own average
    from the same weights, with no communication.
    """
    if getattr(trainer, "is_fsdp_enabled", False):
        return (
            "ema_decay > 0 is not supported with FSDP (fsdp / fsdp_config, or an accelerate config with "
            "distributed_type: FSDP): FSDP shards the parameters and the EMA needs whole ones. Train with DDP or "
            "DeepSpeed ZeRO-1/2, or set ema_decay=0"
        )
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None and getattr(plugin, "zero_stage", None) == 3:
            return (
                "ema_decay > 0 is not supported with DeepSpeed ZeRO stage 3 (zero_optimization.stage = 3): it shards "
                "the parameters and the EMA needs whole ones. Use ZeRO stage 1 or 2, or set ema_decay=0"
            )
    return None


class EMACallback(TrainerCallback):
    """Keeps an :class:`EMA` of a Trainer's model: built at ``on_train_begin``, updated at ``on_optimizer_step``.

    ``on_optimizer_step`` fires right after ``optimizer.step()`` and before ``zero_grad``, once per optimizer step
    (not per micro-batch under gradient accumulation), on every process. Set :attr:`resume_from` to a checkpoint
    folder to restore the average saved there (``EMA_STATE_NAME``) instead of starting from the weights;
    TricksTrainer does both, and saves the EMA into every checkpoint.

    Args:
        decay (`float`): the EMA decay in (0, 1).
        warmup (`bool`, defaults to ``True``): the ``min(decay, (1 + t) / (10 + t))`` warm-up.
    """

    def __init__(self, decay: float, warmup: bool = True):
        self.decay = decay
        self.warmup = warmup
        self.ema: EMA | None = None
        self.resume_from: str | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # The model holds the weights training starts from (a resumed run: the checkpoint's).
        self.ema = EMA(model, self.decay, warmup=self.warmup)
        if self.resume_from is not None:
            self.ema.load(os.path.join(self.resume_from, EMA_STATE_NAME))
            self.resume_from = None

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.ema.update()


# ---- Checkpoint averaging -------------------------------------------------------------------------------------------


def average_into(model: nn.Module, sources: Sequence) -> nn.Module:
    """Load the uniform average of several checkpoints of ``model`` into it.

    Each source (a checkpoint folder, a state-dict file or a state dict) is loaded strictly through
    :func:`~nlp_tricks.checkpoint.load_state_dict_portable`: wrapper prefixes (``module.``, ``_orig_mod.``) are
    removed, tied weights need one name, and any missing / unexpected key or shape mismatch raises
    :class:`~nlp_tricks.checkpoint.CheckpointMismatchError` naming it. Floating-point tensors (parameters and
    persistent buffers) are summed in float32 (float64 stays float64) and divided by the count; integer tensors
    (e.g. ``position_ids``) keep the first source's values. Each tied tensor is averaged once.

    Args:
        model (`nn.Module`): the model, wrapped or not; its weights are overwritten.
        sources: the checkpoints, at least one.

    Returns:
        ``model``, holding the average, on the device it was on.
    """
    sources = list(sources)
    if not sources:
        raise ValueError("average_into needs at least one checkpoint")
    target = unwrap_model(model)
    device = next(iter(target.parameters()), torch.empty(0)).device
    # One entry per tensor: tied names share one tensor and are averaged once.
    state = target.state_dict(keep_vars=True)
    seen, names = set(), []
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    floating = [n for n in names if state[n].is_floating_point()]
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, source in enumerate(sources):
            load_state_dict_portable(target, source, map_location=device)
            current = target.state_dict()
            if i == 0:
                totals = {n: current[n].clone() for n in names}
                for n in floating:
                    totals[n] = totals[n].to(torch.promote_types(totals[n].dtype, torch.float32))
            else:
                torch._foreach_add_([totals[n] for n in floating], [current[n] for n in floating])
        if floating:
            torch._foreach_div_([totals[n] for n in floating], float(len(sources)))
        dtypes = {n: state[n].dtype for n in names}
        mean = {n: totals[n].to(dtypes[n]) for n in names}
    load_state_dict_portable(target, mean, map_location=device)
    return model


def average_checkpoints(
    paths: Sequence[str | os.PathLike], output_dir: str | os.PathLike, *, config: str | os.PathLike | None = None
) -> str:
    """Average several checkpoints of one model uniformly and save the result with ``save_pretrained``.

    The model is built from ``config`` (a folder holding ``config.json``), by default from the first of ``paths``
    that is such a folder, with the class its ``architectures`` names; each checkpoint is loaded into it strictly
    (see :func:`average_into`: prefixes removed, tied weights once, mismatches named). The average is written to
    ``output_dir`` as safetensors, with the config folder's tokenizer / generation files and an ``averaging.json``
    naming the checkpoints.

    Args:
        paths: checkpoint folders (``checkpoint-N``, ``save_pretrained`` output) or state-dict files
            (``.safetensors`` / ``.bin`` / ``.pt``, e.g. a DataParallel or ``torch.compile`` model's
            ``state_dict()``).
        output_dir: where the averaged model is written (created if needed; must not be one of ``paths``).
        config: a folder with the model's ``config.json``; needed when no path is such a folder.

    Returns:
        ``output_dir``.
    """
    import transformers
    from transformers import AutoConfig

    paths = [os.fspath(p) for p in paths]
    output_dir = os.fspath(output_dir)
    if not paths:
        raise ValueError("give at least one checkpoint to average")
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        if os.path.isdir(path) and os.path.exists(output_dir) and os.path.samefile(path, output_dir):
            raise ValueError(f"output {output_dir} is one of the checkpoints; write the average to a new folder")
    if config is None:
        config = next((p for p in paths if os.path.isfile(os.path.join(p, "config.json"))), None)
        if config is None:
            raise ValueError(
                "none of the checkpoints is a folder with a config.json to build the model from; "
                "pass config=FOLDER (nlp-tricks average --config FOLDER)"
            )
    config = os.fspath(config)
    if not os.path.isfile(os.path.join(config, "config.json")):
        raise FileNotFoundError(f"config={config!r}: no config.json there")
    check_same_model([config, *paths])
    model_config = AutoConfig.from_pretrained(config)
    architectures = getattr(model_config, "architectures", None) or []
    model_cls = getattr(transformers, architectures[0].removesuffix(_CRF_SUFFIX), None) if architectures else None
    if model_cls is None:
        raise ValueError(
            f"{os.path.join(config, 'config.json')}: 'architectures' is {architectures or 'missing'}; it must name a "
            "transformers model class (e.g. ['BertForTokenClassification'])"
        )
    if getattr(model_config, "crf", False):
        from .crf import crf_model_class

        model_cls = crf_model_class(model_cls)  # the checkpoints hold crf.* beside the model's weights
    model = model_cls(model_config)
    dtype = getattr(model_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        model.to(dtype)
    average_into(model, paths)
    model.save_pretrained(output_dir, safe_serialization=True)
    for name in DESCRIPTION_FILES:  # copied beside the averaged model
        source = os.path.join(config, name)
        if os.path.isfile(source) and not os.path.exists(os.path.join(output_dir, name)):
            shutil.copy2(source, os.path.join(output_dir, name))
    write_averaging_info(output_dir, {"weights": "average", "checkpoints": paths})
    return output_dir


# What makes two checkpoints of the same shapes different models: averaging them would mix two label sets or tasks.
_SAME_MODEL_FIELDS = ("architectures", "model_type", "problem_type", "id2label", "crf")
# The name nlp_tricks.crf.crf_model_class gives a model class that carries a CRF.
_CRF_SUFFIX = "WithCRF"


def check_same_model(folders: Sequence[str | os.PathLike]) -> None:
    """Raise ``ValueError`` naming two folders and the field when their ``config.json`` files describe different
    models: another architecture, problem type (single- / multi-label), label set or label order, or a CRF in one
    only. Weights of the same shapes would average without error and keep the first one's labels. Folders without a
    ``config.json`` (state-dict files) are not compared."""
    seen: list[tuple[str, dict]] = []
    for folder in dict.fromkeys(os.fspath(f) for f in folders):
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: cannot read it ({err})") from None
        fields = {name: values.get(name) for name in _SAME_MODEL_FIELDS}
        fields["crf"] = bool(fields["crf"])
        if isinstance(fields["architectures"], list):  # a CRF model saved after load_crf_model names its subclass
            fields["architectures"] = [str(name).removesuffix(_CRF_SUFFIX) for name in fields["architectures"]]
        if seen:
            first, first_fields = seen[0]
            for name in _SAME_MODEL_FIELDS:
                if fields[name] != first_fields[name]:
                    raise ValueError(
                        f"{first} and {folder} are different models: their config.json differ in {name!r} "
                        f"({first_fields[name]!r} vs {fields[name]!r}); average checkpoints of one model"
                    )
        seen.append((folder, fields))


def write_averaging_info(output_dir: str | os.PathLike, info: dict) -> None:
    """Write ``averaging.json`` beside a saved model: what kind of average its weights are."""
    with open(os.path.join(output_dir, AVERAGING_INFO_NAME), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")


def last_complete_checkpoints(output_dir: str | os.PathLike, k: int, *, max_step: int | None = None) -> list[str]:
    """The ``k`` newest complete ``checkpoint-N`` folders of ``output_dir`` (oldest first), ``N <= max_step``.

    Complete is :func:`~nlp_tricks.resume.checkpoint_problem`'s test; incomplete folders are skipped with a
    warning naming what is wrong.
    """
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        return []
    steps = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(output_dir)
        if (m := CHECKPOINT_RE.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    found: list[str] = []
    for step, name in reversed(steps):
        if len(found) == k:
            break
        if max_step is not None and step > max_step:
            continue
        path = os.path.join(output_dir, name)
        problem = checkpoint_problem(path)
        if problem is None:
            found.append(path)
        else:
            logger.warning(f"Skipping incomplete checkpoint {path}: {problem}")
    return found[::-1]
