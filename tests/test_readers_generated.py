"""The readers against generated files whose content is known (tests/data_generator.py): every valid file reads to
the records it was built from, every broken one is refused at the line its defect was put on, and nothing ends in
a traceback. A failure names the case (``seed<S>-<i>-<format>-<defect>``): ``generate_cases(S, ...)[i]`` rebuilds
the file."""

from __future__ import annotations

import pytest
from data_generator import Case, check_case, generate_cases

READERS = ("conll", "conll_tokens", "ner", "table", "text", "entities")


def problems_of(cases: list[Case], folder) -> list[str]:
    return [problem for case in cases if (problem := check_case(case, folder)) is not None]


def test_generated_files_read_as_written_or_are_refused_at_their_line(tmp_path):
    cases = generate_cases(seed=0, count=400)
    # The draw covers what it is for: every reader, valid and broken files of each.
    drawn = {(case.reader, case.expected is None) for case in cases}
    assert drawn >= {(reader, broken) for reader in READERS for broken in (False, True)}
    # ... every tag scheme read as entities, a named scheme refused, comment lines above tab-separated sentences read
    # as tokens, CJK text split at ideographic spaces, one-line files too wide to be CoNLL.
    schemes = {case.expected[0]["scheme"] for case in cases if case.reader == "entities" and case.expected}
    assert schemes == {"iob1", "iob2", "bioes", "bmes", "bilou"}
    assert any(case.kwargs.get("tag_scheme") == "iob2" for case in cases)
    tokens_of_tabbed = [c.data for c in cases if c.reader == "conll_tokens" and "tab4" in c.name and c.expected]
    assert any(b"# sent_id = " in data or b"# text = " in data for data in tokens_of_tabbed)
    assert any("\u3000".encode() in c.data for c in cases if c.reader == "text" and c.expected)
    assert any("too_wide" in case.name for case in cases)
    problems = problems_of(cases, tmp_path)
    assert not problems, f"{len(problems)} of {len(cases)} files:\n" + "\n".join(problems[:20])


def test_generated_table_files_go_through_arrow_as_read(tmp_path, monkeypatch):
    # What the recipes do with a file: the reader's records written to an Arrow file (a lone surrogate used to end
    # in a UnicodeEncodeError there) and read back unchanged.
    import datasets
    from datasets import Features, Sequence, Value

    from nlp_tricks.data import arrow_dataset, iter_table_file

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    cases = [case for case in generate_cases(seed=1, count=150) if case.reader == "table" and case.expected]
    assert len(cases) >= 20
    for k, case in enumerate(cases):
        path = tmp_path / f"{case.name}{case.suffix}"
        path.write_bytes(case.data)
        multi = bool(case.kwargs.get("list_fields"))
        label = Value("string")
        if multi and any(isinstance(ex["label"], list) for ex in case.expected):
            if not all(isinstance(ex["label"], list) for ex in case.expected):
                continue  # a column of Arrow holds lists or strings, not both
            label = Sequence(Value("string"))
        features = Features({"text": Value("string"), "label": label, "line": Value("int64")})
        dataset = arrow_dataset(
            lambda path=path, kwargs=case.kwargs: iter_table_file(path, **kwargs), features, [case.name, k]
        )
        assert dataset.to_list() == case.expected, case.name


def test_the_check_fails_on_a_wrong_reading_and_passes_a_hand_written_file(tmp_path):
    # The oracle's own check, on a file written out by hand: CR line ends, a quoted CRLF, a U+2028 in a value.
    data = 'text,label\r"a\r\nb",pos\rc\u2028d,neg\r'.encode()
    right = [{"text": "a\r\nb", "label": "pos", "line": 3}, {"text": "c\u2028d", "label": "neg", "line": 4}]
    kwargs = {"fields": ["text", "label"]}
    assert check_case(Case("hand", ".csv", data, "table", kwargs, right), tmp_path) is None
    wrong = [dict(right[0], line=2), right[1]]
    assert "record 0" in check_case(Case("hand", ".csv", data, "table", kwargs, wrong), tmp_path)
    assert "read a broken file" in check_case(Case("hand", ".csv", data, "table", kwargs, None, 3), tmp_path)
    refused = Case("bad", ".csv", b"text,label\nx,y,z\n", "table", kwargs, None, 2)
    assert check_case(refused, tmp_path) is None
    assert "expected line 3" in check_case(Case("bad", ".csv", refused.data, "table", kwargs, None, 3), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_many_generated_files(tmp_path, seed):
    cases = generate_cases(seed=seed, count=2000)
    problems = problems_of(cases, tmp_path)
    assert not problems, f"{len(problems)} of {len(cases)} files:\n" + "\n".join(problems[:20])
