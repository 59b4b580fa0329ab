"""The optimizer of TricksTrainer: its parameter groups from the tricks' group rules (``param_group_options``:
``head_lr_scale``, ``layer_decay``, a CRF's own lr, name patterns), upstream's own optimizer when no rule is on, and
the check that a resume builds the groups its checkpoint was saved with. A mixin of
:class:`~nlp_tricks.TricksTrainer`."""

from __future__ import annotations

import logging

from torch import nn

from . import upstream as _upstream
from .param_groups import NO_DECAY_PATTERNS, build_param_groups, group_signature, upstream_param_groups
from .resume import CheckpointResumeError, optimizer_groups_problem
from .state import TRAINER_ENTRY, checkpoint_trick_states, legacy_state

__all__ = ["OptimizerGroups"]

logger = logging.getLogger("nlp_tricks.trainer")


class OptimizerGroups:
    """The groups and the optimizer TricksTrainer's ``create_optimizer`` builds (see the module docstring). The
    upstream override itself stays on the trainer, so that a host trainer's ``super(TricksTrainer, self)`` reaches
    its own."""

    def _group_rules(self, model: nn.Module) -> dict | None:
        """The group rules of this run (the tricks' ``param_group_options``: ``head_lr_scale`` / ``layer_decay``, a
        CRF's own lr, name patterns), or ``None`` when there is none: then the groups are upstream's own."""
        options = self.call_tricks("param_group_options", model)
        return options if any(value not in (None, 1.0, (), {}) for value in options.values()) else None

    def build_optimizer_groups(self, model: nn.Module) -> list[dict]:
        """Parameter groups for the optimizer, from :func:`~nlp_tricks.build_param_groups`, the arguments and the
        tricks' rules (a CRF's scores: their own lr, no weight decay; name patterns whose lr factors multiply with
        layer decay and the head scale). With no rule on, upstream's two groups (decay, no decay)."""
        options = self._group_rules(model)
        if options is None and not self._legacy_groups:
            return upstream_param_groups(self, model)
        options = options or {}
        groups = build_param_groups(
            model,
            learning_rate=self.args.learning_rate,
            weight_decay=self.args.weight_decay,
            head_lr_scale=options.get("head_lr_scale", 1.0),
            layer_decay=options.get("layer_decay", 1.0),
            no_decay=NO_DECAY_PATTERNS + tuple(options.get("no_decay", ())),
            module_lr_scales=options.get("module_lr_scales") or None,
            lr_scales=options.get("lr_scales") or None,
            param_optimizers=options.get("param_optimizers") or None,
        )
        for group in groups:
            group.pop("names")
        return groups

    def _upstream_groups_do(self, model: nn.Module) -> bool:
        """Whether upstream's optimizer and groups are this run's: no group rule on and
        :meth:`build_optimizer_groups` not overridden (then checkpoints move between ``Trainer`` and
        ``TricksTrainer`` both ways)."""
        overridden = type(self).build_optimizer_groups is not OptimizerGroups.build_optimizer_groups
        return not overridden and not self._legacy_groups and self._group_rules(model) is None

    def _grouped_optimizer(self, model: nn.Module):
        """The optimizer ``--optim`` names over :meth:`build_optimizer_groups`' groups (refused, naming the rules,
        for an optimizer that builds its own groups)."""
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        builds_own_groups = _upstream.is_optimizer_factory(optimizer_cls) or any(
            key in optimizer_kwargs for key in ("params", "model", "optimizer_dict")
        )
        if builds_own_groups:
            rules = [s for t in self._implementers["param_group_options"] for s in t.summary()]
            raise ValueError(
                f"optim={self.args.optim!r} builds its own parameter groups, so the group rules of this run "
                f"({', '.join(rules)}) cannot apply; turn them off or choose another optimizer"
            )
        groups = self.build_optimizer_groups(model)
        # Saved with each checkpoint: a resume whose settings would build other groups is refused, naming them.
        self._optimizer_groups = self._group_signature(groups)
        return optimizer_cls(groups, **optimizer_kwargs)

    def _group_signature(self, groups: list[dict]) -> dict:
        settings = {name: getattr(self.args, name, None) for name in ("head_lr_scale", "layer_decay", "weight_decay")}
        rules = [s for t in self._implementers["param_group_options"] for s in t.summary()]
        tricks = [s for t in self.tricks for s in t.summary()]
        return group_signature(groups, {**settings, "tricks": tricks, "group_rules": rules})

    def _saved_group_signature(self, checkpoint: str) -> dict | None:
        states = checkpoint_trick_states(checkpoint) or {}
        if TRAINER_ENTRY in states:
            return states[TRAINER_ENTRY].get("optimizer_groups")
        return legacy_state(checkpoint)["optimizer_groups"]

    def _check_optimizer_groups(self, checkpoint: str) -> None:
        """Refuse, naming the settings, a resume whose optimizer groups differ from the checkpoint's. A checkpoint of
        an earlier TricksTrainer with no group rule on (its groups split body / head, not upstream's decay / no
        decay) resumes in its own layout."""
        saved = self._saved_group_signature(checkpoint)
        current = self._group_signature(self.build_optimizer_groups(self.model))
        problem = optimizer_groups_problem(checkpoint, current, saved)
        if problem is not None and self._group_rules(self.model) is None:
            self._legacy_groups = True
            if (
                optimizer_groups_problem(
                    checkpoint, self._group_signature(self.build_optimizer_groups(self.model)), saved
                )
                is None
            ):
                logger.info(f"{checkpoint} holds an earlier TricksTrainer's optimizer groups: resuming in that layout")
                return
            self._legacy_groups = False
        if problem is not None:
            raise CheckpointResumeError(f"resume_from_checkpoint={checkpoint!r}: {problem}")
