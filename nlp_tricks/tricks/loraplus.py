"""``loraplus_lr_ratio`` / ``loraplus_lr_embedding``: LoRA+ (Hayou et al. 2024, https://arxiv.org/abs/2402.12354),
LoRA's B matrices at a larger learning rate than its A matrices, as one group rule (``lr_scales``) that multiplies
with ``layer_decay`` and ``head_lr_scale``. Alone, the groups are those of PEFT's ``create_loraplus_optimizer``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .base import BuiltInTrick

__all__ = ["LoraPlusTrick", "LoraPlus", "LoraPlusArguments"]

# PEFT's rule: the B matrices ("lora_B" in the name, their biases too) and every other trainable 1-D parameter (DoRA's
# magnitude vectors, biases) at ratio x lr; the embedding adapters (lora.Embedding's A and B) at their own lr.
EMBEDDING_ADAPTERS = r"lora_embedding_[AB]\."
B_MATRICES = r"lora_B\."
MAGNITUDES = r"lora_magnitude_vector\."


@dataclass
class LoraPlusArguments:
    """LoRA+ (PEFT / LoRA models)."""

    loraplus_lr_ratio: float | None = field(
        default=None,
        metadata={
            "help": "LoRA+ (Hayou et al. 2024): train LoRA's B matrices at this multiple (> 0) of their A matrices' "
            "learning rate (the paper: 16 for most tasks; a somewhat lower learning_rate with it), and, as PEFT's "
            "create_loraplus_optimizer, every other trainable 1-D parameter (DoRA's magnitudes, biases). Multiplies "
            "with layer_decay and head_lr_scale. Needs a LoRA model. Default: off."
        },
    )
    loraplus_lr_embedding: float | None = field(
        default=None,
        metadata={
            "help": "With loraplus_lr_ratio: the learning rate (> 0) of LoRA's embedding adapters (lora_embedding_A "
            "and _B), as PEFT's; default 1e-6, PEFT's. Multiplies with layer_decay's factor of the embeddings."
        },
    )


class LoraPlusTrick(BuiltInTrick):
    """LoRA's B matrices at ``loraplus_lr_ratio`` x lr and its embedding adapters at ``loraplus_lr_embedding``."""

    arguments = LoraPlusArguments
    order = 1500
    default_lr_embedding = 1e-6  # PEFT's

    @classmethod
    def enabled(cls, args) -> bool:
        return args.loraplus_lr_ratio is not None

    @staticmethod
    def validate(args) -> None:
        if args.loraplus_lr_ratio is not None and not args.loraplus_lr_ratio > 0:
            raise ValueError(f"loraplus_lr_ratio={args.loraplus_lr_ratio} is not allowed; it must be > 0")
        if args.loraplus_lr_embedding is not None:
            if args.loraplus_lr_ratio is None:
                raise ValueError("loraplus_lr_embedding applies with loraplus_lr_ratio, which is not set")
            if not args.loraplus_lr_embedding > 0:
                raise ValueError(f"loraplus_lr_embedding={args.loraplus_lr_embedding} is not allowed; it must be > 0")

    def summary(self) -> list[str]:
        settings = [f"loraplus_lr_ratio={self.args.loraplus_lr_ratio}"]
        if self.args.loraplus_lr_embedding is not None:
            settings.append(f"loraplus_lr_embedding={self.args.loraplus_lr_embedding}")
        return settings

    def setup(self, trainer) -> None:
        if trainer.model is not None and not any(re.search(B_MATRICES, name) for name, _ in _trainable(trainer.model)):
            raise ValueError(
                f"loraplus_lr_ratio={self.args.loraplus_lr_ratio} trains LoRA's B matrices faster, but "
                f"{type(trainer.model).__name__} has no trainable lora_B parameter; wrap it with peft's LoraConfig"
            )

    def param_group_options(self, trainer, model) -> dict:
        ratio = self.args.loraplus_lr_ratio
        embedding_lr = self.args.loraplus_lr_embedding or self.default_lr_embedding
        names = {name: p.ndim for name, p in _trainable(model)}
        # One pattern, so that each layer's B-side parameters form one group: the B matrices, DoRA's magnitudes when
        # there are some, and any other trainable 1-D parameter (a head's bias) by its exact name.
        faster = [B_MATRICES] + [MAGNITUDES] * any(re.search(MAGNITUDES, name) for name in names)
        faster += [
            re.escape(name) + "$"
            for name, ndim in names.items()
            if ndim == 1 and not any(re.search(p, name) for p in (*faster, EMBEDDING_ADAPTERS))
        ]
        scales = {"|".join(faster): ratio}
        if any(re.search(EMBEDDING_ADAPTERS, name) for name in names):
            lr = trainer.args.learning_rate
            scales[EMBEDDING_ADAPTERS] = embedding_lr / lr if lr > 0 else 1.0
        return {"lr_scales": scales}


def _trainable(model) -> list:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


LoraPlus = LoraPlusTrick  # its name before the built-ins were named <Flag>Trick
