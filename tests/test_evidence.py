"""Evidence machinery against hand-computed cases: k-fold splits, per-example scores, the paired bootstrap (against
exact enumeration of every resample), and the trivial baselines."""

import itertools

import numpy as np
import pytest
from baselines import TFIDF_C_GRID, build_gazetteer, lead, tag_with_gazetteer, tfidf_lr, tfidf_lr_tuned
from evidence import classification_rows, corpus_metric, ner_rows, paired_bootstrap

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
