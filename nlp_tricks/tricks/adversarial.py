"""``adversarial``: FGM, PGD, AWP and FreeLB as extra forward / backward passes of the training step, on
``trainer.multi_pass`` (NEFTune's noise shared by the passes). The attacks' math is in
:mod:`nlp_tricks.functional.adversarial`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from accelerate.utils import is_compiled_module
from torch import nn

from ..functional.adversarial import (
    ADV_NORMS,
    AWP,
    FGM,
    PGD,
    FreeLB,
    validate_attack,
    validate_awp,
    validate_freelb,
)
from ..functional.models import unwrap_model
from ..runtime import upstream as _upstream
from .base import BuiltInTrick

__all__ = ["AdversarialTrick", "Adversarial", "AdversarialArguments", "ADVERSARIAL_METHODS", "ADV_NORMS"]

ADVERSARIAL_METHODS = ("none", "fgm", "pgd", "awp", "freelb")


@dataclass
class AdversarialArguments:
    """Adversarial training: FGM, PGD, AWP, FreeLB."""

    adversarial: str = field(
        default="none",
        metadata={
            "help": "Adversarial training: 'none', 'fgm' (Miyato et al. 2017, one step of norm adv_epsilon on the "
            "embeddings; 2 forward/backward passes per batch), 'pgd' (Madry et al. 2018, adv_steps steps of "
            "adv_alpha inside the adv_epsilon ball; adv_steps + 1 passes), 'awp' (Wu et al. 2020, the layers' "
            "weights moved by awp_gamma relative to their norm; 2 passes) or 'freelb' (Zhu et al. 2020, adv_steps "
            "perturbed passes whose gradients are averaged, plus a clean pass (freelb_clean_pass); adv_steps passes "
            "with adv_init_mag=0, else adv_steps + 1). The update uses the sum of the clean and the adversarial "
            "gradients; the logged `loss` is the clean loss, `loss_clean` / `loss_adv` both.",
            "choices": list(ADVERSARIAL_METHODS),
        },
    )
    adv_epsilon: float = field(
        default=1.0,
        metadata={
            "help": "Adversarial perturbation norm (FGM) or ball radius (PGD), > 0; FreeLB: the per-example ball "
            "radius, >= 0 (0: no projection, as FreeLB's adv_max_norm)."
        },
    )
    adv_alpha: float = field(default=0.3, metadata={"help": "PGD / FreeLB step size, > 0 (FreeLB: per example)."})
    adv_steps: int = field(
        default=3, metadata={"help": "PGD number of ascent steps K >= 1; FreeLB: number of perturbed passes K >= 1."}
    )
    adv_norm: str = field(
        default="global",
        metadata={
            "help": "What the adversarial gradient is normalised over: 'global' (the whole batch; equals the classic "
            "recipe that perturbs the word-embedding weight), 'example' (each sequence) or 'token' (each position).",
            "choices": list(ADV_NORMS),
        },
    )
    adv_target: str | None = field(
        default=None,
        metadata={
            "help": "Module whose output is perturbed: its name or a unique name suffix (e.g. 'word_embeddings'). "
            "Default: the module model.get_input_embeddings() returns."
        },
    )
    adv_init_mag: float = field(
        default=0.0,
        metadata={
            "help": "FreeLB random start, >= 0: delta_0 uniform in [-m, m] with m = adv_init_mag / sqrt(length x "
            "hidden) per example under the attention mask (official code: adv_init_mag, e.g. 0.1-0.6). 0 starts "
            "at zero (deterministic; the clean pass and pass 0 are then one pass)."
        },
    )
    freelb_clean_pass: bool = field(
        default=True,
        metadata={
            "help": "FreeLB: add one clean pass's gradient to the mean of the perturbed passes' (FreeLB#10: SST-2 "
            "91.86 without it, 93.46 with it; the official code has none)."
        },
    )
    awp_gamma: float = field(
        default=0.01,
        metadata={
            "help": "AWP perturbation size relative to each weight's norm: w + awp_gamma * ||w|| * g / ||g||, > 0."
        },
    )
    awp_target: str | None = field(
        default=None,
        metadata={
            "help": "AWP: a regular expression matched (re.search) against parameter names, e.g. "
            "'(query|key|value)\\.weight$'. Default: the weights of the Linear modules inside the "
            "numbered transformer layers (not embeddings, norms, biases or the task head)."
        },
    )
    adv_start_step: int = field(
        default=0,
        metadata={
            "help": "Optimizer step (>= 0) from which the adversarial method runs; the steps before it train plainly "
            "and are counted in the logs as `adv_plain_steps` (FreeLB#19: FreeLB from step 0 can diverge)."
        },
    )


class AdversarialTrick(BuiltInTrick):
    """Upstream's training step with the attack's passes added.

    The gradient is the sum of the clean and the adversarial gradients (each loss normalised like the clean one;
    the perturbation of ``adv_norm="global"`` depends on the micro-batch, ``example`` / ``token`` do not:
    docs/tricks.md, "Exact under accumulation and DDP"), and the returned loss, hence the logged ``loss``, is the
    CLEAN loss. ``loss_clean`` and ``loss_adv`` are logged as well (``loss_adv`` averaged over the attacked
    micro-batches; FreeLB's is the mean of its K passes); ``adv_skipped`` counts the micro-batches whose attack was
    skipped because the clean gradient was 0, inf or NaN (fp16 overflow). Every backward but the step's last runs
    under ``no_sync``: one all-reduce per optimizer step, as in plain training. With ``neftune_noise_alpha`` the
    passes of a micro-batch share one NEFTune noise draw (:class:`~nlp_tricks.neftune.NEFTuneNoise`). Optimizer
    steps before ``adv_start_step`` are plain, counted as ``adv_plain_steps``.
    """

    arguments = AdversarialArguments
    name = "Adversarial"  # its entry in the state store, as checkpoints have it
    order = 900
    extra_backwards = True
    deepspeed = False
    logged_state = ("adv_skipped", "adv_plain_steps")

    def __init__(self, args):
        super().__init__(args)
        self.attacker: FGM | PGD | AWP | FreeLB | None = None
        self.skipped = 0  # micro-batches whose attack was skipped (clean gradient 0, inf or NaN)
        self.plain_steps = 0  # optimizer steps before adv_start_step

    @property
    def fsdp(self) -> bool:
        return self.args.adversarial != "awp"

    @property
    def unsupported_reason(self) -> str:
        if self.args.adversarial == "awp":
            return "DeepSpeed's engine owns the backward; FSDP shards the weights whose per-tensor norms AWP takes"
        return "its engine owns the backward"

    @classmethod
    def enabled(cls, args) -> bool:
        return args.adversarial != "none"

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

    def summary(self) -> list[str]:
        return [f"adversarial={self.args.adversarial!r}"]

    def setup(self, trainer) -> None:
        reentrant = (trainer.args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
        if self.args.adversarial == "pgd" and trainer.args.gradient_checkpointing and reentrant:
            raise ValueError(
                "adversarial='pgd' takes torch.autograd.grad with respect to the perturbation, which torch's "
                "reentrant checkpointing does not support; with gradient_checkpointing set "
                'gradient_checkpointing_kwargs {"use_reentrant": false} (the default), or use fgm or freelb'
            )

    def state_dict(self) -> dict:
        state = {"adv_skipped": self.skipped}
        if self.args.adv_start_step > 0:
            state["adv_plain_steps"] = self.plain_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("adv_skipped", 0))
        self.plain_steps = int(state.get("adv_plain_steps", 0))

    def training_step(self, trainer, model: nn.Module, inputs: dict, num_items_in_batch=None):
        if trainer.state.global_step < self.args.adv_start_step:
            # Plain until adv_start_step; the count of such optimizer steps so far (each micro-batch sets the same).
            self.plain_steps = trainer.state.global_step + 1
            return None
        with trainer.multi_pass(model, inputs, num_items_in_batch, extra_pass="adversarial") as step:
            attacker = self._attacker(trainer, model)
            # FreeLB's random start covers the positions the attention mask keeps.
            extra = {"attention_mask": step.inputs.get("attention_mask")} if isinstance(attacker, FreeLB) else {}
            clean, adv = attacker.step(
                step.loss,
                step.backward,
                no_sync=step.no_sync_factory,
                grad_scaler=trainer.accelerator.scaler,
                **extra,
            )
        # Each micro-batch's loss is its share of the step's loss; times the micro-batch count, the mean over the
        # step's micro-batches is the step's loss, comparable with the logged `loss`.
        share = _upstream.accumulation_steps(trainer)
        trainer.record_metric("loss_clean", clean * share)
        if adv is None:
            self.skipped += 1
        else:
            trainer.record_metric("loss_adv", adv * share)
        return clean

    def _attacker(self, trainer, model: nn.Module) -> FGM | PGD | AWP | FreeLB:
        """The attacker of the unwrapped model (built once; rebuilt if the model was replaced)."""
        unwrapped = unwrap_model(model)
        if self.attacker is None or self.attacker.model is not unwrapped:
            if trainer.args.torch_compile or is_compiled_module(model):
                # torch.compile does not guard on module hooks: a graph compiled in this process without the
                # attack's embedding hook (an earlier run, even of another model of the same class) would be reused
                # and never call it. Compiled graphs are rebuilt on their next call.
                torch.compiler.reset()
            args = self.args
            # What PGD and FreeLB both take (FGM is PGD's one step of size epsilon).
            ascent = {"epsilon": args.adv_epsilon, "alpha": args.adv_alpha, "steps": args.adv_steps}
            if args.adversarial == "fgm":
                self.attacker = FGM(unwrapped, epsilon=args.adv_epsilon, norm=args.adv_norm, target=args.adv_target)
            elif args.adversarial == "awp":
                self.attacker = AWP(unwrapped, gamma=args.awp_gamma, target=args.awp_target)
            elif args.adversarial == "freelb":
                self.attacker = FreeLB(
                    unwrapped,
                    **ascent,
                    init_mag=args.adv_init_mag,
                    clean_pass=args.freelb_clean_pass,
                    target=args.adv_target,
                )
            else:
                self.attacker = PGD(unwrapped, **ascent, norm=args.adv_norm, target=args.adv_target)
        return self.attacker


Adversarial = AdversarialTrick  # its name before the built-ins were named <Flag>Trick
