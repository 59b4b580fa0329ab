"""Readers for the recipes' data: CoNLL, JSON lines, CSV, plain text and the built-in offline demo data.

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
from .pretraining import (
    MaskedLMCollator,
    demo_pretraining_texts,
    pack_documents,
    pack_words,
    read_text_file,
)
from .readers import (
    DataError,
    canonical_label,
    check_labels,
    check_tag_columns,
    kfold_examples,
    label_list,
    looks_like_tag,
    read_conll,
    read_conll_tokens,
    read_csv,
    read_jsonl,
    read_ner_file,
    read_table_file,
    read_text_sentences,
    split_examples,
    subtoken_tags,
)

__all__ = [
    "DataError",
    "read_conll",
    "read_jsonl",
    "read_csv",
    "read_ner_file",
    "read_table_file",
    "read_text_sentences",
    "read_conll_tokens",
    "canonical_label",
    "check_labels",
    "check_tag_columns",
    "label_list",
    "looks_like_tag",
    "subtoken_tags",
    "split_examples",
    "kfold_examples",
    "DEMO_PACKAGES",
    "demo_ner",
    "demo_classification",
    "demo_summarization",
    "demo_model_path",
    "read_text_file",
    "demo_pretraining_texts",
    "pack_words",
    "pack_documents",
    "MaskedLMCollator",
    "demo_causal_lm_path",
]
