"""The peak of live tensor bytes while code runs: a dispatch mode that adds each new storage's bytes when an op makes
it and takes them off when the storage is freed, and follows a storage resized in place (FSDP2 frees and re-gathers a
block's parameters by `untyped_storage().resize_`, which no op dispatch sees). Works on fake tensors (their storages
have sizes and no memory).

Why not torch's MemTracker: it re-sums every tracked storage at each op (and refuses a stage called once per
micro-batch), which at 66B parameters took longer than the whole dry run may. It does not name what the bytes are.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lightning_parallel.seams import dispatch_mode

_MODE: Any  # torch's private TorchDispatchMode, reached through the seams
_MODE, tree_leaves, is_traceable_wrapper_subclass = dispatch_mode()
_WAIT = torch.ops._c10d_functional.wait_tensor.default  # returns its input (a real run's tensor is the same)


class LiveBytes(_MODE):
    """`with LiveBytes(held) as live: ...`; then `live.peak`: the most bytes alive at once, counting the storages of
    `held` (what existed before, e.g. the parameters: known, so an in-place op on one does not count it again) and
    every storage an op made since, until it was freed."""

    def __init__(self, held: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> its token in _sizes
        self._sizes: dict[int, int] = {}
        self._tokens = itertools.count()
        self._resize: Any = None
        self._keep: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a waited output's storage -> its source's
        for tensor in held:
            self._count(tensor)

    def __enter__(self) -> LiveBytes:
        original = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            token = tracker._seen.get(storage)
            if token is not None:
                tracker._add(token, storage.nbytes() - tracker._sizes[token])
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is _WAIT and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self._alias(out, args[0])
            return out
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out

    def _alias(self, out: torch.Tensor, source: torch.Tensor) -> None:
        """`out` holds `source`'s bytes: a collective's wait returns the very tensor it waited on, which a fake tensor
        gives new storage (a functional all-gather's output counted twice while both live). The output keeps the
        source's storage alive, so its bytes go when both have gone, as a real tensor's."""
        self._count(source)
        storage = out.untyped_storage()
        if storage not in self._seen:
            self._seen[storage] = self._seen[source.untyped_storage()]
            self._keep[storage] = source.untyped_storage()

    def _count(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):  # a DTensor: its local shard holds the storage
            names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
            for inner in (getattr(tensor, name) for name in names):
                if isinstance(inner, torch.Tensor):
                    self._count(inner)
            return
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        token = next(self._tokens)
        self._seen[storage] = token
        self._sizes[token] = 0
        self._add(token, storage.nbytes())
        weakref.finalize(storage, self._free, token)

    def _add(self, token: int, size: int) -> None:
        self._sizes[token] += size
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, token: int) -> None:
        self.live -= self._sizes.pop(token)
