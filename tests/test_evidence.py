"""Evidence machinery against hand-computed cases: k-fold splits, per-example scores, the paired bootstrap (against
exact enumeration of every resample), the interval over seeds and examples (against Student's paired t-interval and
the bootstrap's closed form, and on synthetic ablations whose answer is known), and the trivial baselines."""

import itertools

import numpy as np
import pytest
from baselines import TFIDF_C_GRID, build_gazetteer, lead, tag_with_gazetteer, tfidf_lr, tfidf_lr_tuned
from evidence import (
    classification_rows,
    corpus_metric,
    expected_difference,
    interval_rates,
    ner_rows,
    paired_bootstrap,
    seed_example_interval,
)
from scipy import stats

from nlp_tricks.data import kfold_examples


def test_kfold_examples_test_each_example_once_and_never_validate_on_it():
    examples = list(range(23))
    seen = []
    for fold in range(5):
        train, validation, test = kfold_examples(examples, 5, fold, seed=7)
        assert not set(test) & (set(train) | set(validation))
        assert sorted(train + validation + test) == examples
        assert len(validation) == round(0.1 * (len(train) + len(validation)))
        seen += test
    assert sorted(seen) == examples
    assert kfold_examples(examples, 5, 2, seed=7) == kfold_examples(examples, 5, 2, seed=7)  # the same folds again
    with pytest.raises(ValueError, match="fold=5"):
        kfold_examples(examples, 5, 5)


def test_ner_rows_count_entities_like_seqeval(tmp_path):
    path = tmp_path / "p.txt"
    # Gold: PER(John), LOC(New York); predicted: PER(John), LOC(New) -> 1 right of 2 predicted, 2 gold.
    path.write_text("John\tB-PER\tB-PER\nin\tO\tO\nNew\tB-LOC\tB-LOC\nYork\tI-LOC\tO\n\nhi\tO\tB-ORG\n")
    rows = ner_rows(path)
    assert rows.tolist() == [[1, 2, 2, 3, 4], [0, 1, 0, 0, 1]]
    assert corpus_metric("ner", "f1", rows) == pytest.approx(2 * 1 / (3 + 2))


def test_classification_rows_macro_f1_by_hand(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("label,predicted,text\na,a,x\na,b,y\nb,b,z\n")
    rows, labels = classification_rows(path)
    assert labels == ["a", "b"]
    assert corpus_metric("classification", "accuracy", rows) == pytest.approx(2 / 3)
    # F1(a) = 2*1/(1+2) = 2/3; F1(b) = 2*1/(2+1) = 2/3; macro 2/3.
    assert corpus_metric("classification", "f1", rows) == pytest.approx(2 / 3)


def test_paired_bootstrap_matches_exact_enumeration():
    # Accuracy rows of 3 texts: system A right on text 0, system B right on texts 0 and 1.
    rows_a = np.array([[1.0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    rows_b = np.array([[1.0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    # Every one of the 3^3 equally likely draws: the difference is (draws of text 1) / 3.
    exact = sorted(sum(i == 1 for i in draw) / 3 for draw in itertools.product(range(3), repeat=3))
    low_exact, high_exact = np.percentile(exact, [2.5, 97.5], method="inverted_cdf")  # the exact quantiles
    diff, low, high = paired_bootstrap("classification", "accuracy", rows_a, rows_b, resamples=20000, seed=1)
    assert diff == pytest.approx(1 / 3)
    assert (low, high) == (pytest.approx(low_exact), pytest.approx(high_exact))  # 0 and 1 (P = 8/27, 1/27)
    # Identical systems: a zero difference and a zero-width interval.
    assert paired_bootstrap("classification", "accuracy", rows_a, rows_a, resamples=100) == (0.0, 0.0, 0.0)


def _constant_runs(values) -> list[np.ndarray]:
    """Summarization rows (ROUGE-1/2/L per document) of runs that score ``value`` on each of 50 documents."""
    return [np.full((50, 3), value) for value in values]


def test_seed_example_interval_is_the_paired_t_interval_when_examples_cannot_matter():
    """Every document of a run scores the same, so no resample of the documents moves a difference: the interval is
    Student's paired t-interval over the seeds, as scipy computes it."""
    a = [0.30, 0.34, 0.31, 0.36]
    b = [0.35, 0.36, 0.37, 0.37]
    diff, low, high = seed_example_interval("summarization", "rougeL", _constant_runs(a), _constant_runs(b))
    reference = stats.ttest_rel(b, a).confidence_interval(0.95)
    assert diff == pytest.approx(np.mean(np.subtract(b, a)))
    assert (low, high) == (pytest.approx(reference.low), pytest.approx(reference.high))


def test_seed_example_interval_is_the_example_bootstrap_when_seeds_cannot_matter():
    """Every seed gives the same predictions, so only the examples drawn vary: the interval is the paired bootstrap's
    variance, which for a mean of per-example differences d_i is var(d) / n exactly, times Student's t at the
    S - 1 = 2 degrees of freedom the example part is given."""
    rng = np.random.default_rng(0)
    a, b = rng.uniform(size=(400, 3)), rng.uniform(size=(400, 3)) + 0.05
    diff, low, high = seed_example_interval("summarization", "rougeL", [a] * 3, [b] * 3, resamples=20000)
    d = b[:, 2] - a[:, 2]
    half = stats.t.ppf(0.975, 2) * (d.var() / len(d)) ** 0.5
    assert diff == pytest.approx(d.mean())
    # 20,000 resamples estimate the bootstrap's standard deviation within about 1 / sqrt(2 * 20000) = 0.5%.
    assert high - diff == pytest.approx(half, rel=0.02) and diff - low == pytest.approx(half, rel=0.02)
    with pytest.raises(ValueError, match="differ in number"):
        seed_example_interval("summarization", "rougeL", [a] * 3, [b] * 2)


def test_seed_noise_is_not_called_significant():
    """Synthetic ablations (1,000 examples, 3 seeds a system) where the two systems do not differ but each seed
    shifts a whole run (as the classification yardstick shows real seeds do): the interval over seeds and examples
    excludes zero in about 5% of them, the example-only interval in far more; a real effect is found."""
    null = interval_rates(300, 300, rng_seed=1, methods=("examples only", "seeds and examples"), seed_sd=0.1, seeds=3)
    # 300 simulations: a true rate of 5% is observed in [2.7%, 7.7%] 95% of the time; 12% leaves room.
    assert null["seeds and examples"]["significant"] <= 0.12
    assert null["examples only"]["significant"] > 0.30
    effect = dict(seed_sd=0.1, seeds=3, effect=0.6)
    assert expected_difference(**effect) == pytest.approx(0.0796, abs=5e-4)  # the accuracy difference to find
    found = interval_rates(200, 300, rng_seed=2, methods=("seeds and examples",), **effect)
    assert found["seeds and examples"]["significant"] >= 0.8
    assert found["seeds and examples"]["misses the truth"] <= 0.12


def test_gazetteer_longest_exact_match_by_hand():
    train = [
        {"tokens": ["New", "York", "is", "big"], "ner_tags": ["B-LOC", "I-LOC", "O", "O"]},
        {"tokens": ["New", "York", "Times"], "ner_tags": ["B-ORG", "I-ORG", "I-ORG"]},
        {"tokens": ["York", "rocks"], "ner_tags": ["B-LOC", "O"]},
        {"tokens": ["Paris"], "ner_tags": ["B-LOC"]},
        {"tokens": ["Paris"], "ner_tags": ["B-PER"]},
        {"tokens": ["Paris"], "ner_tags": ["B-PER"]},
    ]
    gazetteer = build_gazetteer(train)
    assert gazetteer[("Paris",)] == "PER"  # the most frequent type
    tags = tag_with_gazetteer(["the", "New", "York", "Times", "and", "New", "York", ",", "york", "Paris"], gazetteer)
    assert tags == ["O", "B-ORG", "I-ORG", "I-ORG", "O", "B-LOC", "I-LOC", "O", "O", "B-PER"]
    assert tag_with_gazetteer(["york"], build_gazetteer(train, lowercase=True), lowercase=True) == ["B-LOC"]


def test_lead_k_sentences():
    assert lead("One. Two! Three? Four.", 3) == "One. Two! Three?"
    assert lead("No end", 3) == "No end"


def test_tfidf_lr_tunes_c_on_validation_only():
    """Few, unbalanced training texts: at C = 1 the regularised model predicts the majority class everywhere; the
    tuned baseline takes the grid's C with the best validation accuracy (the smallest on a tie), as written out here
    with scikit-learn, and never looks at the test texts."""
    words = {"sport": "goal match striker", "tech": "chip software phone", "politics": "vote minister election"}
    train = [{"text": f"{words['sport']} team {i}", "label": "sport"} for i in range(6)]
    train += [{"text": words[label], "label": label} for label in ("tech", "politics")]
    validation = [{"text": f"the {words[label]}", "label": label} for label in words]
    texts = [ex["text"] for ex in validation]
    gold = [ex["label"] for ex in validation]
    assert list(tfidf_lr(train, C=1.0).predict(texts)) == ["sport"] * 3  # the default underfits

    accuracies = {C: np.mean(tfidf_lr(train, C=C).predict(texts) == np.array(gold)) for C in TFIDF_C_GRID}
    expected = min(C for C in TFIDF_C_GRID if accuracies[C] == max(accuracies.values()))
    model, chosen = tfidf_lr_tuned(train, validation)
    assert chosen == expected and chosen > 1.0 and accuracies[chosen] == 1.0
    assert list(model.predict(texts)) == gold
    assert tfidf_lr_tuned(train, [])[1] == 1.0  # no validation data: the default
