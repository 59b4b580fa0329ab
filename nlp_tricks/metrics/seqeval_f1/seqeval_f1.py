"""Entity-level precision / recall / F1 of IOB tag sequences, with seqeval's semantics (CoNLL-2000 conlleval)."""

import datasets
import evaluate
from seqeval.metrics import accuracy_score, classification_report

_DESCRIPTION = """
Entity-level scores of sequence labelling (NER, chunking) computed by `seqeval`: an entity counts as correct only when
its type and both boundaries match. Tags use the IOB1/IOB2/IOE/IOBES conventions (`B-PER`, `I-PER`, `O`, ...);
in the default (non-strict) mode an `I-` tag after `O` opens an entity, as in the conlleval script.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of tag sequences (list of list of str).
    references: list of tag sequences of the same lengths.
    suffix: tags are `PER-B` rather than `B-PER` (default False).
    zero_division: value when a ratio divides by zero (default 0).
Returns:
    precision, recall, f1: micro averages over entities; accuracy: token accuracy;
    and per entity type a dict `{precision, recall, f1, number}`.
Example:
    >>> metric = evaluate.load("nlp_tricks/metrics/seqeval_f1")
    >>> metric.compute(predictions=[["B-PER", "I-PER", "O"]], references=[["B-PER", "I-PER", "O"]])["f1"]
    1.0
"""

_CITATION = """
@misc{seqeval, title={seqeval: A Python framework for sequence labeling evaluation}, author={Hiroki Nakayama},
      year={2018}, url={https://github.com/chakki-works/seqeval}}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SeqevalF1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("string")),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
            reference_urls=["https://github.com/chakki-works/seqeval"],
        )

    def _compute(self, predictions, references, suffix=False, zero_division=0):
        report = classification_report(
            y_true=references, y_pred=predictions, suffix=suffix, output_dict=True, zero_division=zero_division
        )
        report.pop("macro avg")
        report.pop("weighted avg")
        overall = report.pop("micro avg")
        scores = {
            entity: {
                "precision": values["precision"],
                "recall": values["recall"],
                "f1": values["f1-score"],
                "number": int(values["support"]),
            }
            for entity, values in report.items()
        }
        scores["precision"] = overall["precision"]
        scores["recall"] = overall["recall"]
        scores["f1"] = overall["f1-score"]
        scores["accuracy"] = accuracy_score(y_true=references, y_pred=predictions)
        return scores
