"""What the package needs to know about a model as a module: the model inside its wrappers (the one unwrap helper of
nlp_tricks), and the error of a state that does not fit it."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["unwrap_model", "CheckpointMismatchError"]


class CheckpointMismatchError(RuntimeError):
    """A checkpoint's keys or shapes do not match the model it is loaded into."""


def unwrap_model(model: nn.Module, *, peft: bool = False) -> nn.Module:
    """The model inside its wrappers, in any nesting: DataParallel / DistributedDataParallel, FSDP, DeepSpeed's
    engine and ``torch.compile``; with ``peft=True`` also a PEFT model's (the transformers model it wraps).

    Only those wrapper classes are opened, so a model with a submodule of its own called ``module`` stays itself.
    """
    wrappers = _parallel_wrappers()
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            break
    if peft:
        from transformers.trainer_utils import unwrap_peft_model

        model = unwrap_peft_model(model)
    return model


def _parallel_wrappers() -> tuple[type, ...]:
    """The wrapper classes whose ``.module`` is the model. FSDP and DeepSpeed are looked up only where they were
    imported (a model cannot be wrapped by a class nobody imported), so this costs no import."""
    wrappers: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and hasattr(fsdp, "FullyShardedDataParallel"):
        wrappers.append(fsdp.FullyShardedDataParallel)
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and hasattr(deepspeed, "DeepSpeedEngine"):
        wrappers.append(deepspeed.DeepSpeedEngine)
    return tuple(wrappers)
