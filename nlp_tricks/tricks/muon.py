"""``muon`` / ``muon_lr``: Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) for the hidden
matrices, the ``--optim`` optimizer (AdamW) for the rest, as one optimizer
(:class:`nlp_tricks.functional.muon.MuonWithAdamW`) over the run's parameter groups: a group rule marks the matrices,
so layer-wise decay, the head's lr and LoRA+ set the learning rates of both optimizers' groups alike."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from torch import nn

from ..functional.models import unwrap_model
from ..functional.muon import MUON, MuonWithAdamW, muon_missing
from ..runtime import upstream as _upstream
from ..runtime.param_groups import head_parameter_ids
from .base import BuiltInTrick

__all__ = ["MuonTrick", "MuonArguments", "muon_parameter_names"]

logger = logging.getLogger(__name__)

# PEFT's adapters: LoRA's A / B matrices (Muon's), and the adapters of an embedding (the embedding's side: AdamW).
LORA_MATRICES = r"lora_[AB]\."
EMBEDDING_ADAPTERS = r"lora_embedding_[AB]\."


@dataclass
class MuonArguments:
    """Muon for the hidden matrices."""

    muon: bool = field(
        default=False,
        metadata={
            "help": "Train the hidden layers' 2-D weight matrices (attention, MLP, the pooler; LoRA's A and B) with "
            "torch.optim.Muon (torch >= 2.9), the embeddings, the heads (classifier, LM head) and the 1-D parameters "
            "with the --optim optimizer (AdamW), as one optimizer. Muon's updates are scaled to AdamW's RMS "
            "(match_rms_adamw), so learning_rate and weight_decay carry over. Warns on a full fine-tune: Muon "
            "fine-tuning of Adam-pretrained models degrades them (Qu et al. 2026); Muon on LoRA matches Adam."
        },
    )
    muon_lr: float | None = field(
        default=None,
        metadata={
            "help": "With muon: Muon's learning rate (> 0) for the matrices; default: learning_rate. The group "
            "factors (layer_decay, head_lr_scale, loraplus_lr_ratio) multiply it, and the lr scheduler scales it "
            "as every group's."
        },
    )


def muon_parameter_names(model: nn.Module) -> list[str]:
    """The names (as ``model.named_parameters()`` gives them) of the trainable parameters Muon trains: the 2-D
    weights of the body (attention, MLP, pooler; LoRA's A and B), not the embeddings (``nn.Embedding`` modules and
    LoRA's embedding adapters), the heads (parameters outside ``base_model``; the output projection) or the 1-D
    parameters (biases, norms)."""
    inner = unwrap_model(model, peft=True)
    excluded = set(head_parameter_ids(inner))
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    get_output = getattr(inner, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    for module in [*embeddings, *([output] if isinstance(output, nn.Module) else [])]:
        excluded.update(id(p) for p in module.parameters())
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and p.ndim == 2 and id(p) not in excluded and not re.search(EMBEDDING_ADAPTERS, name)
    ]


class MuonTrick(BuiltInTrick):
    """Muon for :func:`muon_parameter_names`' matrices, the ``--optim`` optimizer for every other parameter."""

    arguments = MuonArguments
    order = 1600
    deepspeed = False
    fsdp = False
    unsupported_reason = (
        "Muon orthogonalises whole weight matrices, and DeepSpeed / FSDP hand the optimizer flat shards of them; "
        "train with DDP, or set muon=False"
    )

    @classmethod
    def enabled(cls, args) -> bool:
        return bool(args.muon)

    @staticmethod
    def validate(args) -> None:
        if args.muon_lr is not None:
            if not args.muon:
                raise ValueError("muon_lr applies with muon=True, which is not set")
            if not args.muon_lr > 0:
                raise ValueError(f"muon_lr={args.muon_lr} is not allowed; it must be > 0")
        problem = muon_missing("muon=True") if args.muon else None
        if problem is not None:
            raise ValueError(problem)

    def summary(self) -> list[str]:
        return ["muon=True"] + ([f"muon_lr={self.args.muon_lr}"] if self.args.muon_lr is not None else [])

    def setup(self, trainer) -> None:
        adamw = self._other_optimizer(trainer)
        names = muon_parameter_names(trainer.model)
        model_name = type(unwrap_model(trainer.model, peft=True)).__name__
        if not names:
            raise ValueError(
                f"muon=True trains 2-D hidden matrices, but {model_name} has no trainable one (embeddings, heads and "
                "1-D parameters stay on AdamW); set muon=False"
            )
        pretrained = [name for name in names if not re.search(LORA_MATRICES, name)]
        if pretrained:
            logger.warning(
                f"muon=True fully fine-tunes {len(pretrained)} matrices of {model_name}: Qu et al. 2026 "
                "(arXiv:2605.10468) found Muon fine-tuning of Adam-pretrained models (most checkpoints; transformers "
                "has no Muon) degrades them, while Muon on LoRA matches or beats Adam; consider --peft lora"
            )
        scale = 1.0 if self.args.muon_lr is None else self.args.muon_lr / trainer.args.learning_rate
        trainer.optimizer_cls_and_kwargs = (MuonWithAdamW, {"adamw": adamw, "muon_lr_scale": scale})

    def _other_optimizer(self, trainer) -> tuple[type, dict]:
        """The class and keyword arguments of ``--optim``, for the parameters that are not Muon's. The optimizer is
        built here: one given to the trainer is refused, and so is an ``--optim`` that builds its own groups."""
        from ..hosts import HostedTricks  # hosts imports the tricks: imported when a trainer is built

        if isinstance(trainer, HostedTricks):
            raise ValueError(
                f"muon=True builds TricksTrainer's optimizer; {type(trainer).__name__} keeps its host's optimizer. "
                "Use TricksTrainer, or set muon=False"
            )
        given = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        own = trainer.optimizer_cls_and_kwargs
        if (given is not None and not isinstance(given, MuonWithAdamW)) or (own and own[0] is not MuonWithAdamW):
            raise ValueError(
                "muon=True builds the optimizer (Muon for the matrices, --optim for the rest), but the trainer was "
                "given one (optimizers= or optimizer_cls_and_kwargs=); use one of them"
            )
        if self.args.muon_lr is not None and not trainer.args.learning_rate > 0:
            raise ValueError(f"muon_lr is relative to learning_rate={trainer.args.learning_rate}, which must be > 0")
        optim = getattr(trainer.args.optim, "value", trainer.args.optim)
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
        if _upstream.is_optimizer_factory(cls) or any(key in kwargs for key in ("params", "model", "optimizer_dict")):
            raise ValueError(
                f"muon=True hands the non-matrix parameter groups to optim={optim!r}, which builds its own groups; "
                "use optim='adamw_torch' (the default)"
            )
        return cls, kwargs

    def param_group_options(self, trainer, model) -> dict:
        return {"param_optimizers": dict.fromkeys(muon_parameter_names(model), MUON)}
