"""The training logs of TricksTrainer: the tricks' per-step numbers (``record_metric``, ``record_loss_term``),
averaged over the steps since the last log and over processes; their cumulative counters (``trick_state``); each
parameter group's learning rate. A mixin of :class:`~nlp_tricks.TricksTrainer`."""

from __future__ import annotations

import torch

from .param_groups import group_learning_rates

__all__ = ["StepLogging"]


class StepLogging:
    """What TricksTrainer adds to each training log (see the module docstring). The trainer provides
    ``_step_metrics`` (name -> recorded values), ``_context`` and ``trick_state``."""

    def record_metric(self, name: str, value: torch.Tensor | float) -> None:
        """Record a per-step number; the next training log shows its mean since the previous log (over processes)."""
        value = value.detach().float() if torch.is_tensor(value) else torch.tensor(float(value))
        self._step_metrics[name].append(value)

    def record_loss_term(self, name: str, term: torch.Tensor, num_items_in_batch=None) -> None:
        """Log a loss term beside the logged ``loss``, on its scale. With ``num_items_in_batch`` the term is this
        micro-batch's share of the step's per-item mean (over micro-batches and processes): scaled back up by both
        counts."""
        if num_items_in_batch is not None:
            context = self._context
            micro_batches = context.num_micro_batches if context is not None else 1
            term = term * micro_batches * self.loss_scale_for_devices()
        self.record_metric(name, term)

    def record_raw_loss(self, loss: torch.Tensor, share: torch.Tensor | None) -> None:
        """Log ``loss_raw``, the training loss before the tricks' ``adjust_loss`` terms, beside the logged ``loss``
        and on its scale (exact under accumulation and DDP, as :meth:`record_loss_term`). ``loss`` is the clean pass's
        (the pass whose loss is logged), ``share`` its micro-batch's share of the step (``None``: a per-batch mean,
        which upstream averages over the micro-batches)."""
        context = self._context
        if context is None or context.pass_kind != "clean":
            return
        self.record_metric("loss_raw", loss if share is None else loss * context.num_micro_batches)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log (not eval, not the end-of-training summary)
            if self._step_metrics:
                names = sorted(self._step_metrics)
                means = torch.stack(
                    [torch.stack([v.to(self.args.device) for v in self._step_metrics[n]]).mean() for n in names]
                )
                if self.accelerator.num_processes > 1:
                    means = self.accelerator.reduce(means, reduction="mean")
                logs.update({n: round(float(m), 4) for n, m in zip(names, means)})
                self._step_metrics.clear()
            logs.update(dict(self.trick_state))
            if self.optimizer is not None and "learning_rate" in logs:
                logs.update(group_learning_rates(self.optimizer.param_groups, logs["learning_rate"]))
        super().log(logs, start_time)
