"""Prompts of a label-token classifier: a template with the text (and the second text of a pair) in its place, whose
last token is the answer position, tokenized so that a long text is cut inside the prompt and the template's own
tokens never are.

A template is a Python format string with ``{text}`` and, for text pairs, ``{text_pair}``, used exactly as written
(``{{`` / ``}}`` for literal braces). The default is built from the tokenizer's chat template when it has one (the
question as the user's message, then the assistant's turn opens), else a plain one ending in ``Answer:``.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from .truncation import cut_tokens

__all__ = ["PromptTemplate", "default_prompt_template", "encode_prompts", "leading_special_ids"]

_FIELDS = ("text", "text_pair")


@dataclass(frozen=True)
class PromptTemplate:
    """A format string with ``{text}`` once and, for pairs, ``{text_pair}`` once; nothing else in braces.

    Raises:
        ValueError: another field, a format spec or conversion, or a field missing or repeated.
    """

    template: str

    def __post_init__(self):
        try:
            parts = list(string.Formatter().parse(self.template))
        except ValueError as err:
            raise ValueError(f"not a format string ({err}); write a literal brace as {{{{ or }}}}") from err
        names = [name for _, name, _, _ in parts if name is not None]
        for _, name, spec, conversion in parts:
            if name is not None and (name not in _FIELDS or spec or conversion):
                shown = "{" + name + ("!" + conversion if conversion else "") + (":" + spec if spec else "") + "}"
                raise ValueError(f"{shown}: a template holds only {{text}} and {{text_pair}}, as they are")
        if names.count("text") != 1 or names.count("text_pair") > 1:
            raise ValueError("a template holds {text} exactly once (and {text_pair} at most once)")

    @property
    def pairs(self) -> bool:
        """Whether the template has a ``{text_pair}``."""
        return any(name == "text_pair" for _, name, _, _ in string.Formatter().parse(self.template))

    def render(self, text: str, text_pair: str | None = None) -> tuple[str, list[tuple[int, int, int]]]:
        """``(prompt, spans)``: the prompt, and ``(start, end, segment)`` of the text (segment 0) and the pair's
        second text (segment 1) in it, in characters."""
        values = {"text": (text, 0), "text_pair": (text_pair if text_pair is not None else "", 1)}
        pieces, spans, at = [], [], 0
        for literal, name, _, _ in string.Formatter().parse(self.template):
            pieces.append(literal)
            at += len(literal)
            if name is not None:
                value, segment = values[name]
                pieces.append(value)
                spans.append((at, at + len(value), segment))
                at += len(value)
        return "".join(pieces), spans


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def default_prompt_template(tokenizer, label_words: list[str], pairs: bool = False) -> PromptTemplate:
    """The question ``Text: ... Which one of these labels fits it: w1, w2, ...? Answer with the label only.`` (for
    pairs ``Text A: ... Text B: ...``), as the user's message of the tokenizer's chat template with the assistant's
    turn opened (``add_generation_prompt``), or without a chat template followed by ``\\nAnswer:``.

    Raises:
        ValueError: the chat template does not keep the message as written (then give a template).
    """
    choices = _escape(", ".join(label_words))
    body = "Text A: {text}\n\nText B: {text_pair}" if pairs else "Text: {text}"
    what = "the pair" if pairs else "it"
    question = f"{body}\n\nWhich one of these labels fits {what}: {choices}? Answer with the label only."
    if not getattr(tokenizer, "chat_template", None):
        return PromptTemplate(question + "\nAnswer:")
    # The message goes through the chat template with markers in the texts' places, which become the fields again.
    markers = {"text": "\x00TEXT\x00", "text_pair": "\x00PAIR\x00"}
    message = question.replace("{{", "{").replace("}}", "}")
    message = message.replace("{text}", markers["text"]).replace("{text_pair}", markers["text_pair"])
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    wanted = ["text", "text_pair"] if pairs else ["text"]
    if any(rendered.count(markers[name]) != 1 for name in wanted):
        raise ValueError("the tokenizer's chat template does not keep the message as written; give a template")
    template = _escape(rendered)
    for name in wanted:
        template = template.replace(_escape(markers[name]), "{" + name + "}")
    return PromptTemplate(template)


def leading_special_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts in front of a text on its own (a BOS), found by encoding one."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def encode_prompts(
    tokenizer,
    template: PromptTemplate,
    texts: list[str],
    pairs: list[str] | None,
    max_length: int,
    side: str = "right",
    head_tokens: int | None = None,
) -> tuple[dict, list[bool], list[str]]:
    """``(encodings, cut, prompts)``: each prompt tokenized as one string (so a prompt that fits is exactly the
    tokenizer's reading of it), the tokenizer's leading special tokens (BOS) put in front unless the prompt starts
    with them; a prompt over ``max_length`` tokens loses text tokens (those lying wholly inside the text's
    characters) on ``side``, never a template token. Needs a fast tokenizer (offsets).

    Raises:
        ValueError: the template's own tokens alone exceed ``max_length``.
    """
    rendered = [template.render(t, pairs[i] if pairs is not None else None) for i, t in enumerate(texts)]
    prompts = [prompt for prompt, _ in rendered]
    encodings = tokenizer(prompts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    lead = leading_special_ids(tokenizer)
    out = {"input_ids": [], "attention_mask": []}
    truncated = []
    for row, (_, spans) in enumerate(rendered):
        ids = list(encodings["input_ids"][row])
        segments = [_segment(start, end, spans) for start, end in encodings["offset_mapping"][row]]
        if lead and ids[: len(lead)] != lead:
            ids, segments = lead + ids, [None] * len(lead) + segments
        try:
            kept, cut = cut_tokens(segments, max_length, side, head_tokens)
        except ValueError as err:
            raise ValueError(f"--max_seq_length {max_length}: the prompt template's tokens fill it ({err})") from err
        out["input_ids"].append([ids[i] for i in kept])
        out["attention_mask"].append([1] * len(kept))
        truncated.append(cut)
    return out, truncated, prompts


def _segment(start: int, end: int, spans: list[tuple[int, int, int]]) -> int | None:
    """The segment of a token whose characters lie wholly inside one text's span; None (never cut) otherwise."""
    if end <= start:
        return None
    for span_start, span_end, segment in spans:
        if span_start <= start and end <= span_end:
            return segment
    return None
