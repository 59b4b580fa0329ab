"""``lookahead_k`` / ``lookahead_alpha``: Lookahead (Zhang et al. 2019, https://arxiv.org/abs/1907.08610) around the
optimizer ``--optim`` names. Its math is :class:`nlp_tricks.functional.lookahead.SlowWeights`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..functional.lookahead import SlowWeights, validate_lookahead
from ..functional.models import unwrap_model
from .base import BuiltInTrick

__all__ = ["LookaheadTrick", "LookaheadArguments"]


@dataclass
class LookaheadArguments:
    """Lookahead: slow weights that follow the trained ones every k optimizer steps."""

    lookahead_k: int = field(
        default=0,
        metadata={
            "help": "Lookahead (Zhang et al. 2019): every k optimizer steps the slow weights move lookahead_alpha of "
            "the way to the trained (fast) weights, slow += alpha * (fast - slow), and training goes on from them "
            "(fast = slow). 0 turns it off; the paper: 5 or 10. The slow weights are float32, start as the weights "
            "before the first step and are saved in every checkpoint; the EMA (ema_decay) averages the weights after "
            "the sync."
        },
    )
    lookahead_alpha: float = field(
        default=0.5,
        metadata={
            "help": "With lookahead_k: the slow weights' step towards the fast ones, in (0, 1] (the paper: 0.5; 1 "
            "leaves training as it is)."
        },
    )


class LookaheadTrick(BuiltInTrick):
    """Slow weights over every parameter the optimizer holds, made when training begins (a resumed run: filled from
    the state store right after) and synced after every ``lookahead_k``-th optimizer step. Ordered before the EMA
    (1100), so the EMA's update of a sync step averages the synced weights: the weights training goes on from."""

    arguments = LookaheadArguments
    order = 1050
    deepspeed = False
    fsdp = False
    unsupported_reason = (
        "Lookahead rewrites the model's weights after the optimizer step; FSDP shards them and DeepSpeed steps its "
        "own copy of them (the master weights), so the sync would be lost; train with DDP, or set lookahead_k=0"
    )

    def __init__(self, args):
        super().__init__(args)
        self.slow: SlowWeights | None = None

    @classmethod
    def enabled(cls, args) -> bool:
        return args.lookahead_k > 0

    @staticmethod
    def validate(args) -> None:
        validate_lookahead(args.lookahead_k, args.lookahead_alpha, "lookahead_k", "lookahead_alpha", allow_off=True)

    def summary(self) -> list[str]:
        return [f"lookahead_k={self.args.lookahead_k}", f"lookahead_alpha={self.args.lookahead_alpha}"]

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # The weights the optimizer updates, each tensor once, by its name (a tied weight under its first name).
        names = {id(p): name for name, p in unwrap_model(model).named_parameters()}
        params = [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"] if id(p) in names]
        self.slow = SlowWeights(params, self.args.lookahead_k, self.args.lookahead_alpha)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.slow.step()

    def state_dict(self) -> dict:
        return {} if self.slow is None else self.slow.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.slow.load_state_dict(state)
