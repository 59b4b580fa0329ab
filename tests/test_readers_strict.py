"""What the readers used to misread or end in a traceback on: each case is read as written or refused with one
``file:line: message`` (a :class:`DataError`).

Expected values are written out by hand from the file's bytes; refusals name the line a reader of the file would
point at.
"""

from __future__ import annotations

import json
import random
from decimal import Decimal

import pytest

from nlp_tricks.data import (
    DataError,
    check_labels,
    label_list,
    read_conll,
    read_conll_tokens,
    read_csv,
    read_jsonl,
    read_ner_file,
    read_table_file,
    read_text_sentences,
)
from recipe_helpers import run_in_process, tiny_args


def error_of(fn, *args, **kwargs) -> DataError:
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return info.value


def write(tmp_path, name: str, data: str | bytes):
    path = tmp_path / name
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


# ---- CSV / TSV ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix, sep", [(".csv", ","), (".tsv", "\t")])
def test_a_row_with_more_fields_than_the_header_is_refused(tmp_path, suffix, sep):
    path = write(tmp_path, "train" + suffix, f"text{sep}label\nfine{sep}pos\nhello{sep} world{sep}pos\n")
    err = error_of(read_table_file, path, ["text", "label"])
    assert (err.path, err.line) == (str(path), 3)
    assert "3 fields" in err.message and "2" in err.message


@pytest.mark.parametrize("suffix, sep", [(".csv", ","), (".tsv", "\t")])
def test_duplicate_header_columns_are_refused(tmp_path, suffix, sep):
    path = write(tmp_path, "train" + suffix, f"text{sep}label{sep}label\na{sep}pos{sep}neg\n")
    err = error_of(read_table_file, path, ["text", "label"])
    assert (err.line, "'label'" in err.message) == (1, True)


def test_a_blank_first_line_is_reported_as_blank(tmp_path):
    path = write(tmp_path, "train.csv", "\ntext,label\na,pos\n")
    err = error_of(read_csv, path, ["text", "label"])
    assert err.line == 1 and "blank" in err.message and "[]" not in err.message


def test_a_quote_that_opens_a_csv_value_must_close_it(tmp_path):
    path = write(tmp_path, "train.csv", 'text,label\nok,neg\n"Hi," she said,pos\n')
    err = error_of(read_csv, path, ["text", "label"])
    assert err.line == 3 and "not valid CSV" in err.message


def test_csv_fields_longer_than_131072_characters_are_read(tmp_path):
    long_text = "word " * 60_000  # 300,000 characters, over csv's default field limit
    path = write(tmp_path, "train.csv", f'text,label\n"{long_text}",pos\nshort,neg\n')
    assert read_csv(path, ["text", "label"]) == [
        {"text": long_text, "label": "pos", "line": 2},
        {"text": "short", "label": "neg", "line": 3},
    ]


def test_crlf_inside_a_quoted_csv_value_is_kept_as_written(tmp_path):
    path = write(tmp_path, "train.csv", 'text,label\r\n"one\r\ntwo\nthree",pos\r\nx,neg\r\n')
    assert [ex["text"] for ex in read_csv(path, ["text", "label"])] == ["one\r\ntwo\nthree", "x"]


@pytest.mark.parametrize("end", ["\r", "\r\n", "mixed"])
def test_line_ends_of_every_kind_are_line_breaks_in_every_format(tmp_path, end):
    def text(lines):
        if end != "mixed":
            return "".join(line + end for line in lines)
        return "".join(line + ("\r", "\n", "\r\n")[i % 3] for i, line in enumerate(lines))

    csv_path = write(tmp_path, "a.csv", text(["text,label", "a b,pos", "c,neg"]))
    assert [(ex["text"], ex["label"], ex["line"]) for ex in read_csv(csv_path, ["text", "label"])] == [
        ("a b", "pos", 2),
        ("c", "neg", 3),
    ]
    tsv_path = write(tmp_path, "a.tsv", text(["text\tlabel", "a b\tpos", "c\tneg"]))
    assert [ex["text"] for ex in read_table_file(tsv_path, ["text", "label"])] == ["a b", "c"]
    jsonl = write(tmp_path, "a.jsonl", text(['{"text": "a", "label": "x"}', '{"text": "b", "label": "y"}']))
    assert [(ex["text"], ex["line"]) for ex in read_table_file(jsonl, ["text", "label"])] == [("a", 1), ("b", 2)]
    conll = write(tmp_path, "a.conll", text(["John B-PER", "lives O", "", "Rome B-LOC"]))
    assert [(ex["tokens"], ex["tag_lines"]) for ex in read_conll(conll)] == [
        (["John", "lives"], [1, 2]),
        (["Rome"], [4]),
    ]
    plain = write(tmp_path, "a.txt", text(["John lives here", "Mary too"]))
    assert [ex["tokens"] for ex in read_text_sentences(plain)] == [["John", "lives", "here"], ["Mary", "too"]]


def test_a_byte_that_is_not_utf8_names_its_line_after_cr_line_ends(tmp_path):
    path = write(tmp_path, "train.csv", b"text,label\ra,pos\rcaf\xe9,neg\r")
    err = error_of(read_csv, path, ["text", "label"])
    assert (err.line, err.message) == (3, "not valid UTF-8 (byte 0xe9 at column 4)")


# ---- CoNLL and plain text -----------------------------------------------------------------------------------------


def test_a_one_line_conll_sentence_is_checked_against_the_files_columns(tmp_path):
    path = write(tmp_path, "train.conll", "I O\nlove O\n\nNew York B-LOC\n\nRome B-LOC\n")
    err = error_of(read_conll, path)
    assert err.line == 4 and "3 columns" in err.message


# Characters Python's str.split() / str.splitlines() break on that are not ASCII whitespace.
SEPARATORS = ["\u2028", "\u2029", "\x85", "\x1c", "\x1d", "\x1e", "\x1f", "\xa0", "\u3000", "\u2009", "\u202f"]
# Of them, the spaces that separate the words of plain text (category Zs, not a no-break space); in CoNLL, CSV and
# JSON they are characters of a token or a value.
TEXT_WORD_SEPARATORS = {"\u3000", "\u2009"}


@pytest.mark.parametrize("sep", SEPARATORS, ids=[f"U+{ord(c):04X}" for c in SEPARATORS])
def test_unicode_separators_inside_a_token_split_only_plain_text_at_spaces(tmp_path, sep):
    token = f"10{sep}000"
    conll = write(tmp_path, "a.conll", f"x O\n{token} B-NUM\ny O\n")
    assert read_conll(conll)[0]["tokens"] == ["x", token, "y"]
    tabbed = write(tmp_path, "b.conll", f"x\tO\n{token}\tB-NUM\n")
    assert read_conll(tabbed)[0]["tokens"] == ["x", token]
    one_column = write(tmp_path, "c.conll", f"{token}\nabc\n\nz\n")
    assert [ex["tokens"] for ex in read_conll_tokens(one_column)] == [[token, "abc"], ["z"]]
    plain = write(tmp_path, "d.txt", f"costs {token} euros\nand more\n")
    words = ["10", "000"] if sep in TEXT_WORD_SEPARATORS else [token]
    assert [ex["tokens"] for ex in read_text_sentences(plain)] == [["costs", *words, "euros"], ["and", "more"]]
    jsonl = write(tmp_path, "e.jsonl", json.dumps({"text": f"a{sep}b", "label": "x"}) + "\n")
    assert read_table_file(jsonl, ["text", "label"])[0]["text"] == f"a{sep}b"
    csv_path = write(tmp_path, "f.csv", f"text,label\na{sep}b,x\n")
    assert read_csv(csv_path, ["text", "label"])[0]["text"] == f"a{sep}b"


@pytest.mark.parametrize("sep", ["\t", " "])
def test_the_tokens_reader_skips_the_comments_read_conll_skips(tmp_path, sep):
    # "# sent_id = s3" has as many words as the file has columns; a tagged read skipped it, the tokens reader read it
    # as the token '#' (space-separated) or ended in min() of an empty sequence (tab-separated).
    lines = ["# sent_id = s3", "John x NNP B-PER", "runs x VBZ O", "", "# sent_id = s4", "Mary x NNP B-PER", ""]
    path = write(tmp_path, "a.conll", "\n".join(line.replace(" ", sep) if line[:1] != "#" else line for line in lines))
    want = [(["John", "runs"], 2), (["Mary"], 6)]
    assert [(ex["tokens"], ex["line"]) for ex in read_conll_tokens(path)] == want
    assert [(ex["tokens"], ex["line"]) for ex in read_conll(path)] == want
    # The token '#' with a tag of the file stays a token in both.
    hashed = write(tmp_path, "b.conll", "a\tx\tNN\tO\n\n# x NN O\n")
    assert (
        [ex["tokens"] for ex in read_conll_tokens(hashed)]
        == [["a"], ["#"]]
        == [ex["tokens"] for ex in read_conll(hashed)]
    )


def test_a_one_line_file_too_wide_for_conll_names_its_line(tmp_path):
    path = write(tmp_path, "train.conll", "\ufeff" + " ".join(f"w{i}" for i in range(200_000)) + " O\n")
    want = (
        f"{path}:1: the file's one line has 200001 columns: too wide to be CoNLL (one token per line, token first, "
        "tag last, a blank line between sentences); text of one sentence per line is a .txt file"
    )
    for reader in (read_conll, read_conll_tokens, read_ner_file):
        assert str(error_of(reader, path)) == want
    # A sentence of one line of a CoNLL-U width (10 columns) reads.
    ok = write(tmp_path, "one.conll", "\t".join(["1", "Rome", "rome", "PROPN", "NNP", "_", "0", "root", "_", "B-LOC"]))
    assert read_conll(ok)[0]["tokens"] == ["1"]


def test_a_tag_behind_an_ideographic_space_is_named(tmp_path):
    path = write(tmp_path, "cjk.conll", "中\tB-ORG\n国\u3000I-ORG\n")
    assert str(error_of(read_conll, path)) == (
        f"{path}:2: token '国\\u3000I-ORG' has no tag; expected 'token tag' (token first, tag last); the token holds "
        "U+3000 (IDEOGRAPHIC SPACE), which is part of a CoNLL token: separate the columns with a tab or a space"
    )


def test_a_conll_id_of_5000_digits_is_an_id_out_of_range(tmp_path):
    path = write(tmp_path, "train.conll", f"John 1\nRome {'9' * 5000}\n")
    err = error_of(read_ner_file, path, tag_names=["O", "B-PER"])
    assert err.line == 2 and "out of range" in err.message


# ---- JSON lines ---------------------------------------------------------------------------------------------------


def test_json_labels_keep_the_exact_text_of_the_number(tmp_path):
    labels = ["1e30", "10000000000000000001.0", "10000000000000000002.0", "1e400", "1.0", "1", "-0.50", "1E2"]
    path = write(tmp_path, "train.jsonl", "".join(f'{{"text": "t", "label": {v}}}\n' for v in labels))
    assert [ex["label"] for ex in read_table_file(path, ["text", "label"])] == labels
    listed = write(tmp_path, "multi.jsonl", '{"text": "t", "label": [1e30, 2.50, "x"]}\n')
    assert read_table_file(listed, ["text", "label"], list_fields=["label"])[0]["label"] == ["1e30", "2.50", "x"]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_non_standard_constants_are_refused(tmp_path, constant):
    path = write(tmp_path, "train.jsonl", f'{{"text": "a", "label": "x"}}\n{{"text": "b", "label": {constant}}}\n')
    err = error_of(read_table_file, path, ["text", "label"])
    assert err.line == 2 and constant in err.message


def test_duplicate_json_keys_are_refused(tmp_path):
    path = write(tmp_path, "train.jsonl", '{"text": "a", "label": "x", "label": "y"}\n')
    err = error_of(read_table_file, path, ["text", "label"])
    assert err.line == 1 and "'label'" in err.message
    nested = write(tmp_path, "n.jsonl", '{"text": "a", "label": "x", "meta": {"k": 1, "k": 2}}\n')
    assert error_of(read_jsonl, nested, ["text"]).line == 1


def test_json_integers_over_4300_digits_are_text_or_one_line(tmp_path):
    big = "7" * 5000
    path = write(tmp_path, "train.jsonl", f'{{"text": "a", "label": {big}}}\n{{"text": "b", "label": 2}}\n')
    assert [ex["label"] for ex in read_table_file(path, ["text", "label"])] == [big, "2"]
    assert label_list(read_table_file(path, ["text", "label"]), "label") == ["2", big]
    ner = write(tmp_path, "ner.jsonl", json.dumps({"tokens": ["a", "b"], "ner_tags": [0, 1]})[:-2] + f", {big}]}}\n")
    ner.write_text(f'{{"tokens": ["a", "b"], "ner_tags": [0, {big}]}}\n')
    err = error_of(read_ner_file, ner, tag_names=["O", "B-X"])
    assert err.line == 1 and "out of range" in err.message
    # read_jsonl gives Python values: an integer Python cannot convert is one line, not a ValueError
    err = error_of(read_jsonl, path, ["label"])
    assert err.line == 1 and "'label'" in err.message


def test_json_nested_1000_deep_is_one_line(tmp_path):
    path = write(
        tmp_path,
        "train.jsonl",
        '{"text": "a", "label": "x"}\n' + '{"text": "b", "label": ' + "[" * 1000 + "]" * 1000 + "}\n",
    )
    err = error_of(read_table_file, path, ["text", "label"])
    assert err.line == 2 and "deep" in err.message


def test_a_lone_surrogate_escape_is_one_line(tmp_path):
    path = write(
        tmp_path, "train.jsonl", '{"text": "ok \\ud83d\\ude00", "label": "x"}\n{"text": "bad \\ud800", "label": "y"}\n'
    )
    err = error_of(read_table_file, path, ["text", "label"])
    assert err.line == 2 and "'text'" in err.message and "surrogate" in err.message
    ner = write(tmp_path, "ner.jsonl", '{"tokens": ["a\\udfff"], "ner_tags": ["O"]}\n')
    assert error_of(read_ner_file, ner).line == 1


def test_ner_json_tags_with_spaces_around_them_are_the_tags(tmp_path):
    path = write(
        tmp_path, "train.jsonl", json.dumps({"tokens": ["John", "runs"], "ner_tags": [" B-PER ", "O\t"]}) + "\n"
    )
    assert read_ner_file(path)[0]["ner_tags"] == ["B-PER", "O"]


# ---- Labels of any size -------------------------------------------------------------------------------------------


def test_labels_with_huge_exponents_sort_by_value():
    labels = ["1e1000000000000000000", "2", "-1e1000000000000000000", "1e-1000000000000000000", "0"]
    expected = ["-1e1000000000000000000", "0", "1e-1000000000000000000", "2", "1e1000000000000000000"]
    assert label_list([{"label": v} for v in labels], "label") == expected
    with pytest.raises(DataError, match="training spells this value '1e1000000000000000000'"):
        check_labels([{"label": "10e999999999999999999", "line": 3}], "label", expected, "t")
    big = "9" * 5000
    mixed = [big, "n/a", "x" + big, "x2", "x1"]  # digit runs compare as numbers, by length first
    assert label_list([{"label": v} for v in mixed], "label") == [big, "n/a", "x1", "x2", "x" + big]


def test_number_labels_sort_as_decimal_sorts_them():
    # Reference: Decimal, on numbers small enough for it; equal values by their text.
    rng = random.Random(0)
    labels = set()
    for _ in range(400):
        whole = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 4)))
        frac = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 3)))
        text = rng.choice(["", "-", "+"]) + (whole or "0") + ("." + frac if rng.random() < 0.6 else "")
        if rng.random() < 0.3:
            text += rng.choice("eE") + rng.choice(["", "-", "+"]) + str(rng.randint(0, 12))
        labels.add(text)
    expected = sorted(labels, key=lambda v: (Decimal(v), v))
    assert label_list([{"label": v} for v in labels], "label") == expected


# ---- Through the recipes: one line and exit 1, or the run reads what was written ------------------------------------


def last_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


def test_classification_refuses_a_row_with_an_extra_field(tiny_model, tmp_path, monkeypatch, capsys):
    rows = "".join(f"the cat sat,{'ab'[i % 2]}\n" for i in range(10))
    # Read by fields, this row is text 'hello' with a known label ' b' (a 2-class file trained on a wrong row).
    path = write(tmp_path, "train.csv", "text,label\n" + rows + "hello, b,a\n")
    out = tmp_path / "out"
    assert run_in_process("classification", tiny_args(tiny_model, out, "--train_file", str(path)), monkeypatch) == 1
    assert last_line(capsys).startswith(f"{path}:12: ")
    assert not (out / "all_results.json").exists()


def test_classification_refuses_a_lone_surrogate(tiny_model, tmp_path, monkeypatch, capsys):
    rows = "".join(json.dumps({"text": "the cat sat", "label": "ab"[i % 2]}) + "\n" for i in range(10))
    path = write(tmp_path, "train.jsonl", rows + '{"text": "a \\udc00 b", "label": "a"}\n')
    out = tmp_path / "out"
    assert run_in_process("classification", tiny_args(tiny_model, out, "--train_file", str(path)), monkeypatch) == 1
    assert last_line(capsys).startswith(f"{path}:11: field 'text'")


def test_ner_trains_on_json_tags_with_spaces_around_them(tiny_model, tmp_path, monkeypatch):
    rows = [{"tokens": ["john", "works", "at", "acme"], "ner_tags": [" B-PER", "O ", "O", " B-ORG "]}] * 6
    path = write(tmp_path, "train.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    assert run_in_process("ner", tiny_args(tiny_model, out, "--train_file", str(path)), monkeypatch) == 0
    assert json.loads((out / "all_results.json").read_text())["label_list"] == ["B-ORG", "B-PER", "O"]
