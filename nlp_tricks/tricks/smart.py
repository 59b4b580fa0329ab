"""``smart_alpha``: SMART's smoothness-inducing regulariser (Jiang et al. 2020) added to the loss of every training
forward. The math is :class:`nlp_tricks.smart.SMART`."""

from __future__ import annotations

import torch

from ..functional.outputs import output_logits
from ..functional.smart import SMART, validate_smart
from .base import LossBatch, Trick, record_loss_term

__all__ = ["SmoothnessRegularization"]


class SmoothnessRegularization(Trick):
    """``loss + smart_alpha * R`` in every training forward whose loss is backpropagated (an attack's passes and
    SAM's second pass included), ``R`` the symmetric KL between the logits at the embedding outputs ``x`` and at
    ``x + delta``, ``delta`` found by ``smart_steps`` ascent steps from a random start (see :mod:`nlp_tricks.smart`).
    ``R`` is per counted item like the loss, so gradient accumulation stays exact. Logs ``loss_smart`` (``R``);
    ``smart_skipped`` counts the forwards whose ascent gradient had an inf or a NaN (no term there)."""

    name = "SMART"
    changes_loss = True
    #: sigma of the random start: the paper's 1e-5 (not a field; a subclass or the instance may change it).
    noise_std: float = 1e-5

    def __init__(self, args):
        self.args = args
        self.smart: SMART | None = None

    @classmethod
    def from_args(cls, args) -> SmoothnessRegularization | None:
        return cls(args) if args.smart_alpha > 0 else None

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
            f"smart_alpha={args.smart_alpha}, smart_epsilon={args.smart_epsilon}, "
            f"smart_step_size={args.smart_step_size}, smart_steps={args.smart_steps}"
        ]

    def setup(self, trainer) -> None:
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise ValueError(
                f"smart_alpha={self.args.smart_alpha} is not supported with DeepSpeed (its extra forwards run the "
                "model outside the engine)"
            )
        if getattr(trainer, "is_fsdp_enabled", False):
            raise ValueError(
                f"smart_alpha={self.args.smart_alpha} is not supported with FSDP (its extra forwards run the "
                "unwrapped model, whose parameters FSDP shards)"
            )
        trainer.trick_state.setdefault("smart_skipped", 0)

    def _smart(self, trainer) -> SMART:
        """The regulariser of the unwrapped model (built once; rebuilt if the model was replaced)."""
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
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
            trainer.trick_state["smart_skipped"] = trainer.trick_state.get("smart_skipped", 0) + 1
            return loss
        record_loss_term(trainer, "loss_smart", term, batch.num_items)
        return loss + self.args.smart_alpha * term
