"""``sam_rho`` / ``sam_adaptive``: SAM and ASAM as the training step (each micro-batch forward / backward at ``w``,
then again at ``w + e(w)``). The math is :class:`nlp_tricks.sam.SAM`."""

from __future__ import annotations

import contextlib
import functools

import torch
from accelerate.utils.memory import clear_device_cache
from torch import nn

from ..functional.sam import SAM, validate_sam
from ..runtime import upstream as _upstream
from .base import Trick

__all__ = ["SharpnessAwareMinimization"]


class SharpnessAwareMinimization(Trick):
    """SAM (Foret et al. 2021) or ASAM (Kwon et al. 2021) over the whole optimizer step.

    Each micro-batch runs forward / backward at the weights ``w`` and is kept; at the step's last micro-batch the
    weights move to ``w + e(w)``, computed from the step's whole accumulated gradient (so 4 micro-batches of 2 equal
    one batch of 8), every kept micro-batch runs forward / backward again there, and the weights come back: the
    optimizer steps from ``w`` with the gradient at ``w + e(w)``. Cost: two forwards and backwards per micro-batch;
    the kept micro-batches are the inputs only (no activations). Every backward but the step's last runs under
    ``no_sync``: one all-reduce per optimizer step, so under DDP the ascent uses each process's own gradient (the
    "m-sharpness" form of the paper, m = the per-process batch). The logged ``loss`` is the loss at ``w``; ``loss_sam``
    the loss at ``w + e(w)``; ``sam_skipped`` counts the steps whose gradient at ``w`` had norm 0, an inf or a NaN (an
    fp16 overflow step, which the scaler skips): those keep the gradient at ``w``.
    """

    name = "SAM"

    def __init__(self, args):
        self.args = args
        self.sam: SAM | None = None
        # The step's micro-batches so far, for the second pass: (inputs, num_items_in_batch, scaled_for_ga).
        self._kept: list[tuple[dict, object, bool]] = []

    @classmethod
    def from_args(cls, args) -> SharpnessAwareMinimization | None:
        return cls(args) if args.sam_rho > 0 else None

    @staticmethod
    def validate(args) -> None:
        validate_sam(args.sam_rho, args.sam_adaptive, names=("sam_rho", "sam_adaptive", "eta"))
        if args.sam_rho > 0 and getattr(args.optim, "value", args.optim) in ("lomo", "adalomo"):
            raise ValueError(
                f"sam_rho={args.sam_rho} needs two backward passes per step, but optim={args.optim!r} updates the "
                "weights inside backward; choose another optimizer"
            )

    def summary(self) -> list[str]:
        return [f"sam_rho={self.args.sam_rho}, sam_adaptive={self.args.sam_adaptive}"]

    def setup(self, trainer) -> None:
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise ValueError(
                f"sam_rho={self.args.sam_rho} is not supported with DeepSpeed (its engine owns the backward)"
            )
        if getattr(trainer, "is_fsdp_enabled", False):
            raise ValueError(
                f"sam_rho={self.args.sam_rho} is not supported with FSDP: the ascent takes the norm of gradients FSDP "
                "shards"
            )
        trainer.trick_state.setdefault("sam_skipped", 0)

    def on_train_begin(self, args, state, control, **kwargs):
        self._kept = []  # a run interrupted inside a step leaves nothing for the next one to replay

    def _sam(self, trainer, model: nn.Module) -> SAM:
        """The perturbation over the unwrapped model's trained parameters (rebuilt if the model was replaced or
        parameters were unfrozen)."""
        unwrapped = trainer.accelerator.unwrap_model(model)
        trained = [id(p) for p in unwrapped.parameters() if p.requires_grad]
        if self.sam is None or [id(p) for _, p in self.sam.params] != trained:
            self.sam = SAM(unwrapped, rho=self.args.sam_rho, adaptive=self.args.sam_adaptive)
        return self.sam

    def training_step(self, trainer, model: nn.Module, inputs: dict, num_items_in_batch=None):
        model.train()
        if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
            trainer.optimizer.train()
        inputs = _upstream.prepare_inputs(trainer, inputs)
        # As upstream: divide by the accumulation steps only if the loss was not normalised by the item count.
        scaled_for_ga = _upstream.loss_is_scaled_for_ga(trainer, num_items_in_batch)
        accelerator = trainer.accelerator
        no_sync = functools.partial(accelerator.no_sync, model=model) if accelerator.use_distributed else None
        no_sync = no_sync or contextlib.nullcontext

        def loss_fn(batch) -> torch.Tensor:
            batch_inputs, items, scaled = batch
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, batch_inputs, num_items_in_batch=items)
            if trainer.args.n_gpu > 1:
                loss = loss.mean()
            if not scaled:
                loss = loss / _upstream.accumulation_steps(trainer)
            return loss

        batch = (inputs, num_items_in_batch, scaled_for_ga)
        with no_sync():
            clean = loss_fn(batch)
            accelerator.backward(clean)
        self._kept.append(batch)
        if accelerator.sync_gradients:  # the step's last micro-batch
            kept, self._kept = self._kept, []
            self._second_pass(trainer, model, kept, loss_fn, no_sync)
        if (
            trainer.args.torch_empty_cache_steps is not None
            and trainer.state.global_step % trainer.args.torch_empty_cache_steps == 0
        ):
            clear_device_cache()
        return clean.detach()

    def _second_pass(self, trainer, model, kept, loss_fn, no_sync) -> None:
        accelerator = trainer.accelerator
        sam = self._sam(trainer, model)
        scaler = accelerator.scaler
        if not sam.perturb(scaler.get_scale() if scaler is not None else None):
            trainer.trick_state["sam_skipped"] = trainer.trick_state.get("sam_skipped", 0) + 1
            if accelerator.use_distributed:  # the other processes all-reduce once: so must this one
                accelerator.backward(loss_fn(kept[-1]) * 0.0)
            return
        share = _upstream.accumulation_steps(trainer)
        try:
            for i, batch in enumerate(kept):
                with contextlib.nullcontext() if i == len(kept) - 1 else no_sync():
                    loss = loss_fn(batch)
                    accelerator.backward(loss)
                # Each micro-batch's loss is its share of the step's: times the micro-batch count, comparable with
                # the logged `loss`.
                trainer.record_metric("loss_sam", loss.detach() * share)
        finally:
            sam.restore()
