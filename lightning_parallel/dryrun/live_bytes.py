"""The peak of live tensor bytes while code runs: a dispatch mode that adds each new storage's bytes when an op makes
it and takes them off when the storage is freed. Works on fake tensors (their storages have sizes and no memory).

Why not torch's MemTracker: it re-sums every tracked storage at each op (and refuses a stage called once per
micro-batch), which at 66B parameters took longer than the whole dry run may. It does not name what the bytes are.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes(baseline) as live: ...`; then `live.peak`: the most bytes alive at once, counting `baseline`
    (what existed before, e.g. the parameters) and every storage an op made since, until it was freed."""

    def __init__(self, baseline: int = 0) -> None:
        super().__init__()
        self.live = self.peak = baseline
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):  # a DTensor: its local shard holds the storage
            names, _ = tensor.__tensor_flatten__()
            for inner in (getattr(tensor, name) for name in names):
                if isinstance(inner, torch.Tensor):
                    self._count(inner)
            return
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size
