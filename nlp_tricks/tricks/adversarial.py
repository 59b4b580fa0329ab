"""``adversarial``: FGM, PGD, AWP and FreeLB as extra forward / backward passes of the training step (and NEFTune
noise shared by those passes). The attacks' math is in :mod:`nlp_tricks.adversarial`."""

from __future__ import annotations

import contextlib
import functools

import torch
from accelerate.utils import is_compiled_module
from accelerate.utils.memory import clear_device_cache
from torch import nn
from transformers.trainer_utils import unwrap_peft_model

from ..functional.adversarial import ADV_NORMS, AWP, FGM, PGD, FreeLB, validate_attack, validate_awp, validate_freelb
from ..functional.neftune import NEFTuneNoise
from ..runtime import upstream as _upstream
from .base import Trick, nested

__all__ = ["Adversarial", "ADVERSARIAL_METHODS"]

ADVERSARIAL_METHODS = ("none", "fgm", "pgd", "awp", "freelb")


class Adversarial(Trick):
    """Upstream's training step with the attack's passes added.

    The gradient is the sum of the clean and the adversarial gradients (each loss normalised like the clean one, so
    accumulation stays exact), and the returned loss, hence the logged ``loss``, is the CLEAN loss. ``loss_clean`` and
    ``loss_adv`` are logged as well (``loss_adv`` averaged over the attacked micro-batches; FreeLB's is the mean of its
    K passes); ``adv_skipped`` counts the micro-batches whose attack was skipped because the clean gradient was 0, inf
    or NaN (fp16 overflow). Every backward but the step's last runs under ``no_sync``: one all-reduce per optimizer
    step, as in plain training. With ``neftune_noise_alpha`` the passes of a micro-batch share one NEFTune noise draw
    (:class:`~nlp_tricks.neftune.NEFTuneNoise`). Optimizer steps before ``adv_start_step`` are plain, counted as
    ``adv_plain_steps``.
    """

    def __init__(self, args):
        self.args = args
        self.attacker: FGM | PGD | AWP | FreeLB | None = None
        self.neftune_alpha: float | None = None

    @classmethod
    def from_args(cls, args) -> Adversarial | None:
        return cls(args) if args.adversarial != "none" else None

    @staticmethod
    def validate(args) -> None:
        if args.adversarial not in ADVERSARIAL_METHODS:
            raise ValueError(
                f"adversarial={args.adversarial!r} is not allowed; choose one of "
                f"{', '.join(map(repr, ADVERSARIAL_METHODS))}"
            )
        validate_attack(
            args.adv_epsilon,
            args.adv_alpha,
            args.adv_steps,
            args.adv_norm,
            names=("adv_epsilon", "adv_alpha", "adv_steps", "adv_norm"),
            epsilon_may_be_zero=args.adversarial == "freelb",
        )
        if args.adv_target is not None and not args.adv_target.strip():
            raise ValueError("adv_target='' is not allowed; give a module name such as 'word_embeddings' or omit it")
        validate_freelb(args.adv_init_mag, name="adv_init_mag")
        validate_awp(args.awp_gamma, args.awp_target, names=("awp_gamma", "awp_target"))
        if int(args.adv_start_step) != args.adv_start_step or args.adv_start_step < 0:
            raise ValueError(f"adv_start_step={args.adv_start_step} is not allowed; it must be an integer >= 0")
        if args.adversarial != "none" and getattr(args.optim, "value", args.optim) in ("lomo", "adalomo"):
            raise ValueError(
                f"adversarial={args.adversarial!r} needs several backward passes per step, but optim={args.optim!r} "
                "updates the weights inside backward; choose another optimizer"
            )

    def summary(self) -> list[str]:
        return [f"adversarial={self.args.adversarial!r}"]

    def setup(self, trainer) -> None:
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise ValueError(
                f"adversarial={self.args.adversarial!r} is not supported with DeepSpeed (its engine owns the backward)"
            )
        if self.args.adversarial == "awp" and getattr(trainer, "is_fsdp_enabled", False):
            raise ValueError(
                "adversarial='awp' is not supported with FSDP: it takes per-tensor norms of weights FSDP shards"
            )
        reentrant = (trainer.args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
        if self.args.adversarial == "pgd" and trainer.args.gradient_checkpointing and reentrant:
            raise ValueError(
                "adversarial='pgd' takes torch.autograd.grad with respect to the perturbation, which torch's "
                "reentrant checkpointing does not support; with gradient_checkpointing set "
                'gradient_checkpointing_kwargs {"use_reentrant": false} (the default), or use fgm or freelb'
            )
        trainer.trick_state.setdefault("adv_skipped", 0)
        if self.args.adv_start_step > 0:
            trainer.trick_state.setdefault("adv_plain_steps", 0)
        # Upstream's NEFTune hook draws fresh noise at every forward, so the attack's passes would see other noise
        # than the clean pass they perturb. The step adds the noise itself instead: drawn in the clean pass, replayed
        # in the adversarial ones. Without an attack upstream's hook stays.
        if trainer.neftune_noise_alpha is not None:
            self.neftune_alpha, trainer.neftune_noise_alpha = trainer.neftune_noise_alpha, None

    def training_step(self, trainer, model: nn.Module, inputs: dict, num_items_in_batch=None):
        if trainer.state.global_step < self.args.adv_start_step:
            # Plain until adv_start_step; the count of such optimizer steps so far (each micro-batch sets the same).
            trainer.trick_state["adv_plain_steps"] = trainer.state.global_step + 1
            return None

        cp_context, inputs = _upstream.prepare_context_parallel_inputs(trainer, model, inputs)
        with cp_context():
            model.train()
            if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
                trainer.optimizer.train()
            inputs = _upstream.prepare_inputs(trainer, inputs)
            # As upstream: divide by the accumulation steps only if the loss was not normalised by the item count.
            scaled_for_ga = _upstream.loss_is_scaled_for_ga(trainer, num_items_in_batch)

            def loss_fn() -> torch.Tensor:
                with trainer.compute_loss_context_manager():
                    loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                if trainer.args.n_gpu > 1:
                    loss = loss.mean()
                if not scaled_for_ga:
                    loss = loss / _upstream.accumulation_steps(trainer)
                return loss

            accelerator = trainer.accelerator
            no_sync = functools.partial(accelerator.no_sync, model=model) if accelerator.use_distributed else None
            noise = self._neftune(trainer, model)
            attacker = self._attacker(trainer, model)
            # FreeLB's random start covers the positions the attention mask keeps.
            extra = {"attention_mask": inputs.get("attention_mask")} if isinstance(attacker, FreeLB) else {}
            # The other tricks' draws (scheduled sampling's mixing) are shared by the passes: the attack perturbs
            # the clean pass's input, not a new draw.
            with noise or contextlib.nullcontext(), nested(t.micro_batch(trainer) for t in trainer.tricks):
                clean, adv = attacker.step(
                    noise.each_pass(loss_fn) if noise else loss_fn,
                    accelerator.backward,
                    no_sync=no_sync,
                    grad_scaler=accelerator.scaler,
                    **extra,
                )
            if (
                trainer.args.torch_empty_cache_steps is not None
                and trainer.state.global_step % trainer.args.torch_empty_cache_steps == 0
            ):
                clear_device_cache()

        # Each micro-batch's loss is its share of the step's loss; times the micro-batch count, the mean over the
        # step's micro-batches is the step's loss, comparable with the logged `loss`.
        share = _upstream.accumulation_steps(trainer)
        trainer.record_metric("loss_clean", clean * share)
        if adv is None:
            trainer.trick_state["adv_skipped"] = trainer.trick_state.get("adv_skipped", 0) + 1
        else:
            trainer.record_metric("loss_adv", adv * share)
        return clean

    def _neftune(self, trainer, model: nn.Module) -> NEFTuneNoise | None:
        """NEFTune noise shared by the passes of one micro-batch, on the module upstream's hook would use."""
        if self.neftune_alpha is None:
            return None
        embeddings = unwrap_peft_model(trainer.accelerator.unwrap_model(model)).get_input_embeddings()
        return NEFTuneNoise(embeddings, self.neftune_alpha)

    def _attacker(self, trainer, model: nn.Module) -> FGM | PGD | AWP | FreeLB:
        """The attacker of the unwrapped model (built once; rebuilt if the model was replaced)."""
        unwrapped = trainer.accelerator.unwrap_model(model)
        if self.attacker is None or self.attacker.model is not unwrapped:
            if trainer.args.torch_compile or is_compiled_module(model):
                # torch.compile does not guard on module hooks: a graph compiled in this process without the
                # attack's embedding hook (an earlier run, even of another model of the same class) would be reused
                # and never call it. Compiled graphs are rebuilt on their next call.
                torch.compiler.reset()
            args = self.args
            if args.adversarial == "fgm":
                self.attacker = FGM(unwrapped, epsilon=args.adv_epsilon, norm=args.adv_norm, target=args.adv_target)
            elif args.adversarial == "awp":
                self.attacker = AWP(unwrapped, gamma=args.awp_gamma, target=args.awp_target)
            elif args.adversarial == "freelb":
                self.attacker = FreeLB(
                    unwrapped,
                    epsilon=args.adv_epsilon,
                    alpha=args.adv_alpha,
                    steps=args.adv_steps,
                    init_mag=args.adv_init_mag,
                    clean_pass=args.freelb_clean_pass,
                    target=args.adv_target,
                )
            else:
                self.attacker = PGD(
                    unwrapped,
                    epsilon=args.adv_epsilon,
                    alpha=args.adv_alpha,
                    steps=args.adv_steps,
                    norm=args.adv_norm,
                    target=args.adv_target,
                )
        return self.attacker


__all__ += ["ADV_NORMS"]
