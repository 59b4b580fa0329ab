"""TricksArguments: transformers' TrainingArguments plus one field per trick, validated in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from .functional.adversarial import ADV_NORMS
from .functional.pooling import POOLING_MODES
from .functional.scheduled_sampling import MODES, SCHEDULES
from .runtime.divergence import validate_divergence_arguments
from .tricks import validate_arguments
from .tricks.adversarial import ADVERSARIAL_METHODS
from .tricks.loss import LOSS_TYPES

__all__ = ["TricksArguments", "LOSS_TYPES", "ADVERSARIAL_METHODS", "ADV_NORMS"]


@dataclass
class TricksArguments(TrainingArguments):
    """``TrainingArguments`` plus the knobs of every trick in nlp_tricks.

    Every field has a ``help`` text, so ``--help`` on a recipe documents it. Bad values raise ``ValueError`` naming
    the field and what is allowed.
    """

    # --- Loss ---
    loss_type: str = field(
        default="ce",
        metadata={
            "help": "Training loss on the logits: 'ce' (cross-entropy; label_smoothing_factor > 0 smooths it), "
            "'focal' (Lin et al. 2017, see focal_gamma / focal_alpha) or 'label_smoothing' "
            "(Szegedy et al. 2016, smoothing mass from label_smoothing_factor).",
            "choices": list(LOSS_TYPES),
        },
    )
    focal_gamma: float = field(
        default=2.0, metadata={"help": "Focal loss focusing parameter gamma >= 0 (0 gives cross-entropy)."}
    )
    focal_alpha: list[float] | None = field(
        default=None,
        metadata={
            "help": "Focal loss class weights, a weighted mean like cross_entropy's `weight`: one value a (as in "
            "Lin et al.: a for every class but the background 'O', 1 - a for it; e.g. --focal_alpha 0.25), or one "
            "weight per class in the order of the model's id2label (the recipes: the sorted training labels; a wrong "
            "count is an error that prints the order). Default: none."
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "Divide the logits by this temperature (> 0) before any loss. 1.0 leaves them as they are."},
    )

    # --- Distillation (batches that carry `teacher_logits`) ---
    distill_temperature: float = field(
        default=2.0,
        metadata={
            "help": "Temperature T > 0 of knowledge distillation (Hinton et al. 2015), used when a batch carries "
            "`teacher_logits`: alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE(labels)."
        },
    )
    distill_alpha: float = field(
        default=0.5,
        metadata={"help": "Weight in [0, 1] of the soft (teacher) term of the distillation loss."},
    )

    # --- Optimizer parameter groups ---
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

    # --- Schedule ---
    warmup_ratio: float | None = field(
        default=None,
        metadata={
            "help": "Fraction in [0, 1) of the training steps spent in linear warmup. transformers 5 removed this "
            "argument; it is mapped to the fractional `warmup_steps`."
        },
    )

    # --- Adversarial ---
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

    # --- R-Drop ---
    rdrop_alpha: float = field(
        default=0.0,
        metadata={
            "help": "R-Drop (Liang et al. 2021) weight alpha >= 0; 0 disables it. Each batch runs twice with "
            "independent dropout (as one doubled batch) and the loss per counted item is loss(a) + loss(b) + "
            "alpha / 2 * (KL(p_a || p_b) + KL(p_b || p_a)), with loss_type's loss on both passes; logs `loss_kl`. "
            "Needs a model with dropout."
        },
    )

    # --- SAM (sharpness-aware minimisation) ---
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

    # --- SMART (smoothness-inducing adversarial regularisation) ---
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

    # --- Weight averaging ---
    ema_decay: float = field(
        default=0.0,
        metadata={
            "help": "Exponential moving average of the weights, decay in [0, 1); 0 turns it off. After every "
            "optimizer step: ema = d_t * ema + (1 - d_t) * w over the trainable parameters (float32), "
            "d_t = min(ema_decay, (1 + t) / (10 + t)) with t the steps before it (see ema_warmup). Saved in every "
            "checkpoint. Typical: 0.99-0.9999 (the average spans about 1 / (1 - ema_decay) steps)."
        },
    )
    ema_warmup: bool = field(
        default=True,
        metadata={
            "help": "Warm the EMA decay up as min(ema_decay, (1 + t) / (10 + t)); false uses ema_decay from the "
            "first step (the average then leans on the starting weights for about 1 / (1 - ema_decay) steps)."
        },
    )
    ema_eval: bool | None = field(
        default=None,
        metadata={
            "help": "Evaluate, predict and save the final model (save_model) with the EMA weights; training goes on "
            "with the raw weights, restored bitwise. Default: true when ema_decay > 0."
        },
    )
    swa_last_k: int = field(
        default=0,
        metadata={
            "help": "At the end of training, load the uniform average of the K newest complete checkpoints into the "
            "model (stochastic weight averaging over the last saves); 0 turns it off. Needs save_strategy "
            "'steps' or 'epoch' and save_total_limit >= K (or none)."
        },
    )

    # --- Heads and labels ---
    crf: bool = field(
        default=False,
        metadata={
            "help": "Train a linear-chain CRF over the word-level logits of a *ForTokenClassification model "
            "(positions labelled -100 skipped) and predict with Viterbi. The CRF is saved with the model as `crf.*`; "
            "load it with nlp_tricks.crf.load_crf_model. The loss is the negative log-likelihood summed over "
            "sentences / the number of sentences in the whole accumulated batch."
        },
    )
    crf_lr_scale: float = field(
        default=100.0,
        metadata={"help": "Learning-rate multiplier (> 0) of the CRF's start / end / transition scores."},
    )
    crf_bio_constraints: bool = field(
        default=False,
        metadata={
            "help": "Forbid the transitions the BIO (IOB2) scheme does not allow, read from the label names: I-X only "
            "after B-X or I-X, never first. Needs crf."
        },
    )
    class_weights: list[str] | None = field(
        default=None,
        metadata={
            "help": "Per-class weights of the cross-entropy (loss_type 'ce' or 'label_smoothing'), one per label "
            "(e.g. --class_weights 1 3 3), or 'balanced': n_samples / (n_classes * count) from the training labels. "
            "The loss is a weighted mean like F.cross_entropy(weight=...), over the whole accumulated batch."
        },
    )
    head_dropout_samples: int = field(
        default=1,
        metadata={
            "help": "Multi-sample dropout (Inoue 2019): K >= 1 dropout masks on the features entering the "
            "classification head; the loss is the mean of the K heads' losses. Off at evaluation. 1: off."
        },
    )
    head_dropout: float = field(
        default=0.0,
        metadata={
            "help": "Dropout probability in [0, 1) of each multi-sample dropout mask (with head_dropout_samples)."
        },
    )

    # --- Pooling, re-initialised top layers, frozen bottom layers ---
    pooling: str | None = field(
        default=None,
        metadata={
            "help": "Sequence classification on an encoder: classify from this pooled vector instead of the model's "
            "own pooler / first token. 'cls' (first position), 'mean' / 'max' (over the positions the attention mask "
            "keeps), 'mean_max' (both concatenated; the head's first linear layer doubles its input), "
            "'weighted_layers' (learned softmax weights over every layer's masked mean) or 'attention' (learned "
            "attention over positions). The pooled vector feeds the model's own head; saved with the model "
            "(config.pooling); load it with nlp_tricks.pooling.load_pooled_model. Default: the model's own head.",
            "choices": list(POOLING_MODES),
        },
    )
    reinit_layers: int = field(
        default=0,
        metadata={
            "help": "Re-initialise the top K encoder layers (and the base model's pooler, if it has one) with the "
            "model's own init before training (Zhang et al. 2021), drawn under `seed`; every other weight stays "
            "the pretrained one. 0: off. Typical: 1-3."
        },
    )
    freeze_layers: int = field(
        default=0,
        metadata={
            "help": "Freeze the embeddings and the bottom N layers: no update and no optimizer state (see "
            "unfreeze_at_step). 0: off."
        },
    )
    freeze_embeddings: bool = field(
        default=False,
        metadata={"help": "Freeze the embeddings (with freeze_layers > 0 they are frozen anyway)."},
    )
    unfreeze_at_step: int | None = field(
        default=None,
        metadata={
            "help": "Make the frozen parameters (freeze_layers / freeze_embeddings) trainable from optimizer step S "
            "(>= 1): steps 0..S-1 leave them alone, their optimizer state starts at step S. Under DDP it needs "
            "ddp_find_unused_parameters (on by default without gradient checkpointing). Default: frozen throughout."
        },
    )

    # --- Scheduled sampling ---
    scheduled_sampling: str = field(
        default="none",
        metadata={
            "help": "Scheduled sampling (Bengio et al. 2015, two passes as in Mihaylova & Martins 2019) for "
            "encoder-decoder models (Seq2SeqTricksTrainer) and decoder-only causal LMs (TricksTrainer): the "
            "teacher-forcing ratio's schedule over optimizer steps. 'none' (plain teacher forcing), 'constant' "
            "(ratio ss_k), 'linear' (1 - step / ss_k), 'exponential' (ss_k ** step) or 'inverse_sigmoid' "
            "(ss_k / (ss_k + exp(step / ss_k))).",
            "choices": ["none", *SCHEDULES],
        },
    )
    ss_k: float | None = field(
        default=None,
        metadata={
            "help": "Parameter of the scheduled_sampling schedule: constant: the ratio in [0, 1]; linear: steps to "
            "reach 0 (> 0); exponential: base in (0, 1), e.g. 0.999; inverse_sigmoid: k >= 1, e.g. 1000."
        },
    )
    ss_min_ratio: float = field(
        default=0.0, metadata={"help": "Floor of the teacher-forcing ratio, in [0, 1] (Bengio et al.'s epsilon)."}
    )
    ss_mode: str = field(
        default="argmax",
        metadata={
            "help": "What replaces a gold input token (a decoder input; for a causal LM a completion token, never "
            "the prompt): 'argmax' (the pass-1 prediction), 'sample' (a sample from "
            "softmax(logits / ss_temperature)) or 'soft' (the expected embedding "
            "softmax(logits / ss_temperature) @ E).",
            "choices": list(MODES),
        },
    )
    ss_temperature: float = field(
        default=1.0, metadata={"help": "Softmax temperature (> 0) of ss_mode 'sample' and 'soft'."}
    )

    # --- Run safety: the divergence guard (nlp_tricks/runtime/divergence.py, docs/checkpoints.md) ---
    stop_on_nonfinite: bool = field(
        default=True,
        metadata={
            "help": "Stop training at the first step whose loss or gradient norm is NaN or infinite, before its "
            "optimizer step, and never save non-finite weights: train() raises TrainingDivergedError, one line "
            "naming the step (the recipes exit with status 3, writing no model or all_results.json), and the last "
            "checkpoint stays the good one resume picks. Under fp16 a step the grad scaler skips is not counted. "
            "False: train on as upstream does."
        },
    )
    max_nonfinite_steps: int = field(
        default=0,
        metadata={
            "help": "Skip up to N non-finite steps instead of stopping (>= 0): their gradients are dropped and "
            "their optimizer step is not taken (the learning-rate schedule moves on); the count is logged as "
            "nonfinite_steps_skipped. The next one stops training. 0: stop at the first."
        },
    )

    def __post_init__(self):
        self._map_warmup_ratio()  # before the parent validates `warmup_steps`
        super().__post_init__()
        # Defaults that follow other fields are derived again when those change (revalidate).
        self._derived = {"ema_eval"} if self.ema_eval is None else set()
        self._validate_tricks()

    def revalidate(self) -> None:
        """Map and check the trick fields again after they were set on built arguments (a hyperparameter-search
        trial sets them one by one): ``warmup_ratio`` mapped, derived defaults derived again, every trick's checks."""
        self._map_warmup_ratio(replacing=True)
        for name in self._derived:
            setattr(self, name, None)
        self._validate_tricks()

    def _map_warmup_ratio(self, replacing: bool = False) -> None:
        if self.warmup_ratio is None:
            return
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} is not allowed; it must be in [0, 1)")
        if not replacing and self.warmup_steps not in (0, self.warmup_ratio):
            raise ValueError(
                f"give warmup_ratio ({self.warmup_ratio}) or warmup_steps ({self.warmup_steps}), not both"
            )
        self.warmup_steps = self.warmup_ratio

    def _validate_tricks(self) -> None:
        if self.head_lr_scale <= 0:
            raise ValueError(f"head_lr_scale={self.head_lr_scale} is not allowed; it must be > 0")
        if not 0.0 < self.layer_decay <= 1.0:
            raise ValueError(f"layer_decay={self.layer_decay} is not allowed; it must be in (0, 1]")
        # Each trick's checks are in its module (nlp_tricks/tricks/); checks across two tricks in validate_arguments.
        validate_arguments(self)
        validate_divergence_arguments(self)  # run safety
