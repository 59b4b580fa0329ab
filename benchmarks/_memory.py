"""Peak bytes of the torch tensors a piece of code allocates: every tensor storage an operator creates counts from its
creation until it is freed (a ``TorchDispatchMode`` sees each operator, forward and backward; a finalizer on the
storage sees it go). Tensors that existed before (the weights) do not count. The CPU analogue of
``torch.cuda.max_memory_allocated`` minus what was allocated before, blind to allocator caching and to memory outside
torch tensors, so it is the same from run to run.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storages_are_preserved() -> bool:
    """Whether a tensor's storage is one Python object (the meter needs it: torch keeps it since 2.0)."""
    t = torch.zeros(1)
    return t.untyped_storage() is t.untyped_storage()


class PeakTensorBytes(TorchDispatchMode):
    """``with PeakTensorBytes() as meter: ...`` then ``meter.peak``: the most bytes of new tensor storages alive at
    once inside the block."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: not a new allocation.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self._seen or key in inputs:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out
