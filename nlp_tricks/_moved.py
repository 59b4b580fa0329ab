"""Old import paths of modules that moved keep working: ``import nlp_tricks.losses`` gives
``nlp_tricks.functional.losses`` itself (the same module object, so patching either patches both).

The tricks' math moved into :mod:`nlp_tricks.functional`, what runs around them into :mod:`nlp_tricks.runtime`.
Importing an old name warns once per process (``DeprecationWarning``), naming the new one; ``nlp_tricks.losses`` is
the documented public name of the losses and does not warn.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# old module name -> where it lives now
MOVED = {
    "nlp_tricks.losses": "nlp_tricks.functional.losses",
    "nlp_tricks.adversarial": "nlp_tricks.functional.adversarial",
    "nlp_tricks.sam": "nlp_tricks.functional.sam",
    "nlp_tricks.smart": "nlp_tricks.functional.smart",
    "nlp_tricks.crf": "nlp_tricks.functional.crf",
    "nlp_tricks.pooling": "nlp_tricks.functional.pooling",
    "nlp_tricks.heads": "nlp_tricks.functional.multi_sample_dropout",
    "nlp_tricks.layers": "nlp_tricks.functional.layers",
    "nlp_tricks.scheduled_sampling": "nlp_tricks.functional.scheduled_sampling",
    "nlp_tricks.neftune": "nlp_tricks.functional.neftune",
    "nlp_tricks.outputs": "nlp_tricks.functional.outputs",
    "nlp_tricks.averaging": "nlp_tricks.runtime.averaging",
    "nlp_tricks.checkpoint": "nlp_tricks.runtime.checkpoint",
    "nlp_tricks.resume": "nlp_tricks.runtime.resume",
    "nlp_tricks.preemption": "nlp_tricks.runtime.preemption",
    "nlp_tricks.param_groups": "nlp_tricks.runtime.param_groups",
    "nlp_tricks._upstream": "nlp_tricks.runtime.upstream",
    "nlp_tricks.seq2seq.tying": "nlp_tricks.functional.tying",
}

# Old names that stay public: documented, imported by users' code, never warned about.
PUBLIC = frozenset({"nlp_tricks.losses"})

_warned = False


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name as the module it moved to."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        global _warned
        if spec.name not in PUBLIC and not _warned:
            _warned = True
            warnings.warn(
                f"{spec.name} moved to {MOVED[spec.name]}; the old name keeps working, import the new one",
                DeprecationWarning,
                stacklevel=2,
            )
        module = importlib.import_module(MOVED[spec.name])
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system set the old name's spec on the module: it keeps its own (reload, pickling, inspection).
        module.__spec__ = self._own_spec


def install() -> None:
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
