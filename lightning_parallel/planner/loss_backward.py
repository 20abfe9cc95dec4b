"""The gradients a loss's backward holds at once before its input's gradient leaves it (e.g. cross-entropy's: the
log-softmax's gradient beside the logits'), found by running that part of the backward on the analysis's fake tensors
and stopping there. It runs no other backward and knows nothing of blocks (``call_analysis.py`` asks it).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightning_parallel.seams import dispatch_mode

_MODE: Any
_MODE, _leaves, _ = dispatch_mode()


class _Reached(Exception):
    """Raised by the hook on the loss's input: its gradient is made, the loss's backward is over."""


class _Live(_MODE):
    """The most bytes of the storages ops make while it is entered, alive at once (each freed with its storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # an in-place op or a view hands back an input's storage: made before, or counted already
        inputs = {id(t.untyped_storage()) for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        made = {id(t.untyped_storage()): t.untyped_storage() for t in _leaves(out) if isinstance(t, torch.Tensor)}
        for key, storage in made.items():
            if key not in inputs:
                self._count(storage)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size


def loss_backward_elements(loss: torch.Tensor, loss_input: torch.Tensor) -> float:
    """Elements (of ``loss_input``'s size each) the backward of ``loss`` holds at most until the gradient of
    ``loss_input`` is made, that gradient included; 0 when ``loss`` does not depend on it through autograd."""
    if loss.grad_fn is None or not loss_input.requires_grad:
        return 0.0

    def reached(_grad: torch.Tensor) -> None:
        raise _Reached

    handle = loss_input.register_hook(reached)
    live = _Live()
    try:
        with live:
            loss.backward()
    except _Reached:
        pass
    finally:
        handle.remove()
    return live.peak / loss_input.element_size()
