"""nlp_tricks.ensemble's rules against the rules written out: the mean of probabilities, the mean over the members
that saw a word, Viterbi and marginals of the mean CRF by enumerating every tag path, entities as seqeval reads them,
entity votes, span scores averaged over the members that scored each span and span votes (nested and flat); and the
fold assignment of nlp_tricks.data.kfold_assignment."""

import itertools
import math
import random

import numpy as np
import pytest

from nlp_tricks.data import kfold_assignment, kfold_examples
from nlp_tricks.ensemble import (
    crf_marginals,
    entity_spans,
    mean_crf,
    mean_probabilities,
    mean_span_scores,
    mean_word_probabilities,
    spans_to_tags,
    tag_scheme,
    viterbi,
    vote_entities,
    vote_spans,
    word_rows,
)
from nlp_tricks.functional.crf import FORBIDDEN


def test_mean_probabilities_is_the_mean_of_the_members():
    rng = np.random.default_rng(0)
    members = [rng.dirichlet(np.ones(4), size=5) for _ in range(3)]
    mean = mean_probabilities(members)
    for i in range(5):
        for j in range(4):
            assert mean[i, j] == pytest.approx((members[0][i, j] + members[1][i, j] + members[2][i, j]) / 3, abs=1e-15)
    with pytest.raises(ValueError, match="differ in shape"):
        mean_probabilities([members[0], members[1][:4]])


def test_word_rows_take_each_words_first_sub_token():
    token_rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    # [CLS] w0 w0 w2 w2 [SEP]: word 1 has no sub-token, word 3 was cut.
    rows = word_rows(token_rows, [None, 0, 0, 2, 2, None], 4)
    assert rows[0].tolist() == [2.0, 3.0] and rows[2].tolist() == [6.0, 7.0]
    assert np.isnan(rows[1]).all() and np.isnan(rows[3]).all()


def test_mean_word_probabilities_average_over_the_members_that_saw_the_word():
    rng = np.random.default_rng(1)
    members = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(3)]
    members[1][2] = np.nan  # member 1 did not see word 2
    members[0][3] = members[1][3] = members[2][3] = np.nan  # nobody saw word 3
    mean = mean_word_probabilities(members)
    for w in range(3):
        saw = [m[w] for m in members if not np.isnan(m[w]).any()]
        expected = sum(np.exp(r) / np.exp(r).sum() for r in saw) / len(saw)
        np.testing.assert_allclose(mean[w], expected, rtol=1e-6)  # float32 logits: softmax to ~1e-7
    assert np.isnan(mean[3]).all()


def _path_score(path, emissions, start, transitions, end):
    score = start[path[0]] + end[path[-1]] + sum(emissions[t, y] for t, y in enumerate(path))
    return score + sum(transitions[a, b] for a, b in zip(path, path[1:]))


def _random_members(rng, words, tags, members=3, constrained=False):
    emissions = [rng.normal(size=(words, tags)) for _ in range(members)]
    potentials = []
    for _ in range(members):
        start, transitions, end = rng.normal(size=tags), rng.normal(size=(tags, tags)), rng.normal(size=tags)
        if constrained:  # as CRF.potentials() gives a constrained CRF: tag 0 never starts, 1 -> 2 forbidden
            start[0], transitions[1, 2] = FORBIDDEN, FORBIDDEN
        potentials.append((start, transitions, end))
    return emissions, potentials


@pytest.mark.parametrize("constrained", [False, True])
def test_viterbi_of_the_mean_crf_is_the_best_path_by_enumeration(constrained):
    rng = np.random.default_rng(2)
    for trial in range(40):
        words, tags = int(rng.integers(1, 5)), 3
        emissions, potentials = _random_members(rng, words, tags, constrained=constrained)
        if words > 1 and trial % 3 == 0:
            emissions[0][words - 1] = np.nan  # member 0 did not see the last word: the mean is over the others
        mean_em, start, transitions, end = mean_crf(emissions, potentials)
        # The rule written out: the mean of the seen emissions, the mean of every member's scores.
        for w in range(words):
            seen = [e[w] for e in emissions if not np.isnan(e[w]).any()]
            np.testing.assert_allclose(mean_em[w], sum(seen) / len(seen))
        np.testing.assert_allclose(start, sum(p[0] for p in potentials) / 3)
        np.testing.assert_allclose(transitions, sum(p[1] for p in potentials) / 3)
        np.testing.assert_allclose(end, sum(p[2] for p in potentials) / 3)
        best = max(
            itertools.product(range(tags), repeat=words),
            key=lambda path: _path_score(path, mean_em, start, transitions, end),
        )
        assert viterbi(mean_em, start, transitions, end) == list(best)


def test_viterbi_skips_words_no_member_saw():
    rng = np.random.default_rng(3)
    emissions, potentials = _random_members(rng, 4, 3, members=2)
    for e in emissions:
        e[1] = np.nan  # a word without a sub-token under every member's tokenizer
    mean_em, start, transitions, end = mean_crf(emissions, potentials)
    seen = mean_em[[0, 2, 3]]
    best = max(itertools.product(range(3), repeat=3), key=lambda p: _path_score(p, seen, start, transitions, end))
    path = viterbi(mean_em, start, transitions, end)
    assert path[1] is None and [path[0], path[2], path[3]] == list(best)


def test_crf_marginals_are_the_path_probabilities_summed():
    rng = np.random.default_rng(4)
    for _ in range(20):
        words, tags = int(rng.integers(1, 5)), 3
        emissions, potentials = _random_members(rng, words, tags)
        mean_em, start, transitions, end = mean_crf(emissions, potentials)
        paths = list(itertools.product(range(tags), repeat=words))
        weights = np.array([math.exp(_path_score(p, mean_em, start, transitions, end)) for p in paths])
        expected = np.zeros((words, tags))
        for path, weight in zip(paths, weights / weights.sum()):
            for t, y in enumerate(path):
                expected[t, y] += weight
        np.testing.assert_allclose(crf_marginals(mean_em, start, transitions, end), expected, rtol=1e-9, atol=1e-12)


TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "E-PER", "S-LOC", "E-LOC", "S-PER"]


def test_entity_spans_are_seqevals_entities():
    from seqeval.metrics.sequence_labeling import get_entities

    rng = random.Random(5)
    for _ in range(500):
        tags = [rng.choice(TAGS) for _ in range(rng.randint(0, 8))]
        assert entity_spans(tags) == get_entities(tags), tags


@pytest.mark.parametrize("scheme", ["BIO", "BIOES", "BILOU", "BMES"])
def test_spans_to_tags_reads_back_as_the_same_entities(scheme):
    spans = [("PER", 0, 0), ("LOC", 1, 3), ("PER", 4, 5), ("LOC", 7, 7)]
    tags = spans_to_tags(spans, 9, scheme)
    if scheme == "BIO":
        assert tags == ["B-PER", "B-LOC", "I-LOC", "I-LOC", "B-PER", "I-PER", "O", "B-LOC", "O"]
    if scheme == "BMES":
        assert tags == ["S-PER", "B-LOC", "M-LOC", "E-LOC", "B-PER", "E-PER", "O", "S-LOC", "O"]
        assert tag_scheme(["O", *tags]) == "BMES"
    if scheme in ("BIO", "BIOES"):  # seqeval's default mode reads BIO and BIOES (not L- / U-, M-)
        from seqeval.metrics.sequence_labeling import get_entities

        assert get_entities(tags) == spans
    assert entity_spans(tags) == spans
    assert tag_scheme(["O", "B-X", "I-X"]) == "BIO" and tag_scheme(["O", "S-X", "B-X", "E-X"]) == "BIOES"


def test_entity_spans_read_a_tag_without_a_prefix_as_inside_an_entity_of_its_type():
    # A model's own labels (PER, LOC): each run of one label is an entity; an empty tag is O.
    assert entity_spans(["PER", "PER", "LOC", "", "O", "PER"]) == [("PER", 0, 1), ("LOC", 2, 2), ("PER", 5, 5)]


def _vote_by_hand(member_tags, threshold):
    """The voting rule written out: count each (type, first, last) over members; keep count / M >= threshold; walk
    the kept ones from the most votes (then earliest, then longest, then type) and take those that overlap nothing
    taken."""
    from seqeval.metrics.sequence_labeling import get_entities

    counts = {}
    for tags in member_tags:
        for span in set(get_entities(list(tags))):
            counts[span] = counts.get(span, 0) + 1
    kept = [s for s, c in counts.items() if c * 1.0 / len(member_tags) >= threshold - 1e-12]
    kept.sort(key=lambda s: (-counts[s], s[1], s[1] - s[2], s[0]))
    taken, chosen = set(), []
    for span in kept:
        words = set(range(span[1], span[2] + 1))
        if not words & taken:
            chosen.append(span)
            taken |= words
    return sorted(chosen, key=lambda s: s[1])


def test_vote_entities_keeps_what_enough_members_predict():
    members = [
        ["B-PER", "I-PER", "O", "B-LOC"],
        ["B-PER", "I-PER", "O", "O"],
        ["B-PER", "O", "O", "B-LOC"],
    ]
    # PER 0-1: 2 of 3; LOC 3-3: 2 of 3; PER 0-0: 1 of 3.
    assert vote_entities(members, 0.5) == ["B-PER", "I-PER", "O", "B-LOC"]
    assert vote_entities(members, 2 / 3) == ["B-PER", "I-PER", "O", "B-LOC"]
    assert vote_entities(members, 1.0) == ["O", "O", "O", "O"]
    assert vote_entities(members, 0.3) == ["B-PER", "I-PER", "O", "B-LOC"]  # PER 0-0 loses the overlap to 0-1
    rng = random.Random(6)
    for _ in range(300):
        length, m = rng.randint(1, 6), rng.randint(1, 5)
        member_tags = [[rng.choice(TAGS[:5]) for _ in range(length)] for _ in range(m)]
        threshold = rng.choice([0.2, 0.34, 0.5, 2 / 3, 1.0])
        voted = vote_entities(member_tags, threshold)
        assert entity_spans(voted) == _vote_by_hand(member_tags, threshold), (member_tags, threshold)


def _member_span_scores(rng, types=2, words=4, unseen=()):
    """One member's (T, W, W) span scores as the ensemble receives them: -inf below the diagonal, NaN on every span
    that starts or ends at a word the member did not see."""
    scores = rng.normal(size=(types, words, words))
    scores[:, np.tril_indices(words, -1)[0], np.tril_indices(words, -1)[1]] = -np.inf
    for w in unseen:
        scores[:, w, :] = np.nan
        scores[:, :, w] = np.nan
    return scores.astype(np.float32)


def test_mean_span_scores_average_over_the_members_that_scored_each_span():
    rng = np.random.default_rng(3)
    # Word 2 seen by all three members, 0 and 1 by two of them, 3 by none.
    members = [_member_span_scores(rng, unseen=u) for u in ([3], [1, 3], [0, 3])]
    mean = mean_span_scores(members)
    for t, i, j in itertools.product(range(2), range(4), range(4)):
        values = [float(m[t, i, j]) for m in members if not math.isnan(m[t, i, j])]
        if 3 in (i, j):
            assert math.isnan(mean[t, i, j])  # no member saw word 3: never predicted
        elif i > j:
            assert mean[t, i, j] == -math.inf
        else:
            assert mean[t, i, j] == pytest.approx(sum(values) / len(values), rel=1e-12)  # summation order only
    # Raw scores, not probabilities: two members a little above 0 and one far below give a negative mean score,
    # where the mean of their sigmoid probabilities would keep the span (2/3 x 0.88 > 0.5).
    one = np.full((1, 1, 1), 2.0, dtype=np.float32)
    assert mean_span_scores([one, one, np.full((1, 1, 1), -10.0, dtype=np.float32)])[0, 0, 0] == -2.0
    assert np.mean([1 / (1 + math.exp(-2.0))] * 2 + [1 / (1 + math.exp(10.0))]) > 0.5
    with pytest.raises(ValueError, match="one shape"):
        mean_span_scores([np.zeros((2, 3, 3)), np.zeros((2, 4, 4))])


def test_an_ensemble_of_one_span_model_decodes_exactly_what_it_does():
    import torch

    from nlp_tricks.functional.spans import decode_spans

    rng = np.random.default_rng(4)
    for _ in range(20):
        scores = _member_span_scores(rng, types=3, words=6)
        own = torch.from_numpy(np.nan_to_num(scores, nan=-np.inf))[None]
        alone = torch.from_numpy(mean_span_scores([scores]))[None]
        for flat in (False, True):
            assert decode_spans(alone, flat=flat) == decode_spans(own, flat=flat)


def test_vote_spans_keeps_what_enough_members_predict_nested_or_flat():
    members = [
        [("ORG", 0, 3), ("LOC", 2, 3), ("PER", 0, 1)],
        [("ORG", 0, 3), ("LOC", 2, 3)],
        [("LOC", 2, 3), ("PER", 0, 1), ("PER", 0, 1)],  # a span repeated by one member counts once
    ]
    # ORG 0-3: 2 of 3; LOC 2-3: 3 of 3; PER 0-1: 2 of 3.
    assert vote_spans(members, 0.5) == [("PER", 0, 1), ("ORG", 0, 3), ("LOC", 2, 3)]  # nested: all kept
    assert vote_spans(members, 1.0) == [("LOC", 2, 3)]
    # Flat: LOC 2-3 (3 votes) first; ORG 0-3 overlaps it; PER 0-1 (2 votes) does not.
    assert vote_spans(members, 0.5, flat=True) == [("PER", 0, 1), ("LOC", 2, 3)]
    # A tie in votes: the earlier span wins, then the longer one, then the type that sorts first.
    assert vote_spans([[("B", 1, 3)], [("A", 0, 2)]], 0.5, flat=True) == [("A", 0, 2)]
    assert vote_spans([[("B", 0, 1)], [("A", 0, 2)]], 0.5, flat=True) == [("A", 0, 2)]
    assert vote_spans([[("B", 0, 2)], [("A", 0, 2)]], 0.5, flat=True) == [("A", 0, 2)]
    with pytest.raises(ValueError, match=r"threshold=0 is not allowed"):
        vote_spans(members, 0)


def test_kfold_assignment_holds_out_every_example_once():
    folds = kfold_assignment(23, 5, seed=7)
    assert sorted(set(folds)) == list(range(5)) and len(folds) == 23
    sizes = [folds.count(k) for k in range(5)]
    assert max(sizes) - min(sizes) <= 1
    # The same folds as kfold_examples' test parts.
    examples = list(range(23))
    for k in range(5):
        assert sorted(kfold_examples(examples, 5, k, seed=7)[2]) == [i for i in range(23) if folds[i] == k]


def test_stratified_kfold_assignment_spreads_each_class():
    labels = ["a"] * 10 + ["b"] * 7 + ["c"] * 3
    folds = kfold_assignment(len(labels), 3, seed=1, stratify=labels)
    for label in "abc":
        per_fold = [sum(1 for f, y in zip(folds, labels) if y == label and f == k) for k in range(3)]
        assert max(per_fold) - min(per_fold) <= 1, (label, per_fold)
    sizes = [folds.count(k) for k in range(3)]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="class 'c' has 3 examples, fewer than the 4 folds"):
        kfold_assignment(len(labels), 4, stratify=labels)
    with pytest.raises(ValueError, match="3 examples for 4 folds"):
        kfold_assignment(3, 4)
