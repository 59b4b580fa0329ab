"""Weight averaging: an exponential moving average of the weights during training, and checkpoint averaging.

- :class:`EMA`: a float32 moving average of a model's trainable parameters, updated after every optimizer step with
  one fused ``torch._foreach_lerp_``; it swaps in for evaluation and back out bitwise, and saves to / loads from a
  safetensors file. :class:`EMACallback` wires it into any ``transformers.Trainer`` (TricksTrainer's ``--ema_decay``
  is the EMA trick, ``nlp_tricks/tricks/ema.py``).
- :func:`average_into` / :func:`average_checkpoints`: the uniform average of several checkpoints of one model
  (stochastic weight averaging over the last saves, "model soups" of one run), loaded strictly through
  :func:`~nlp_tricks.checkpoint.load_state_dict_portable`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence

import torch
from torch import nn
from transformers import TrainerCallback

from ..functional.averaging import EMA, ema_decay_at, validate_ema_decay
from .checkpoint import DESCRIPTION_FILES, load_state_dict_portable, unwrap_model
from .resume import CHECKPOINT_RE, checkpoint_problem

__all__ = [
    "EMA",
    "EMACallback",
    "ema_decay_at",
    "validate_ema_decay",
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


class EMACallback(TrainerCallback):
    """Keeps an :class:`EMA` of a Trainer's model: built at ``on_train_begin``, updated at ``on_optimizer_step``.

    ``on_optimizer_step`` fires right after ``optimizer.step()`` and before ``zero_grad``, once per optimizer step
    (not per micro-batch under gradient accumulation), on every process. To restore a saved average instead of
    starting from the weights, set :attr:`resume_from` to a folder holding ``EMA_STATE_NAME`` (an :meth:`EMA.save`
    file). FSDP and DeepSpeed ZeRO-3 shard the parameters, which the EMA needs whole: use it with DDP, DataParallel
    or ZeRO-1/2 (TricksTrainer's ``ema_decay`` refuses the others when the trainer is built).

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
    model = _model_of(config)
    average_into(model, paths)
    model.save_pretrained(output_dir, safe_serialization=True)
    for name in DESCRIPTION_FILES:  # copied beside the averaged model
        source = os.path.join(config, name)
        if os.path.isfile(source) and not os.path.exists(os.path.join(output_dir, name)):
            shutil.copy2(source, os.path.join(output_dir, name))
    write_averaging_info(output_dir, {"weights": "average", "checkpoints": paths})
    return output_dir


def _model_of(config: str) -> nn.Module:
    """A model built from the ``config.json`` in folder ``config``, with the class its ``architectures`` names (one
    that carries a CRF when the config says so), in the config's dtype."""
    import transformers
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(config)
    architectures = getattr(model_config, "architectures", None) or []
    model_cls = getattr(transformers, architectures[0].removesuffix(_CRF_SUFFIX), None) if architectures else None
    if model_cls is None:
        raise ValueError(
            f"{os.path.join(config, 'config.json')}: 'architectures' is {architectures or 'missing'}; it must name a "
            "transformers model class (e.g. ['BertForTokenClassification'])"
        )
    if getattr(model_config, "crf", False):
        from ..functional.crf import crf_model_class

        model_cls = crf_model_class(model_cls)  # the checkpoints hold crf.* beside the model's weights
    model = model_cls(model_config)
    dtype = getattr(model_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        model.to(dtype)
    return model


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
