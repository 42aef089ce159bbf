"""Count the CPU memory a piece of code allocates, on any machine: memory tests without a GPU.

    with LiveBytes() as m:      # or peak_bytes(fn)
        ...                     # every storage an op allocates is counted until torch frees it
    m.peak, m.sizes             # the maximum of live bytes; the size of each allocation

A TorchDispatchMode sees every op's outputs; a storage it has not seen, and that is not one of
the op's inputs (views and in-place results allocate nothing), is new; `weakref.finalize` on
the storage (torch keeps one Python object per storage) tells when it is freed, saved-for-
backward tensors included. Tensors that existed before the mode are not counted.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: list[int] = []
        self._seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if key and key not in self._seen and key not in inputs:
                    self._seen.add(key)
                    self.sizes.append(n)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)
        return out


def peak_bytes(fn) -> int:
    with LiveBytes() as m:
        fn()
    return m.peak
