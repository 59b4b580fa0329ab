"""Span heads' math and data: the multilabel categorical cross-entropy against its formula, rotary positions and
both heads' scores against the formulas written out, decoding against brute force over all spans (and all flat
subsets), tags <-> spans and the span F1 against seqeval, the nested reader's refusals, label rows and the collator."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
from seqeval.metrics import classification_report, f1_score
from seqeval.metrics.sequence_labeling import get_entities
from seqeval.scheme import IOB2

from nlp_tricks.data import DataError
from nlp_tricks.data.spans import (
    WORD,
    SpanCollator,
    first_sub_tokens,
    iter_span_file,
    span_label_rows,
    spans_to_tags,
    tags_to_spans,
)
from nlp_tricks.functional.losses import multilabel_categorical_crossentropy
from nlp_tricks.functional.spans import (
    EfficientGlobalPointer,
    GlobalPointer,
    best_flat_spans,
    decode_spans,
    gather_words,
    rotary,
    span_targets,
    word_positions_of,
)
from nlp_tricks.metrics.spans import span_f1
from tiny import word_tokenizer

# ---- The loss ------------------------------------------------------------------------------------------------------


def _mcce_by_hand(scores, targets, ignore_index=-100):
    """log(1 + sum_neg e^s) + log(1 + sum_pos e^-s) per row, in float64, with plain Python sums."""
    rows = []
    for s_row, t_row in zip(scores.double().reshape(-1, scores.shape[-1]), targets.reshape(-1, targets.shape[-1])):
        neg = sum(torch.exp(s) for s, t in zip(s_row, t_row) if t == 0)
        pos = sum(torch.exp(-s) for s, t in zip(s_row, t_row) if t == 1)
        rows.append(torch.log(1 + torch.as_tensor(neg, dtype=torch.float64)) + torch.log(1 + torch.as_tensor(pos)))
    return torch.stack(rows).reshape(scores.shape[:-1])


def _random_targets(shape, g, p_pos=0.2, p_ignore=0.3):
    u = torch.rand(shape, generator=g)
    return torch.where(u < p_ignore, -100, torch.where(u < p_ignore + p_pos, 1, 0))


def test_loss_equals_the_formula_written_out_with_its_gradient():
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(3, 4, 7, generator=g) * 3).requires_grad_()
    targets = _random_targets((3, 4, 7), g)
    targets[0, 0] = -100  # a row with nothing counted: no item, no loss
    targets[0, 1] = torch.tensor([1, 1, -100, 1, -100, 1, 1])  # only positives
    targets[0, 2] = torch.tensor([0, 0, 0, -100, 0, 0, 0])  # only negatives
    reference = scores.detach().double().requires_grad_()
    by_hand = _mcce_by_hand(reference, targets)
    items = (targets != -100).any(-1)
    loss = multilabel_categorical_crossentropy(scores, targets, reduction="none")
    torch.testing.assert_close(loss.double(), by_hand, rtol=1e-6, atol=1e-6)
    assert loss[0, 0] == 0
    mean = multilabel_categorical_crossentropy(scores, targets)
    torch.testing.assert_close(mean.double(), by_hand.sum() / items.sum(), rtol=1e-6, atol=1e-6)
    total = multilabel_categorical_crossentropy(scores, targets, reduction="sum")
    torch.testing.assert_close(total.double(), by_hand.sum(), rtol=1e-6, atol=1e-6)
    divided = multilabel_categorical_crossentropy(scores, targets, num_items_in_batch=40)
    torch.testing.assert_close(divided.double(), by_hand.sum() / 40, rtol=1e-6, atol=1e-6)
    mean.backward()
    (by_hand.sum() / items.sum()).backward()
    torch.testing.assert_close(scores.grad.double(), reference.grad, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(scores.grad).all() and (scores.grad[targets == -100] == 0).all()


def test_loss_stays_finite_for_large_and_masked_scores():
    scores = torch.tensor([[80.0, -80.0, -math.inf, 3.0]], requires_grad=True)
    targets = torch.tensor([[0, 1, -100, 1]])
    loss = multilabel_categorical_crossentropy(scores, targets)
    # log(1 + e^80) + log(1 + e^80 + e^-3): both ~80 in float32 without overflow.
    torch.testing.assert_close(loss, torch.tensor(160.0), rtol=1e-6, atol=1e-4)
    loss.backward()
    assert torch.isfinite(scores.grad).all()
    with pytest.raises(ValueError, match="targets must be 1, 0 or ignore_index"):
        multilabel_categorical_crossentropy(scores, torch.tensor([[0, 2, 0, 1]]))
    with pytest.raises(ValueError, match="do not match targets"):
        multilabel_categorical_crossentropy(scores, targets[:, :3])


# ---- Rotary positions and the heads' scores -----------------------------------------------------------------------


def _rotary_by_hand(x, positions):
    """Each pair (x[2i], x[2i+1]) as a complex number times e^{i p theta_i}, theta_i = 10000^(-2i/D)."""
    d = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    turned = pairs * torch.polar(torch.ones_like(theta), positions.double()[:, None] * theta)
    return torch.view_as_real(turned).reshape(x.shape)


def test_rotary_is_the_complex_rotation_and_scores_see_only_the_distance():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 8, generator=g)
    torch.testing.assert_close(rotary(x).double(), _rotary_by_hand(x, torch.arange(6)), rtol=1e-5, atol=1e-6)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)
    rq, rk = rotary(q.expand(20, 8)), rotary(k.expand(20, 8))
    # <R(m) q, R(n) k> depends on m - n alone.
    torch.testing.assert_close(rq[3] @ rk[7], rq[12] @ rk[16], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rq[3] @ rk[7], rq[3] @ rk[8])
    with pytest.raises(ValueError, match="even"):
        rotary(torch.randn(3, 5))


def _heads(seed=2, types=3, size=4, hidden=6):
    torch.manual_seed(seed)
    return GlobalPointer(hidden, types, size), EfficientGlobalPointer(hidden, types, size)


def test_global_pointer_scores_equal_the_formula_written_out():
    gp, _ = _heads()
    gp.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    scores = gp.scores(gp(hidden), mask)
    assert scores.dtype == torch.float32 and scores.shape == (2, 3, 5, 5)
    w, b = gp.dense.weight.double(), gp.dense.bias.double()
    for s in range(2):
        for t in range(3):
            proj = hidden[s].double() @ w.T + b  # (5, T * 2D): per type a query then a key
            q = _rotary_by_hand(proj[:, t * 8 : t * 8 + 4], torch.arange(5))
            k = _rotary_by_hand(proj[:, t * 8 + 4 : t * 8 + 8], torch.arange(5))
            for i, j in itertools.product(range(5), range(5)):
                expected = float(q[i] @ k[j]) / 2.0  # sqrt(D) = 2
                if i > j or not (mask[s, i] and mask[s, j]):
                    assert scores[s, t, i, j] == -math.inf
                else:
                    assert scores[s, t, i, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_efficient_global_pointer_scores_equal_the_formula_written_out():
    _, egp = _heads()
    egp.requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 4, 6, generator=g)
    scores = egp.scores(egp(hidden))
    proj = hidden[0].double() @ egp.dense.weight.double().T + egp.dense.bias.double()  # (4, 2D)
    q, k = _rotary_by_hand(proj[:, :4], torch.arange(4)), _rotary_by_hand(proj[:, 4:], torch.arange(4))
    bias = (proj @ egp.type_dense.weight.double().T + egp.type_dense.bias.double()) / 2  # (4, 2T): starts, ends
    for t, i, j in itertools.product(range(3), range(4), range(4)):
        if i > j:
            assert scores[0, t, i, j] == -math.inf
            continue
        expected = float(q[i] @ k[j]) / 2.0 + float(bias[i, t]) + float(bias[j, 3 + t])
        assert scores[0, t, i, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_scores_are_float32_under_bfloat16_autocast():
    gp, egp = _heads()
    hidden = torch.randn(2, 5, 6)
    for head in (gp, egp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            proj = head(hidden)
            scores = head.scores(proj)
        assert proj.dtype == torch.bfloat16 and scores.dtype == torch.float32
        # The same as scoring the bfloat16 projections in float32 outside autocast.
        torch.testing.assert_close(scores, head.scores(proj.float()))


def test_rotary_positions_make_scores_see_the_distance_and_off_they_do_not():
    torch.manual_seed(0)
    x, y, other = torch.randn(3, 6)
    near = torch.stack([other, x, y])[None]  # x at word 1, y at word 2
    far = torch.stack([x, other, y])[None]  # x at word 0, y at word 2
    for rope in (True, False):
        head = GlobalPointer(6, 2, 4, rope=rope)
        s_near, s_far = head.scores(head(near)), head.scores(head(far))
        if rope:
            assert not torch.allclose(s_near[0, :, 1, 2], s_far[0, :, 0, 2])
        else:
            torch.testing.assert_close(s_near[0, :, 1, 2], s_far[0, :, 0, 2])


# ---- Label rows, targets, decoding --------------------------------------------------------------------------------


def _rows(sentences, length=None):
    """Label rows of sentences given as (word positions, [(type, start, end)]), padded with -100 rows."""
    rows = [span_label_rows(positions, spans) for positions, spans in sentences]
    n = max(map(len, rows))
    return torch.tensor([r + [[-100, -100, -100]] * (n - len(r)) for r in rows])


def test_targets_hold_nested_spans_and_one_span_with_two_types():
    # Sentence 0: five words, "Bank of China" (ORG, words 1-3) holding "China" (LOC, word 3), which is also GPE.
    labels = _rows([([1, 2, 4, 5, 6], [(0, 1, 4), (1, 3, 4), (2, 3, 4)]), ([1, 3], [(1, 0, 2)])])
    positions, targets = span_targets(labels, num_types=3)
    assert positions.tolist() == [[1, 2, 4, 5, 6], [1, 3, -1, -1, -1]]
    gold = {tuple(x) for x in (targets == 1).nonzero().tolist()}
    assert gold == {(0, 0, 1, 3), (0, 1, 3, 3), (0, 2, 3, 3), (1, 1, 0, 1)}
    # Counted entries: the spans i <= j of each sentence's words, for every type.
    assert int((targets[0] != -100).sum()) == 3 * 15 and int((targets[1] != -100).sum()) == 3 * 3
    assert (targets[1, :, 2:, :] == -100).all() and (targets[:, :, 1, 0] == -100).all()
    with pytest.raises(ValueError, match="not within 2 words"):
        span_label_rows([1, 3], [(0, 1, 3)])
    bad = torch.tensor([[[WORD, 1, -1], [WORD, 3, -1], [0, 1, 3]]])
    with pytest.raises(ValueError, match="is not a span of its 2 words"):
        span_targets(bad, num_types=3)
    with pytest.raises(ValueError, match="is not a span of its 2 words and 3 types"):
        span_targets(torch.tensor([[[WORD, 1, -1], [WORD, 3, -1], [3, 0, 1]]]), num_types=3)
    with pytest.raises(ValueError, match="integer label rows"):
        word_positions_of(torch.zeros(2, 5, dtype=torch.long))


def test_gather_words_takes_first_sub_tokens():
    projections = torch.arange(2 * 6 * 2, dtype=torch.float32).view(2, 6, 2)
    words = gather_words(projections, torch.tensor([[1, 3, 4], [2, -1, -1]]))
    assert words[0].tolist() == projections[0, [1, 3, 4]].tolist()
    assert words[1, 0].tolist() == projections[1, 2].tolist() and words[1, 1:].abs().sum() == 0


def _random_scores(seed, batch=3, types=2, width=5):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, types, width, width, generator=g)
    lengths = [width, 3, 1][:batch]
    valid = torch.ones(width, width, dtype=torch.bool).triu()
    for b, n in enumerate(lengths):
        keep = valid.clone()
        keep[n:, :] = False
        keep[:, n:] = False
        scores[b] = scores[b].masked_fill(~keep, -math.inf)
    return scores, lengths


@pytest.mark.parametrize("seed", range(4))
def test_nested_decoding_is_every_positive_span(seed):
    scores, lengths = _random_scores(seed)
    expected = [
        sorted(
            ((t, i, j + 1) for t in range(2) for i in range(n) for j in range(i, n) if scores[b, t, i, j] > 0),
            key=lambda s: (s[1], s[2], s[0]),
        )
        for b, n in enumerate(lengths)
    ]
    assert decode_spans(scores) == expected


@pytest.mark.parametrize("seed", range(6))
def test_flat_decoding_is_the_best_non_overlapping_subset(seed):
    scores, lengths = _random_scores(seed, batch=2, width=4)
    flat = decode_spans(scores, flat=True)
    for b, n in enumerate(lengths[:2]):
        positive = [
            (t, i, j + 1, float(scores[b, t, i, j]))
            for t in range(2)
            for i in range(n)
            for j in range(i, n)
            if scores[b, t, i, j] > 0
        ]
        best, best_total = [], 0.0
        for r in range(len(positive) + 1):
            for subset in itertools.combinations(positive, r):
                spans = sorted(subset, key=lambda s: s[1])
                if all(a[2] <= c[1] for a, c in zip(spans, spans[1:])) and sum(s[3] for s in subset) > best_total:
                    best, best_total = spans, sum(s[3] for s in subset)
        assert flat[b] == sorted((s[:3] for s in best), key=lambda s: (s[1], s[2], s[0]))


def test_best_flat_spans_prefers_the_higher_total():
    # One long span (3.0) against two short ones inside it (1.0 + 1.5): the long one; at 1.0 + 2.5 the two.
    assert best_flat_spans([(0, 0, 2, 3.0), (0, 0, 1, 1.0), (1, 1, 2, 1.5)]) == [(0, 0, 2)]
    assert best_flat_spans([(0, 0, 2, 3.0), (0, 0, 1, 1.0), (1, 1, 2, 2.5)]) == [(0, 0, 1), (1, 1, 2)]
    # The same span with two types: the better type.
    assert best_flat_spans([(0, 3, 4, 0.5), (1, 3, 4, 0.7)]) == [(1, 3, 4)]


# ---- Tags <-> spans and the metric against seqeval ----------------------------------------------------------------


def _random_tags(rng, n, prefixes="BIES", types=("PER", "LOC", "ORG")):
    return [rng.choice(["O"] + [f"{p}-{t}" for p in prefixes for t in types]) for _ in range(n)]


def test_tags_to_spans_finds_seqevals_entities_on_any_tags():
    rng = random.Random(0)
    for _ in range(500):
        tags = _random_tags(rng, rng.randint(0, 9))
        assert tags_to_spans(tags) == [(t, s, e + 1) for t, s, e in get_entities(tags)], tags
    assert tags_to_spans(["U-PER", "B-LOC", "L-LOC"]) == [("PER", 0, 1), ("LOC", 1, 3)]  # BILOU
    with pytest.raises(ValueError, match="neither 'O' nor a prefixed tag"):
        tags_to_spans(["B-PER", "PER"])


def test_spans_to_tags_round_trip_and_refusals():
    assert spans_to_tags([("PER", 0, 2), ("LOC", 3, 4)], 5) == ["B-PER", "I-PER", "O", "B-LOC", "O"]
    assert tags_to_spans(spans_to_tags([("PER", 0, 2), ("LOC", 2, 4)], 4)) == [("PER", 0, 2), ("LOC", 2, 4)]
    with pytest.raises(ValueError, match="overlaps"):
        spans_to_tags([("PER", 0, 2), ("LOC", 1, 3)], 4)
    with pytest.raises(ValueError, match="not within"):
        spans_to_tags([("PER", 2, 2)], 4)


def _seqeval_scores(predictions: list[list[str]], references: list[list[str]]) -> dict:
    """seqeval's entity scores (default mode) in span_f1's layout: the micro average's precision / recall / F1 and,
    per type, ``{"precision", "recall", "f1", "number"}``."""
    report = classification_report(references, predictions, output_dict=True, zero_division=0)
    overall = report.pop("micro avg")
    del report["macro avg"], report["weighted avg"]
    scores = {
        kind: {"precision": v["precision"], "recall": v["recall"], "f1": v["f1-score"], "number": int(v["support"])}
        for kind, v in report.items()
    }
    return {**scores, "precision": overall["precision"], "recall": overall["recall"], "f1": overall["f1-score"]}


def test_span_f1_equals_seqeval_on_flat_entities():
    rng = random.Random(1)
    for round_ in range(20):
        # IOB2-valid tags (from spans), so seqeval's default and strict modes agree.
        gold_tags, pred_tags = [], []
        for _ in range(rng.randint(1, 8)):
            n = rng.randint(1, 8)
            for tags in (gold_tags, pred_tags):
                spans, i = [], 0
                while i < n:
                    if rng.random() < 0.4:
                        end = rng.randint(i + 1, n)
                        spans.append((rng.choice(["PER", "LOC", "ORG"]), i, end))
                        i = end
                    else:
                        i += 1
                tags.append(spans_to_tags(spans, n))
        expected = _seqeval_scores(pred_tags, gold_tags)
        ours = span_f1(list(map(tags_to_spans, pred_tags)), list(map(tags_to_spans, gold_tags)))
        for key in ("precision", "recall", "f1"):
            assert ours[key] == expected[key], (round_, key)  # bit for bit
        for kind in {k for k, v in expected.items() if isinstance(v, dict)} | {k for k in ours if k.isupper()}:
            assert ours[kind] == expected[kind], (round_, kind)
        assert ours["f1"] == f1_score(gold_tags, pred_tags, mode="strict", scheme=IOB2)
    # Any tags at all (invalid IOB2 included), against seqeval's default mode, as the tagging recipe scores.
    for _ in range(50):
        lengths = [rng.randint(1, 7) for _ in range(4)]
        gold_tags = [_random_tags(rng, n) for n in lengths]
        pred_tags = [_random_tags(rng, n) for n in lengths]
        expected = _seqeval_scores(pred_tags, gold_tags)
        ours = span_f1(list(map(tags_to_spans, pred_tags)), list(map(tags_to_spans, gold_tags)))
        assert (ours["precision"], ours["recall"], ours["f1"]) == (
            expected["precision"],
            expected["recall"],
            expected["f1"],
        )


def test_span_f1_counts_nested_spans_and_two_types_by_hand():
    gold = [[("ORG", 1, 4), ("LOC", 3, 4), ("GPE", 3, 4)], [("PER", 0, 1)]]
    predicted = [[("ORG", 1, 4), ("LOC", 3, 4), ("LOC", 1, 2)], []]
    scores = span_f1(predicted, gold)
    # 2 right of 3 predicted, 2 of 4 gold.
    assert scores["precision"] == 2 / 3 and scores["recall"] == 2 / 4
    assert scores["f1"] == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
    assert scores["LOC"] == {"precision": 0.5, "recall": 1.0, "f1": pytest.approx(2 / 3), "number": 1}
    assert scores["GPE"]["recall"] == 0.0 and scores["PER"]["number"] == 1 and scores["number"] == 4


# ---- The nested reader --------------------------------------------------------------------------------------------


def _write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_nested_file_reads_spans_with_end_exclusive(tmp_path):
    path = _write(
        tmp_path,
        [
            {
                "tokens": ["Bank", "of", "China"],
                "entities": [
                    {"start": 0, "end": 3, "type": "ORG"},
                    {"start": 2, "end": 3, "type": "LOC"},
                    {"start": 2, "end": 3, "type": "LOC"},
                ],
            },  # fmt: skip
            "",
            {"tokens": ["hi"], "entities": []},
        ],
    )
    examples = list(iter_span_file(path))
    assert examples == [
        {
            "tokens": ["Bank", "of", "China"],
            "entities": [{"type": "ORG", "start": 0, "end": 3}, {"type": "LOC", "start": 2, "end": 3}],
            "line": 1,
        },
        {"tokens": ["hi"], "entities": [], "line": 3},
    ]


@pytest.mark.parametrize(
    "entity, message",
    [
        ({"start": 2, "end": 1, "type": "PER"}, "field 'entities'[1] is inverted: end 1 < start 2"),
        ({"start": 1, "end": 1, "type": "PER"}, "field 'entities'[1] is empty: start = end = 1"),
        ({"start": 1, "end": 4, "type": "PER"}, "field 'entities'[1] (1, 4) is out of range: the sentence has 3"),
        ({"start": -1, "end": 1, "type": "PER"}, "field 'entities'[1] (-1, 1) is out of range"),
        ({"start": 0, "type": "PER"}, "field 'entities'[1] has no field 'end'"),
        ({"start": "0", "end": 1, "type": "PER"}, "field 'entities'[1].start must be an integer word index, got '0'"),
        ({"start": 0, "end": 1.0, "type": "PER"}, "field 'entities'[1].end must be an integer word index, got 1.0"),
        ({"start": True, "end": 1, "type": "PER"}, "field 'entities'[1].start must be an integer"),
        ({"start": 0, "end": 1, "type": ""}, "field 'entities'[1].type must be a non-empty string"),
    ],
)
def test_bad_spans_are_one_line_naming_file_line_and_field(tmp_path, entity, message):
    good = {"tokens": ["a", "b", "c"], "entities": [{"start": 0, "end": 1, "type": "PER"}]}
    bad = {"tokens": ["a", "b", "c"], "entities": [{"start": 0, "end": 1, "type": "PER"}, entity]}
    path = _write(tmp_path, [good, bad])
    with pytest.raises(DataError) as err:
        list(iter_span_file(path))
    assert str(err.value).startswith(f"{path}:2: {message}") and "\n" not in str(err.value)


def test_missing_fields_and_tagged_files(tmp_path):
    path = _write(tmp_path, [{"tokens": ["a"], "entities": []}, {"tokens": ["b"]}])
    with pytest.raises(DataError, match=r":2: record has no field 'entities'"):
        list(iter_span_file(path))
    conll = tmp_path / "train.conll"
    conll.write_text("John B-PER\nSmith I-PER\nworks O\n\nParis S-LOC\n")
    assert [ex["entities"] for ex in iter_span_file(conll)] == [
        [{"type": "PER", "start": 0, "end": 2}],
        [{"type": "LOC", "start": 0, "end": 1}],
    ]
    untyped = tmp_path / "untyped.conll"
    untyped.write_text("John B-PER\n\nMary PER\n")
    with pytest.raises(DataError, match=r"untyped.conll:3: tag 'PER' is neither 'O' nor a prefixed tag"):
        list(iter_span_file(untyped))
    tagged = _write(tmp_path, [{"tokens": ["a", "b"], "ner_tags": ["B-X", "I-X"]}], "tagged.jsonl")
    assert [ex["entities"] for ex in iter_span_file(tagged)] == [[{"type": "X", "start": 0, "end": 2}]]


# ---- Label rows and the collator -----------------------------------------------------------------------------------


def test_label_rows_follow_the_seen_words():
    # Words 0..4; word 1 has no sub-token, words 3-4 are cut: seen words 0, 2.
    rows = span_label_rows([1, 2], [(0, 0, 1), (1, 0, 3), (0, 2, 5), (1, 2, 3)], seen_words=[0, 2])
    assert rows == [[WORD, 1, -1], [WORD, 2, -1], [0, 0, 1], [1, 0, 2], [1, 1, 2]]  # (0, 2, 5) is cut: left out


@pytest.mark.parametrize("side", ["right", "left"])
def test_collator_pads_rows_and_moves_word_positions_with_left_padding(side):
    tokenizer = word_tokenizer()
    tokenizer.padding_side = side
    features = []
    for words, spans in ((["the", "cat", "sat"], [(0, 1, 3)]), (["a"], [])):
        enc = tokenizer(words, is_split_into_words=True)
        first = list(first_sub_tokens(enc.word_ids()).values())
        features.append({**enc, "labels": span_label_rows(first, spans)})
    batch = SpanCollator(tokenizer)(features)
    assert batch["labels"].shape == (2, 4, 3) and batch["input_ids"].shape == (2, 5)
    shift = 2 if side == "left" else 0
    assert batch["labels"][1].tolist() == [[WORD, 1 + shift, -1]] + [[-100] * 3] * 3
    positions = word_positions_of(batch["labels"])
    for b in range(2):
        for p in positions[b][positions[b] >= 0].tolist():
            assert batch["input_ids"][b, p] not in (tokenizer.pad_token_id, tokenizer.cls_token_id)
