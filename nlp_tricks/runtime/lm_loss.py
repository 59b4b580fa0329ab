"""How TricksTrainer computes a causal LM's loss with labels: by the model itself, in chunks from the last hidden
state, or on the full logits, decided once per model (docs/decoder_only.md). A mixin of
:class:`~nlp_tricks.TricksTrainer`; the chunked loss itself is :mod:`nlp_tricks.functional.chunked_loss`."""

from __future__ import annotations

from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..functional.chunked_loss import HeadInputCapture, is_plain_linear
from ..functional.models import unwrap_model

__all__ = ["CausalLMLossPath"]

# The extension points of the full-logits loss pipeline: a subclass overriding one keeps a causal LM's full logits.
_LOGITS_METHODS = ("compute_tricks_loss", "forward_for_loss", "head_samples", "labels_for_logits")


def _pipeline_class() -> type:
    """TricksTrainer itself, whose extension points a subclass may override (imported here: it imports this)."""
    from ..trainer import TricksTrainer

    return TricksTrainer


class CausalLMLossPath:
    """The causal-LM loss path of TricksTrainer (``lm_loss_path``) and what it rests on."""

    @property
    def lm_loss_path(self) -> str | None:
        """How this run computes a causal LM's loss with labels, decided once (docs/decoder_only.md); ``None`` for
        other models.

        - ``"model"``: every loss trick off: the model gets its labels and computes its own loss, as under plain
          ``Trainer`` (fused kernels such as Liger's, ``logits_to_keep``, a model's own loss code then apply).
        - ``"chunked"``: a loss trick on (a trick with ``changes_loss`` whose ``summary()`` is not empty:
          ``loss_type``, ``label_smoothing_factor``, ``temperature``, ``class_weights``), or ``chunked_lm_loss``: in
          training forwards (and evaluation forwards whose logits are not returned) the loss is computed from the last
          hidden state through the LM head in chunks of tokens, skipping ignored positions, never holding the full
          logits; other evaluation forwards take it on the logits.
        - ``"logits"``: a trick that needs the full logits (:attr:`~nlp_tricks.Trick.needs_logits`: R-Drop, SMART,
          scheduled sampling, a trick of yours with a loss hook, a ``loss_type`` whose function takes no
          ``LMHeadLogits``), a ``compute_loss_func``, an
          override of a full-logits extension point (``compute_tricks_loss``, ``forward_for_loss``,
          ``head_samples``, ``labels_for_logits``), DeepSpeed / FSDP (the head's weight is sharded outside the
          forward), a head that is not a plain ``nn.Linear``, or a model whose logits are not the head's output as
          it is (soft-capping, scaling: checked on every chunked forward): the pipeline on the full logits.
        """
        if self._lm_loss_path is None and self.loss_shifts_labels:
            self._lm_loss_path = self._decide_lm_loss_path()
        return self._lm_loss_path

    def _decide_lm_loss_path(self) -> str:
        chunked = getattr(self.tricks_config, "chunked_lm_loss", False)
        overridden = [
            name for name in _LOGITS_METHODS if getattr(type(self), name) is not getattr(_pipeline_class(), name)
        ]
        if (
            self.compute_loss_func is not None
            or overridden
            or self._requests
            or any(t.needs_logits for t in self.tricks)
        ):
            path = "logits"
        elif not self._loss_tricks_in_use() and self._forward_accepts_loss_kwargs and not chunked:
            path = "model"
        elif self.is_deepspeed_enabled or self.is_fsdp_enabled or self._lm_head(self.model) is None:
            path = "logits"
        else:
            path = "chunked"
        if getattr(self.args, "use_liger_kernel", False) and path != "model":
            how = "in chunks from the last hidden state" if path == "chunked" else "on the full logits"
            self._warn_once(
                f"use_liger_kernel=True: Liger's fused linear cross-entropy runs only when the model computes its own "
                f"loss; with {', '.join(self._loss_tricks_in_use()) or 'this run'} TricksTrainer computes the loss "
                f"{how} instead (Liger's other kernels still apply)"
            )
        return path

    def _lm_head(self, model: nn.Module) -> nn.Linear | None:
        """The causal LM's output projection when it is a plain ``nn.Linear`` (what the chunked loss reproduces)."""
        unwrapped = unwrap_model(model, peft=True)
        get_head = getattr(unwrapped, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        return head if is_plain_linear(head) else None

    def _full_logits_after_all(self, model, inputs, label_key, num_items_in_batch, capture: HeadInputCapture):
        """The chunked loss found the model's logits other than its head's output (or the head not called once):
        this batch again, and the run from now on, on the full logits."""
        self._lm_loss_path = "logits"
        self._warn_once(
            f"{type(unwrap_model(model, peft=True)).__name__}'s logits are not its LM head's "
            f"output as it is (soft-capping or scaling after the head, or {capture.calls} head calls in a forward): "
            "the loss is taken on the full logits"
        )
        self._context.forget_pass()
        return self._compute_labelled_loss(model, inputs, label_key, num_items_in_batch, False)

    def _decide_loss_shifts_labels(self, by_loss_type: bool) -> bool:
        """Upstream's rule from the loss type, or the (PEFT-unwrapped) class is a causal LM; never encoder-decoder."""
        model = unwrap_model(self.model, peft=True)
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        return bool(by_loss_type) or type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
