"""``smart_alpha``: SMART's smoothness-inducing regulariser (Jiang et al. 2020) added to the loss of every training
forward. The math is :class:`nlp_tricks.smart.SMART`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..functional.models import unwrap_model
from ..functional.outputs import output_logits
from ..functional.smart import SMART, validate_smart
from ..trick import LossBatch
from .base import BuiltInTrick

__all__ = ["SMARTTrick", "SmoothnessRegularization", "SMARTArguments"]


@dataclass
class SMARTArguments:
    """SMART (smoothness-inducing adversarial regularisation)."""

    smart_alpha: float = field(
        default=0.0,
        metadata={
            "help": "SMART (Jiang et al. 2020) weight lambda_s >= 0; 0 disables it. Adds lambda_s * (KL(p || q) + "
            "KL(q || p)) per counted item to the loss of every training forward, p the softmax at the embedding "
            "output x, q at x + delta, delta found from a N(0, 1e-5^2) start by smart_steps ascent steps on that "
            "divergence; logs `loss_smart`. Needs no labels beyond the loss's. Paper: 1, 3 or 5."
        },
    )
    smart_epsilon: float = field(
        default=1e-5,
        metadata={"help": "SMART's perturbation radius epsilon > 0, elementwise (the inf-norm ball). Paper: 1e-5."},
    )
    smart_step_size: float = field(
        default=1e-3,
        metadata={
            "help": "SMART's ascent step size eta > 0, on the gradient divided by its inf-norm per example. "
            "Paper: 1e-3."
        },
    )
    smart_steps: int = field(
        default=1,
        metadata={
            "help": "SMART's ascent steps T_x >= 1 per forward (each one more forward and a backward to the "
            "embeddings). Paper: 1."
        },
    )


class SMARTTrick(BuiltInTrick):
    """``loss + smart_alpha * R`` in every training forward whose loss is backpropagated (an attack's passes and
    SAM's second pass included), ``R`` the symmetric KL between the logits at the embedding outputs ``x`` and at
    ``x + delta``, ``delta`` found by ``smart_steps`` ascent steps from a random start (see :mod:`nlp_tricks.smart`).
    ``R`` is per counted item like the loss, so gradient accumulation stays exact. Logs ``loss_smart`` (``R``);
    ``smart_skipped`` counts the forwards whose ascent gradient had an inf or a NaN (no term there)."""

    arguments = SMARTArguments
    name = "SMART"
    order = 650
    changes_loss = True
    in_evaluation = False
    deepspeed = False
    fsdp = False
    unsupported_reason = "its extra forwards run the unwrapped model outside the engine / on sharded parameters"
    logged_state = ("smart_skipped",)
    #: sigma of the random start: the paper's 1e-5 (not a field; a subclass or the instance may change it).
    noise_std: float = 1e-5

    def __init__(self, args):
        super().__init__(args)
        self.smart: SMART | None = None
        self.skipped = 0  # forwards whose ascent gradient had an inf or a NaN

    @classmethod
    def enabled(cls, args) -> bool:
        return args.smart_alpha > 0

    @staticmethod
    def validate(args) -> None:
        validate_smart(
            args.smart_alpha,
            args.smart_epsilon,
            args.smart_step_size,
            args.smart_steps,
            names=("smart_alpha", "smart_epsilon", "smart_step_size", "smart_steps", "noise_std"),
        )

    def summary(self) -> list[str]:
        args = self.args
        return [
            f"smart_alpha={args.smart_alpha}",
            f"smart_epsilon={args.smart_epsilon}",
            f"smart_step_size={args.smart_step_size}",
            f"smart_steps={args.smart_steps}",
        ]

    def state_dict(self) -> dict:
        return {"smart_skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("smart_skipped", 0))

    def _smart(self, trainer) -> SMART:
        """The regulariser of the unwrapped model (built once; rebuilt if the model was replaced)."""
        unwrapped = unwrap_model(trainer.model)
        if self.smart is None or self.smart.model is not unwrapped:
            if self.smart is not None:
                self.smart.stop_capture()
            args = self.args
            self.smart = SMART(
                unwrapped,
                epsilon=args.smart_epsilon,
                step_size=args.smart_step_size,
                steps=args.smart_steps,
                noise_std=self.noise_std,
                target=args.adv_target,
            )
        return self.smart

    def prepare_loss_batch(self, trainer, batch: LossBatch) -> LossBatch:
        # Registered right before the forward, so that the recording hook runs after every other hook of the
        # embedding module (NEFTune's noise, an attack's perturbation): it records the input this forward sees.
        if trainer.model.training and torch.is_grad_enabled():
            self._smart(trainer).start_capture()
        return batch

    def adjust_logits_loss(self, trainer, logits, batch: LossBatch, loss):
        smart = self.smart
        if smart is None or not smart.capturing:  # no training forward was recorded (evaluation)
            return loss
        model = smart.model

        def forward() -> torch.Tensor:
            return output_logits(model(**batch.inputs))

        temperature = self.args.temperature
        scaler = trainer.accelerator.scaler

        def scaled(x: torch.Tensor) -> torch.Tensor:
            return x if temperature == 1.0 else x / temperature

        term = smart.loss(
            lambda: scaled(forward()),
            scaled(logits),
            batch.loss_labels,
            num_items_in_batch=batch.num_items,
            grad_scale=scaler.get_scale() if scaler is not None else None,
        )
        if term is None:
            self.skipped += 1
            return loss
        trainer.record_loss_term("loss_smart", term, batch.num_items)
        return loss + self.args.smart_alpha * term


SmoothnessRegularization = SMARTTrick  # its name before the built-ins were named <Flag>Trick
