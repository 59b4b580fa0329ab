"""Readers for the recipes' data: CoNLL, JSON lines, CSV, plain text and the built-in offline demo data.

Every ``read_*`` reader returns a list of plain dicts (one per example), its ``iter_*`` twin yields them one at a
time as it reads the file (:func:`arrow_dataset` writes them to an Arrow file), and both raise :class:`DataError`,
whose message is ``file:line: what is wrong``, on input they cannot use.
"""

from . import readers
from .arrow import arrow_dataset, file_signature
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
    iter_pack_documents,
    iter_text_file,
    pack_documents,
    pack_words,
    read_text_file,
)
from .readers import *  # noqa: F403 (the readers' public names: readers.__all__)
from .readers import kfold_assignment, kfold_examples

# The readers' names, then the rest of the package's.
__all__ = [
    *readers.__all__,
    "kfold_examples",
    "kfold_assignment",
    "arrow_dataset",
    "file_signature",
    "DEMO_PACKAGES",
    "demo_ner",
    "demo_classification",
    "demo_summarization",
    "demo_model_path",
    "read_text_file",
    "iter_text_file",
    "iter_pack_documents",
    "demo_pretraining_texts",
    "pack_words",
    "pack_documents",
    "MaskedLMCollator",
    "demo_causal_lm_path",
]
