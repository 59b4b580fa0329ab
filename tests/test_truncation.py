"""Where long texts are cut (nlp_tricks.data.truncation) and prompts (nlp_tricks.data.prompts): the budget of a pair
shared as the tokenizers library shares it, exactly which tokens each side keeps, texts that fit untouched, a
prompt's own tokens never cut."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from nlp_tricks.data.prompts import PromptTemplate, default_prompt_template, encode_prompts, leading_special_ids
from nlp_tricks.data.truncation import cut_tokens, encode_cut, kept_positions, segment_budgets

WORDS = [f"w{i}" for i in range(40)] + [f"v{i}" for i in range(40)] + ["Q", "A", ":", "|", "?", "<s>"]


def tokenizer(specials: str = "bert") -> PreTrainedTokenizerFast:
    """One token per word; BERT's specials ([CLS] a [SEP] b [SEP]), a Llama-like ``<s>`` in front (``bos``), or
    none (``none``, as GPT-2's)."""
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if specials == "bos":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", vocab["<s>"])]
        )
    elif specials == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="<s>",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def test_pair_budgets_are_the_tokenizers_longest_first():
    tok = tokenizer()
    for max_length in (5, 8, 11):
        for a in range(1, 12):
            for b in range(1, 12):
                encoding = tok(words("w", a), words("v", b), truncation=True, max_length=max_length)
                segments = encoding.sequence_ids()
                kept = [segments.count(0), segments.count(1)]
                assert segment_budgets([a, b], max_length - 3) == kept, (a, b, max_length)


@pytest.mark.parametrize("pairs", [False, True])
def test_right_side_cut_equals_the_tokenizers_own_truncation(pairs):
    tok = tokenizer()
    texts = [words("w", n) for n in (3, 15, 30)]
    seconds = [words("v", n) for n in (20, 2, 30)] if pairs else None
    cut, truncated = encode_cut(tok, texts, seconds, 12, "right")
    reference = tok(texts, seconds, truncation=True, max_length=12)
    assert cut == {key: reference[key] for key in cut}
    assert truncated == [pairs, True, True]


def test_each_side_keeps_exactly_its_tokens():
    assert kept_positions(10, 4, "right") == [0, 1, 2, 3]
    assert kept_positions(10, 4, "left") == [6, 7, 8, 9]
    assert kept_positions(10, 4, "head_tail", head_tokens=1) == [0, 7, 8, 9]
    assert kept_positions(10, 8, "head_tail") == [0, 1, 4, 5, 6, 7, 8, 9]  # a quarter of the budget as the head
    assert kept_positions(10, 4, "head_tail", head_tokens=9) == [0, 1, 2, 3]  # the head is at most the budget
    assert kept_positions(10, 5, "middle") == [0, 1, 2, 8, 9]
    assert kept_positions(3, 5, "middle") == [0, 1, 2]  # fits: untouched


@pytest.mark.parametrize(
    ("side", "kept"),
    [
        ("left", "w24 w25 w26 w27 w28 w29 w30 w31 w32 w33"),
        ("head_tail", "w0 w1 w2 w27 w28 w29 w30 w31 w32 w33"),
        ("middle", "w0 w1 w2 w3 w4 w29 w30 w31 w32 w33"),
    ],
)
def test_a_single_text_keeps_its_budget_and_the_special_tokens(side, kept):
    tok = tokenizer()
    encodings, truncated = encode_cut(
        tok, [words("w", 34), words("w", 5)], None, 12, side, 3 if side == "head_tail" else None
    )
    assert tok.decode(encodings["input_ids"][0]) == f"[CLS] {kept} [SEP]"
    assert tok.decode(encodings["input_ids"][1]) == f"[CLS] {words('w', 5)} [SEP]"  # fits: untouched
    assert truncated == [True, False]


def test_a_pair_gets_a_budget_per_segment_and_token_type_ids_follow():
    tok = tokenizer()
    encodings, _ = encode_cut(tok, [words("w", 20)], [words("v", 3)], 13, "left")
    # 13 - 3 specials = 10: the second text keeps its 3 (it fits), the first the other 7, from its end.
    assert tok.decode(encodings["input_ids"][0]) == "[CLS] w13 w14 w15 w16 w17 w18 w19 [SEP] v0 v1 v2 [SEP]"
    assert encodings["token_type_ids"][0] == [0] * 9 + [1] * 4


def test_template_tokens_are_never_cut_and_a_prompt_that_fits_is_the_tokenizers_reading():
    tok = tokenizer("none")
    template = PromptTemplate("Q {text} | {text_pair} A :")
    texts, seconds = [words("w", 30), "w1 w2"], [words("v", 4), "v7"]
    encodings, cut, prompts = encode_prompts(tok, template, texts, seconds, 12, "left")
    assert prompts[1] == "Q w1 w2 | v7 A :"
    assert encodings["input_ids"][1] == tok(prompts[1], add_special_tokens=False)["input_ids"]
    # 12 - 4 template tokens = 8: the pair's second text keeps its 4, the first its last 4.
    assert tok.decode(encodings["input_ids"][0]) == "Q w26 w27 w28 w29 | v0 v1 v2 v3 A :"
    assert cut == [True, False] and encodings["attention_mask"][0] == [1] * 12
    with pytest.raises(ValueError, match="--max_seq_length 3: the prompt template's tokens fill it"):
        encode_prompts(tok, template, texts, seconds, 3)


def test_the_tokenizers_bos_goes_in_front_once():
    tok = tokenizer("bos")
    assert leading_special_ids(tok) == [tok.convert_tokens_to_ids("<s>")]
    encodings, _, _ = encode_prompts(tok, PromptTemplate("Q {text} A"), ["w1", "w2"], None, 16)
    assert tok.decode(encodings["input_ids"][0]) == "<s> Q w1 A"
    encodings, _, _ = encode_prompts(tok, PromptTemplate("<s> Q {text} A"), ["w1"], None, 16)
    assert tok.decode(encodings["input_ids"][0]) == "<s> Q w1 A"  # the template's own BOS: not doubled
    assert leading_special_ids(tokenizer("none")) == []


def test_cut_tokens_refuses_when_the_fixed_tokens_fill_the_budget():
    assert cut_tokens([None, 0, 0, None], 4) == ([0, 1, 2, 3], False)
    with pytest.raises(ValueError, match="2 tokens that are never cut"):
        cut_tokens([None, 0, 0, None], 2)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{text} {label}", r"\{label\}: a template holds only"),
        ("{text!r}", r"\{text!r\}: a template holds only"),
        ("{text:>9}", r"\{text:>9\}: a template holds only"),
        ("no field", "exactly once"),
        ("{text} {text}", "exactly once"),
        ("{text", "not a format string"),
    ],
)
def test_a_template_holds_text_and_text_pair_only(template, message):
    with pytest.raises(ValueError, match=message):
        PromptTemplate(template)


def test_literal_braces_and_spans():
    template = PromptTemplate('{{"a": {text}}} -> {text_pair}')
    prompt, spans = template.render("x y", "z")
    assert prompt == '{"a": x y} -> z'
    assert [prompt[s:e] for s, e, _ in spans] == ["x y", "z"] and [seg for *_, seg in spans] == [0, 1]
    assert template.pairs and not PromptTemplate("{text}").pairs


def test_default_template_is_the_question_in_the_chat_template():
    tok = tokenizer()
    plain = default_prompt_template(tok, ["Sport", "Tech"])
    assert plain.template.endswith(
        "Which one of these labels fits it: Sport, Tech? Answer with the label only.\nAnswer:"
    )
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    template = default_prompt_template(tok, ["Sport", "Te{ch}"], pairs=True)
    prompt, _ = template.render("first {text}", "second")
    question = "Text A: first {text}\n\nText B: second\n\nWhich one of these labels fits the pair: Sport, Te{ch}?"
    message = question + " Answer with the label only."
    expected = tok.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == expected
