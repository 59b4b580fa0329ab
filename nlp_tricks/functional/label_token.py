"""Label-token scoring: a causal LM as a classifier over the next-token logits of C label words, at one position.

The prompt ends where the answer goes (its last kept token, under left or right padding); the class logits are the
LM head's logits of the label words' first tokens there, ``h_answer @ W[token_ids].T (+ b[token_ids])``, computed
from the last hidden state of that one position and the head's C rows: never the ``(batch, length, vocabulary)``
tensor. The cross-entropy over these C logits is the loss of Kaggle's winning LLM classifiers (Jigsaw 2025: a Yes/No
loss, score ``logit(Yes) - logit(No)``; WSDM 2024: the loss on "A" / "B" only).

Plain torch: :class:`nlp_tricks.label_token.LabelTokenClassifier` wires it into a transformers causal LM.
"""

from __future__ import annotations

import torch

__all__ = ["answer_positions", "positions_from_mask", "gather_positions", "label_token_logits"]


def answer_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` the index of each row's last kept token (its last 1 in ``attention_mask``): the answer position of
    a left- or right-padded batch alike.

    Raises:
        ValueError: a row without any kept token.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (batch, length), got shape {tuple(attention_mask.shape)}")
    kept = attention_mask.ne(0)
    if not bool(kept.any(dim=1).all()):
        raise ValueError("a row of attention_mask keeps no token: it has no answer position")
    length = kept.shape[1]
    # The first 1 from the end, as an index from the start.
    return length - 1 - kept.flip(1).long().argmax(dim=1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` position ids that count kept tokens only, so a left-padded row sees the positions of its
    right-padded twin (padding gets 0; it is masked anyway)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def gather_positions(hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(B, H)``: ``hidden_states[b, positions[b]]`` of a ``(B, L, H)`` tensor."""
    index = positions.to(hidden_states.device).view(-1, 1, 1).expand(-1, 1, hidden_states.shape[-1])
    return hidden_states.gather(1, index).squeeze(1)


def label_token_logits(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``(B, C)`` class logits: the LM head's logits of ``token_ids`` at each row's answer position.

    Args:
        hidden_states (`torch.Tensor`): ``(B, L, H)``, the last hidden state (after the final norm: what the LM head
            reads).
        attention_mask (`torch.Tensor`): ``(B, L)``; the answer position is each row's last 1.
        weight (`torch.Tensor`): ``(V, H)``, the LM head's weight (tied or not).
        token_ids (`torch.Tensor`): ``(C,)`` the label words' token ids, in class order.
        bias (`torch.Tensor`, *optional*): ``(V,)``, the LM head's bias.
        softcap (`float`, *optional*): a model's final logit soft-capping (Gemma 2: ``cap * tanh(x / cap)``),
            applied as the model applies it to its logits.

    Only the answer positions' states and the C rows of the head take part, so no other position and no other
    vocabulary row gets a gradient.
    """
    states = gather_positions(hidden_states, answer_positions(attention_mask))
    token_ids = token_ids.to(weight.device)
    logits = states @ weight.index_select(0, token_ids).to(states.dtype).T
    if bias is not None:
        logits = logits + bias.index_select(0, token_ids).to(logits.dtype)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits
