"""``sam_rho`` / ``sam_adaptive``: SAM and ASAM as the training step (each micro-batch forward / backward at ``w``,
then again at ``w + e(w)``), on ``trainer.multi_pass``. The math is :class:`nlp_tricks.functional.sam.SAM`."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..functional.models import unwrap_model
from ..functional.sam import SAM, validate_sam
from .base import BuiltInTrick

__all__ = ["SAMTrick", "SharpnessAwareMinimization", "SAMArguments"]


@dataclass
class SAMArguments:
    """SAM (sharpness-aware minimisation)."""

    sam_rho: float = field(
        default=0.0,
        metadata={
            "help": "SAM (Foret et al. 2021) neighbourhood radius rho >= 0; 0 disables it. Each optimizer step moves "
            "the weights to w + rho * g / ||g|| (g: the step's whole accumulated gradient, the norm over all trained "
            "parameters), takes the gradient there, moves back and steps with it: two forwards and backwards per "
            "micro-batch. Under DDP g is each process's own (m-sharpness). Logs `loss_sam` and `sam_skipped`. "
            "Typical: 0.05 (SAM), 0.5-2 (ASAM). Not with `adversarial` (each runs the whole step)."
        },
    )
    sam_adaptive: bool = field(
        default=False,
        metadata={
            "help": "ASAM (Kwon et al. 2021) instead of SAM: the neighbourhood scaled elementwise by |w| + 0.01 "
            "(weights; biases unscaled), e(w) = rho * T^2 g / ||T g||. Needs sam_rho > 0."
        },
    )


class SAMTrick(BuiltInTrick):
    """SAM (Foret et al. 2021) or ASAM (Kwon et al. 2021) over the whole optimizer step.

    Each micro-batch runs forward / backward at the weights ``w`` and is kept; at the step's last micro-batch the
    weights move to ``w + e(w)``, computed from the step's whole accumulated gradient (so 4 micro-batches of 2 equal
    one batch of 8), every kept micro-batch runs forward / backward again there, and the weights come back: the
    optimizer steps from ``w`` with the gradient at ``w + e(w)``. Cost: two forwards and backwards per micro-batch;
    the kept micro-batches are their prepared inputs (and NEFTune draws), no activations. Every backward but the
    step's last runs under
    ``no_sync``: one all-reduce per optimizer step, so under DDP the ascent uses each process's own gradient (the
    "m-sharpness" form of the paper, m = the per-process batch). The logged ``loss`` is the loss at ``w``; ``loss_sam``
    the loss at ``w + e(w)``; ``sam_skipped`` counts the steps whose gradient at ``w`` had norm 0, an inf or a NaN (an
    fp16 overflow step, which the scaler skips): those keep the gradient at ``w``.
    """

    arguments = SAMArguments
    name = "SAM"
    order = 1000
    extra_backwards = True
    deepspeed = False
    fsdp = False
    unsupported_reason = "DeepSpeed's engine owns the backward; the ascent takes the norm of gradients FSDP shards"
    logged_state = ("sam_skipped",)

    def __init__(self, args):
        super().__init__(args)
        self.sam: SAM | None = None
        self.skipped = 0  # steps whose gradient at w had norm 0, an inf or a NaN
        self._kept: list = []  # the step's micro-batches so far (their multi-pass steps), for the second pass

    @classmethod
    def enabled(cls, args) -> bool:
        return args.sam_rho > 0

    @staticmethod
    def validate(args) -> None:
        validate_sam(args.sam_rho, args.sam_adaptive, names=("sam_rho", "sam_adaptive", "eta"))

    def summary(self) -> list[str]:
        return [f"sam_rho={self.args.sam_rho}", f"sam_adaptive={self.args.sam_adaptive}"]

    def state_dict(self) -> dict:
        return {"sam_skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("sam_skipped", 0))

    def on_train_begin(self, args, state, control, **kwargs):
        self._kept = []  # a run interrupted inside a step leaves nothing for the next one to replay

    def _sam(self, trainer, model: nn.Module) -> SAM:
        """The perturbation over the unwrapped model's trained parameters (rebuilt if the model was replaced or
        parameters were unfrozen)."""
        unwrapped = unwrap_model(model)
        trained = [id(p) for p in unwrapped.parameters() if p.requires_grad]
        if self.sam is None or [id(p) for _, p in self.sam.params] != trained:
            self.sam = SAM(unwrapped, rho=self.args.sam_rho, adaptive=self.args.sam_adaptive)
        return self.sam

    def training_step(self, trainer, model: nn.Module, inputs: dict, num_items_in_batch=None):
        step = trainer.multi_pass(model, inputs, num_items_in_batch, extra_pass="sam")
        with step, step.no_sync():
            clean = step.loss()
            step.backward(clean)
        self._kept.append(step)
        if step.sync_gradients:  # the step's last micro-batch: SAM's second half over every kept one
            kept, self._kept = self._kept, []
            scaler = trainer.accelerator.scaler
            sam_loss = self._sam(trainer, model).perturbed_passes(
                [_replay(s) for s in kept],
                no_sync=step.no_sync_factory,
                grad_scale=scaler.get_scale() if scaler is not None else None,
            )
            if sam_loss is None:
                self.skipped += 1
            else:  # the micro-batches' shares summed: the step's loss at w + e(w), comparable with the logged `loss`
                trainer.record_metric("loss_sam", sam_loss)
        return clean.detach()


def _replay(step):
    """Pass ``weight`` of a kept micro-batch at the moved weights: its forward and the backward of weight x loss."""

    def run(weight: float):
        with step:
            loss = step.loss()
            step.backward(loss if weight == 1.0 else loss * weight)
        return loss.detach()

    return run


SharpnessAwareMinimization = SAMTrick  # its name before the built-ins were named <Flag>Trick
