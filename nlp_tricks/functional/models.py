"""What the package needs to know about a model as a module: the model inside its wrappers (the one unwrap helper of
nlp_tricks), and the error of a state that does not fit it."""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

__all__ = ["unwrap_model", "CheckpointMismatchError", "model_class_with"]


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


def model_class_with(
    model_class: type, name: str, attach: Callable, cache: dict, module: str, resets: type | None = None
) -> type:
    """A subclass of ``model_class`` (a ``PreTrainedModel``), ``<model_class>With<name>``, whose models run
    ``attach(model, config)`` at the end of their construction: a head or layer built from the config before
    ``from_pretrained`` loads the weights, so they load with the rest. With ``resets`` (a module class) its
    ``_init_weights`` initialises those modules by their own ``reset_parameters()`` instead of the model's rule. Built
    once per class (``cache``); ``module`` is the ``__module__`` it reports."""
    if model_class not in cache:

        def __init__(self, config, *args, **kwargs):
            model_class.__init__(self, config, *args, **kwargs)
            attach(self, config)

        body = {"__init__": __init__, "__module__": module}
        if resets is not None:

            def _init_weights(self, submodule):
                if isinstance(submodule, resets):
                    submodule.reset_parameters()
                else:
                    model_class._init_weights(self, submodule)

            body["_init_weights"] = _init_weights
        cache[model_class] = type(f"{model_class.__name__}With{name}", (model_class,), body)
    return cache[model_class]
