"""A padding token for tokenizers that have none (decoder LMs: Llama-3, GPT-2, ...), and the model fitted to it."""

from __future__ import annotations

from .process import warn

# A tokenizer without a padding token pads with the first of these it has (a classifier reads the last token that is
# not padding: an unknown token is rarer at the end of a text than an end-of-sequence one), else with a new one.
PAD_PREFERENCE = ("unk_token", "eos_token")
NEW_PAD_TOKEN = "<pad>"


def choose_pad_token(
    tokenizer, requested: str | None, source: str, preference: tuple[str, ...] = PAD_PREFERENCE
) -> int | None:
    """Give ``tokenizer`` a padding token: ``requested`` (``--pad_token``) when given, else its own, else the first
    of its ``preference`` tokens it has (``unk_token``, ``eos_token``), else a new ``<pad>``; the choice of a token
    the tokenizer did not have is said in one line naming ``source``. A token not in the vocabulary is added to it.

    Returns the id of the token added to the vocabulary (its embedding row is new: :func:`fit_model_to_tokenizer`
    grows the model, and under LoRA it trains in full), or None when the token was there already.
    """
    if requested is None and tokenizer.pad_token is not None:
        return None
    if requested is not None:
        token, how = requested, "--pad_token"
    else:
        kind = next((name for name in preference if getattr(tokenizer, name, None) is not None), None)
        token = getattr(tokenizer, kind) if kind else NEW_PAD_TOKEN
        how = f"its {kind.removesuffix('_token')} token" if kind else "a new token"
    added = token not in tokenizer.get_vocab()
    if added:
        tokenizer.add_special_tokens({"pad_token": token})
    else:
        tokenizer.pad_token = token
    if requested is None:
        warn(
            f"{source}: its tokenizer has no padding token; padding with {how} {token!r} (id "
            f"{tokenizer.pad_token_id}){', added to the vocabulary' if added else ''}; --pad_token TOKEN chooses one"
        )
    return tokenizer.pad_token_id if added else None


def fit_model_to_tokenizer(model, tokenizer) -> None:
    """The model's embeddings grown to a vocabulary that gained tokens, and its ``config.pad_token_id`` set to the
    tokenizer's: a decoder's sequence classifier reads the last token that is not padding by that id."""
    embeddings = model.get_input_embeddings()
    if embeddings is not None and len(tokenizer) > embeddings.num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    if tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # multimodal configs read their text's
