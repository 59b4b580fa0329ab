"""``import nlp_tricks`` registers its pipelines with transformers (:func:`nlp_tricks.pipelines.register`) without
importing transformers itself (the package loads its names on first use): at once if ``transformers.pipelines`` is
imported already, else right after it is, whoever imports it (``from transformers import pipeline`` does).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

_TARGET = "transformers.pipelines"


def _register() -> None:
    pipelines = sys.modules.get("nlp_tricks.pipelines")
    if pipelines is not None and not hasattr(pipelines, "register"):
        return  # nlp_tricks.pipelines is being imported (it imports transformers.pipelines): it registers at its end
    try:
        from .pipelines import register

        register()
    except Exception as err:  # a transformers whose pipelines changed: its own keep working, ours are missing
        warnings.warn(
            f"nlp_tricks could not register its pipelines with transformers ({type(err).__name__}: {err}); "
            "models saved with a CRF, a span head or a pooling load with nlp_tricks.load_crf_model / "
            "load_span_model / load_pooled_model",
            RuntimeWarning,
            stacklevel=2,
        )


class _RegisteringLoader(importlib.abc.Loader):
    """The module's own loader, registering the pipelines once the module has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # resource readers and the like: the module's own loader answers
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.pipelines`` as the other finders do and wraps its loader; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install() -> None:
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
