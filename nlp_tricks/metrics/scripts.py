"""What the shipped ``evaluate`` metric scripts (``nlp_tricks/metrics/<name>/<name>.py``) share.

``evaluate.load(path)`` imports a script as a module of its own, so a script imports this module by its absolute
name (``nlp_tricks``, installed, is a library to the loader) and keeps its ``evaluate.Metric`` subclass the only
metric class in its namespace: the loader takes the first one it finds.
"""

from __future__ import annotations

import datasets
import evaluate

__all__ = ["SCIKIT_LEARN_CITATION", "shipped_metric"]

SCIKIT_LEARN_CITATION = """
@article{scikit-learn, title={Scikit-learn: Machine Learning in {P}ython}, author={Pedregosa, F. and others},
          journal={Journal of Machine Learning Research}, volume={12}, pages={2825--2830}, year={2011}}
"""


def shipped_metric(description: str, inputs_description: str, citation: str, value, reference_urls: list[str]):
    """A class decorator for a metric script's ``evaluate.Metric``: its docstring and its ``_info``, whose
    ``predictions`` and ``references`` are both ``value`` (a ``datasets`` feature)."""

    def info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=description,
            citation=citation,
            inputs_description=inputs_description,
            features=datasets.Features({"predictions": value, "references": value}),
            reference_urls=list(reference_urls),
        )

    def decorate(cls: type) -> type:
        cls._info = info
        return evaluate.utils.file_utils.add_start_docstrings(description, inputs_description)(cls)

    return decorate
