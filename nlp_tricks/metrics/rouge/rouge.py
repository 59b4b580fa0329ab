"""ROUGE-1 / ROUGE-2 / ROUGE-L F-measure (Lin 2004) averaged over examples, computed by Google's `rouge_score`."""

import datasets
import evaluate
from rouge_score import rouge_scorer

from nlp_tricks.metrics.scripts import shipped_metric

_DESCRIPTION = """
ROUGE F-measures between generated and reference texts, averaged over the examples: ROUGE-1 / ROUGE-2 (unigram /
bigram overlap) and ROUGE-L (longest common subsequence), and ROUGE-Lsum (LCS over newline-separated sentences).
Tokenisation is `rouge_score`'s default (lower-cased alphanumeric words), optionally Porter-stemmed.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of generated texts.
    references: list of reference texts.
    rouge_types: which scores (default rouge1, rouge2, rougeL, rougeLsum).
    use_stemmer: Porter-stem words before matching (default True).
Returns:
    one mean F-measure in [0, 1] per rouge type.
Example:
    >>> metric = evaluate.load("nlp_tricks/metrics/rouge")
    >>> metric.compute(predictions=["the cat sat"], references=["the cat sat"])["rouge1"]
    1.0
"""

_CITATION = """
@inproceedings{lin-2004-rouge, title={ROUGE: A Package for Automatic Evaluation of Summaries}, author={Lin, Chin-Yew},
               booktitle={Text Summarization Branches Out}, year={2004}, pages={74--81}}
"""


@shipped_metric(
    _DESCRIPTION,
    _KWARGS_DESCRIPTION,
    _CITATION,
    datasets.Value("string"),
    ["https://aclanthology.org/W04-1013", "https://pypi.org/project/rouge-score/"],
)
class Rouge(evaluate.Metric):
    def _compute(self, predictions, references, rouge_types=None, use_stemmer=True):
        rouge_types = list(rouge_types or ["rouge1", "rouge2", "rougeL", "rougeLsum"])
        scorer = rouge_scorer.RougeScorer(rouge_types=rouge_types, use_stemmer=use_stemmer)
        totals = dict.fromkeys(rouge_types, 0.0)
        for prediction, reference in zip(predictions, references):
            scores = scorer.score(reference, prediction)
            for key in rouge_types:
                totals[key] += scores[key].fmeasure
        n = max(len(predictions), 1)
        return {key: total / n for key, total in totals.items()}
