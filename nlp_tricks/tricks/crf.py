"""``crf``: a linear-chain CRF over a token classifier's logits, trained by its negative log-likelihood and predicted
with Viterbi. Its math is in :mod:`nlp_tricks.crf`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..functional.crf import CRF, add_crf, compact, expand
from ..functional.models import unwrap_model
from ..functional.outputs import output_logits
from ..trick import LossInForward
from .base import HeadLossTrick

__all__ = ["CRFTrick", "CRFHead", "CRFArguments"]


@dataclass
class CRFArguments:
    """A linear-chain CRF over a token classifier."""

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


class CRFTrick(HeadLossTrick):
    """``crf``: attaches ``model.crf``; the loss (per sentence) is computed inside the model's forward by a hook, as
    a built-in CRF head would, so DDP / FSDP see its scores used; predictions are the Viterbi paths."""

    arguments = CRFArguments
    flag = "crf"
    order = 400
    changes_loss = True

    @classmethod
    def enabled(cls, args) -> bool:
        return args.crf

    @staticmethod
    def validate(args) -> None:
        if args.crf_lr_scale <= 0:
            raise ValueError(f"crf_lr_scale={args.crf_lr_scale} is not allowed; it must be > 0")
        if args.crf_bio_constraints and not args.crf:
            raise ValueError("crf_bio_constraints=True needs crf=True")

    def summary(self) -> list[str]:
        return ["crf=True"]

    def prepare_model(self, trainer, model: nn.Module) -> None:
        if unwrap_model(model, peft=True) is not unwrap_model(model) and getattr(model, "crf", None) is None:
            raise ValueError(
                "crf=True cannot be added to a PEFT model after wrapping (its adapter would not save it): call "
                "nlp_tricks.crf.add_crf(model) first, then get_peft_model with 'crf' in modules_to_save"
            )
        add_crf(model, bio_constraints=self.args.crf_bio_constraints)
        self._hook = LossInForward.attach(self._hook, trainer, model, self._loss_in_forward)

    def compute_loss(self, trainer, logits, labels, num_items_in_batch=None):
        return self.crf_loss(trainer.model, logits, labels, num_items_in_batch)

    def _loss_in_forward(self, trainer, module: nn.Module, outputs, labels, num_items) -> torch.Tensor:
        """The CRF loss inside the model's forward (multi-sample dropout: the mean over its heads)."""
        samples = trainer.head_samples(output_logits(outputs))
        losses = [self.crf_loss(module, logits, labels, num_items) for logits in samples]
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()

    @staticmethod
    def crf_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None):
        """The CRF's negative log-likelihood of the word-level tags (positions labelled -100 skipped), summed over
        sentences and divided by ``num_items_in_batch`` (sentences with a label in the whole batch; without it the
        mean over this batch's sentences)."""
        if logits.dim() != 3 or labels.dim() != 2:
            raise ValueError(
                f"crf needs token classification logits (batch, length, num_labels) and labels (batch, length); got "
                f"{tuple(logits.shape)} and {tuple(labels.shape)}"
            )
        emissions, tags, lengths, _ = compact(logits, labels)
        nll = -_crf_of(model).log_likelihood_lengths(emissions, tags, lengths).sum()
        if num_items_in_batch is None:
            return nll / (lengths > 0).sum().clamp(min=1)
        return nll / num_items_in_batch

    def count_items(self, trainer, labels):
        """An item is a sentence with at least one label."""
        return labels.ne(-100).any(dim=-1).sum()

    def param_group_options(self, trainer, model: nn.Module) -> dict:
        # `crf`, or under PEFT `base_model.model.crf` (its modules_to_save wrapper, whose trained copy is the CRF).
        name = next(
            (
                name
                for name, module in model.named_modules()
                if name.rsplit(".", 1)[-1] == "crf" and isinstance(getattr(module, "original_module", module), CRF)
            ),
            None,
        )
        if name is None:
            return {}
        # The CRF's scores are biases of the tag sequence: their own lr, no weight decay.
        return {"no_decay": (rf"^{re.escape(name)}\.",), "module_lr_scales": {name: self.args.crf_lr_scale}}

    def adjust_predictions(self, trainer, inputs, logits):
        """The Viterbi paths as one-hot scores at the labelled positions (argmax of the logits elsewhere), so
        argmax-based metrics score the paths."""
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(
                "crf prediction decodes the labelled positions (each word's first sub-token), so the batch needs "
                "`labels` (any tag id there, -100 elsewhere); for raw text call model.crf.decode(logits, word_mask)"
            )
        labels = labels.to(logits.device)
        emissions, _, lengths, order = compact(logits, labels)
        paths = _crf_of(trainer.model).viterbi_lengths(emissions, lengths)
        tags = expand(paths, order, lengths.to(logits.device), logits.argmax(dim=-1))
        return torch.nn.functional.one_hot(tags, logits.shape[-1]).to(logits.dtype)


def _crf_of(model: nn.Module) -> CRF:
    return unwrap_model(model).crf


CRFHead = CRFTrick  # its name before the built-ins were named <Flag>Trick
