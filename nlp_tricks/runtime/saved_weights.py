"""The weights TricksTrainer evaluates, predicts with and saves: the ones the tricks choose (``eval_weights``: the
EMA's with ``--ema_eval``; ``saved_weights_info``: what they are, written as ``averaging.json`` beside the final
model), the raw ones and the tricks' state store in every ``checkpoint-N``, and the model card's section on the
tricks. A mixin of :class:`~nlp_tricks.TricksTrainer`."""

from __future__ import annotations

import copy
import os

from .averaging import AVERAGING_INFO_NAME, write_averaging_info
from .integrity import final_model_written
from .resume import CHECKPOINT_RE

__all__ = ["ChosenWeights", "tricks_section"]


class ChosenWeights:
    """Upstream's ``evaluate``, ``predict``, ``save_model`` and ``create_model_card`` with the tricks' weights (see the
    module docstring)."""

    def _eval_weights(self):
        """The weights the tricks choose for evaluation and the final model (the EMA's with ``--ema_eval``)."""
        return self.call_tricks("eval_weights")

    def averaged_model(self):
        """A copy of ``trainer.model`` holding the weights the final :meth:`save_model` writes: the EMA's with
        ``ema_eval`` (after :meth:`train`, ``trainer.model`` keeps the raw weights, which training continues from),
        the checkpoint average after ``swa_last_k`` (already in ``trainer.model``), else the trained weights."""
        with self._eval_weights():
            return copy.deepcopy(self.model)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval", **kwargs):
        """Upstream ``evaluate``, with the weights the tricks choose (``--ema_eval``: the EMA's; the raw ones are
        restored bitwise after)."""
        with self._eval_weights():
            return super().evaluate(
                eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs
            )

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test", **kwargs):
        """Upstream ``predict``, with the weights the tricks choose (as :meth:`evaluate`)."""
        with self._eval_weights():
            return super().predict(
                test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs
            )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Upstream ``save_model``, plus the tricks' state.

        - Into a ``checkpoint-N`` folder: the raw weights and the state store (``tricks_state.safetensors``: every
          trick's ``state_dict()``, the EMA's tensors included), written before ``trainer_state.json``, so a
          complete checkpoint holds it.
        - Anywhere else (the final model): the weights the tricks choose (the EMA's with ``--ema_eval``, the
          checkpoint average after ``--swa_last_k``), with an ``averaging.json`` beside them saying so.
        """
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if CHECKPOINT_RE.match(os.path.basename(os.path.normpath(output_dir))):
            super().save_model(output_dir, _internal_call)
            if self.args.should_save:
                self._save_trick_states(output_dir)
            return
        info = self.call_tricks("saved_weights_info")
        with final_model_written(self, output_dir), self._eval_weights():
            super().save_model(output_dir, _internal_call)
        if self.args.should_save and os.path.isdir(output_dir):
            if info is not None:
                write_averaging_info(output_dir, info)
            elif os.path.isfile(os.path.join(output_dir, AVERAGING_INFO_NAME)):
                os.remove(os.path.join(output_dir, AVERAGING_INFO_NAME))  # left by an earlier run: no longer true

    def create_model_card(self, *args, tags: str | list[str] | None = None, **kwargs) -> None:
        """Upstream's model card, tagged ``nlp-tricks``, with a section naming the tricks of the run and which
        weights were saved (the EMA's, a checkpoint average)."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        super().create_model_card(*args, tags=[*tags, "nlp-tricks"], **kwargs)
        path = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.isfile(path):
            return
        with open(path, "a", encoding="utf-8") as f:
            f.write(tricks_section(self.tricks, self.call_tricks("saved_weights_info")))


def tricks_section(tricks, saved_weights: dict | None) -> str:
    """The model card's section on a run's tricks and, when a trick chose them, the saved weights."""
    lines = ["", "## Tricks (nlp_tricks)", "", "Trained with `nlp_tricks.TricksTrainer` and these tricks:", ""]
    lines += [f"- `{setting}`" for trick in tricks for setting in trick.summary()]
    if saved_weights is not None:
        what = {"ema": "the exponential moving average of the weights", "swa": "the average of checkpoints"}
        details = ", ".join(f"{k}: {v}" for k, v in saved_weights.items() if k != "weights")
        kind = saved_weights["weights"]
        lines += ["", f"The saved weights are {what.get(kind, kind)} ({details})."]
    return "\n".join(lines) + "\n"
