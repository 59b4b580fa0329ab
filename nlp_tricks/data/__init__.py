"""Readers for the recipes' data: CoNLL, JSON lines, CSV and the built-in offline demo data.

Every reader returns a list of plain dicts (one per example) and raises :class:`DataError`, whose message is
``file:line: what is wrong``, on input it cannot use.
"""

from .demo import (
    DEMO_PACKAGES,
    demo_causal_lm_path,
    demo_classification,
    demo_model_path,
    demo_ner,
    demo_summarization,
)
from .readers import (
    DataError,
    check_labels,
    kfold_examples,
    label_list,
    read_conll,
    read_csv,
    read_jsonl,
    read_ner_file,
    read_table_file,
    split_examples,
)

__all__ = [
    "DataError",
    "read_conll",
    "read_jsonl",
    "read_csv",
    "read_ner_file",
    "read_table_file",
    "check_labels",
    "label_list",
    "split_examples",
    "kfold_examples",
    "DEMO_PACKAGES",
    "demo_ner",
    "demo_classification",
    "demo_summarization",
    "demo_model_path",
    "demo_causal_lm_path",
]
