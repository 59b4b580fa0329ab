"""A training step made of several forward / backward passes over one micro-batch: ``trainer.multi_pass(...)``.

Upstream's ``training_step`` runs one forward and one backward. An attack (FGM, PGD, AWP, FreeLB), SAM and a user's
trick run more; each would otherwise copy upstream's preamble (context-parallel inputs, train mode, the batch moved
to the device, the loss scaled for gradient accumulation) and get the micro-batch boundary (``no_sync``) and the draws
the passes must share right. :class:`MultiPassStep` carries all of it::

    class TwoPasses(Trick):
        extra_backwards = True

        def training_step(self, trainer, model, inputs, num_items_in_batch=None):
            with trainer.multi_pass(model, inputs, num_items_in_batch, extra_pass="mine") as step:
                clean = step.loss()                # pass 0: trainer.loss_context.pass_kind == "clean"
                with step.no_sync():               # no all-reduce: a later backward of this step does it
                    step.backward(clean)
                extra = step.loss()                # pass 1: pass_kind == "mine", the same NEFTune noise
                step.backward(extra)
            return clean.detach()                  # the logged loss

What the passes of one step share: the prepared inputs, NEFTune's noise (drawn in the first pass, replayed in the
others: :class:`~nlp_tricks.functional.neftune.NEFTuneNoise`), ``trainer.loss_context.shared`` (a trick's own
draws, e.g. scheduled sampling's mixing) and, with ``share_dropout=True``, the random state (the same dropout
masks in every pass).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from accelerate.utils.memory import clear_device_cache
from torch import nn

from ..functional.models import unwrap_model
from ..functional.neftune import NEFTuneNoise
from . import upstream

__all__ = ["MultiPassStep"]


class MultiPassStep:
    """One micro-batch's training step of several passes (see the module docstring).

    Args:
        trainer: the :class:`~nlp_tricks.TricksTrainer`.
        model, inputs, num_items_in_batch: as ``training_step`` got them.
        extra_pass (`str`): the ``pass_kind`` of the passes after the first (``"adversarial"``, ``"sam"``, ...).
        share_dropout (`bool`): every pass starts from the first pass's random state (same dropout masks).

    Enter it for the passes (again later to replay this micro-batch, as SAM's second pass does at the end of the
    step: the inputs and NEFTune's draw are kept). ``loss()`` runs one pass's forward and returns its loss scaled as
    upstream's step scales it; ``backward(loss)`` backpropagates through Accelerate (fp16 scaling included);
    ``no_sync()`` is a context in which a backward does not all-reduce; ``sync_gradients`` says whether this
    micro-batch ends the optimizer step.
    """

    def __init__(
        self,
        trainer,
        model: nn.Module,
        inputs: dict,
        num_items_in_batch=None,
        *,
        extra_pass: str = "extra",
        share_dropout: bool = False,
    ):
        self.trainer, self.model, self.num_items_in_batch = trainer, model, num_items_in_batch
        self.extra_pass, self.share_dropout = extra_pass, share_dropout
        self.context = trainer.step_context()
        self.passes = 0
        self._cp_context, inputs = upstream.prepare_context_parallel_inputs(trainer, model, inputs)
        self.inputs = upstream.prepare_inputs(trainer, inputs)
        # As upstream: divide by the accumulation steps only if the loss was not normalised by the item count.
        self._scaled_for_ga = upstream.loss_is_scaled_for_ga(trainer, num_items_in_batch)
        self._noise = self._neftune()
        self._rng = None
        self._stack: contextlib.ExitStack | None = None

    def _neftune(self) -> NEFTuneNoise | None:
        alpha = self.trainer.shared_neftune_alpha
        if alpha is None:
            return None
        embeddings = unwrap_model(self.model, peft=True).get_input_embeddings()
        return NEFTuneNoise(embeddings, alpha)

    def __enter__(self) -> MultiPassStep:
        stack = contextlib.ExitStack()
        stack.enter_context(self._cp_context())
        self.model.train()
        optimizer = self.trainer.optimizer
        if hasattr(optimizer, "train") and callable(optimizer.train):
            optimizer.train()
        if self._noise is not None:
            self._noise.attach()
            stack.callback(self._noise.detach)
        stack.enter_context(self.trainer.using_step_context(self.context))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._stack = None
        args, state = self.trainer.args, self.trainer.state
        if args.torch_empty_cache_steps is not None and state.global_step % args.torch_empty_cache_steps == 0:
            clear_device_cache()

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch is the optimizer step's last (its final backward all-reduces under DDP)."""
        return self.trainer.accelerator.sync_gradients

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context in which a backward does not all-reduce gradients (DDP), so that the step all-reduces once."""
        accelerator = self.trainer.accelerator
        if not accelerator.use_distributed:
            return contextlib.nullcontext()
        return accelerator.no_sync(model=self.model)

    @property
    def no_sync_factory(self):
        """:meth:`no_sync` as the zero-argument factory the attack classes' ``step(..., no_sync=)`` takes (``None``
        when not distributed)."""
        return functools.partial(self.no_sync) if self.trainer.accelerator.use_distributed else None

    def loss(self) -> torch.Tensor:
        """One forward pass's loss (pass 0 is the clean pass; later ones have ``pass_kind == extra_pass``)."""
        if self._stack is None:
            raise RuntimeError("MultiPassStep.loss() runs inside `with trainer.multi_pass(...) as step:`")
        trainer, context = self.trainer, self.context
        context.pass_index = self.passes
        context.pass_kind = "clean" if self.passes == 0 else self.extra_pass
        if self.share_dropout:
            if self._rng is None:
                self._rng = _rng_state()
            else:
                _set_rng_state(self._rng)
        if self._noise is not None:
            self._noise.new_pass()
        self.passes += 1
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(self.model, self.inputs, num_items_in_batch=self.num_items_in_batch)
        if trainer.args.n_gpu > 1:
            loss = loss.mean()
        if not self._scaled_for_ga:
            loss = loss / upstream.accumulation_steps(trainer)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` through Accelerate (the fp16 scaler, DeepSpeed's engine where allowed)."""
        self.trainer.accelerator.backward(loss)


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
