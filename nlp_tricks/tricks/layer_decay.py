"""``layer_decay`` / ``head_lr_scale``: BERT-style learning rates per layer and a larger one for the task head, as
group rules of :func:`nlp_tricks.runtime.param_groups.build_param_groups` (which reads the layer layouts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import BuiltInTrick

__all__ = ["LayerDecayTrick", "LayerwiseLearningRates", "ParamGroupArguments"]


@dataclass
class ParamGroupArguments:
    """Optimizer parameter groups."""

    head_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "Learning-rate multiplier (> 0) for the task head: the parameters outside model.base_model, or "
            "the untied output projection of a model that is its own base model (T5ForConditionalGeneration). A model "
            "whose only head is tied to its input embeddings (GPT-2, BART / T5 generation) warns that it cannot apply."
        },
    )
    layer_decay: float = field(
        default=1.0,
        metadata={
            "help": "Layer-wise learning-rate decay in (0, 1]: layer i of L trains at lr * layer_decay^(L - i), the "
            "embeddings at lr * layer_decay^(L + 1). 1.0 disables it. Typical: 0.8-0.95."
        },
    )


class LayerDecayTrick(BuiltInTrick):
    """``head_lr_scale`` for the task head and ``layer_decay ** depth`` per layer, multiplied with the other tricks'
    group rules (a CRF's own lr, name patterns)."""

    arguments = ParamGroupArguments
    order = 1400

    @classmethod
    def enabled(cls, args) -> bool:
        return args.head_lr_scale != 1.0 or args.layer_decay != 1.0

    @staticmethod
    def validate(args) -> None:
        if args.head_lr_scale <= 0:
            raise ValueError(f"head_lr_scale={args.head_lr_scale} is not allowed; it must be > 0")
        if not 0.0 < args.layer_decay <= 1.0:
            raise ValueError(f"layer_decay={args.layer_decay} is not allowed; it must be in (0, 1]")

    def summary(self) -> list[str]:
        return [f"head_lr_scale={self.args.head_lr_scale}", f"layer_decay={self.args.layer_decay}"]

    def param_group_options(self, trainer, model) -> dict:
        return {"head_lr_scale": self.args.head_lr_scale, "layer_decay": self.args.layer_decay}


LayerwiseLearningRates = LayerDecayTrick  # its name before the built-ins were named <Flag>Trick
