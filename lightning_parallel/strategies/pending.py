"""Temporary attribute swaps on a user's module, and the placeholder `self(x)` returns during a
pipelined training step (the real output exists only on the last stage, inside the schedule).

Nothing here runs a pipeline; the strategy decides what the swapped-in callables do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch

MESSAGE = (
    "under PipelineParallelStrategy the network's training output exists only on the last stage, inside "
    "the schedule; pass it straight to the loss method (`loss = self.loss_fn(self(x), y)`) and compute "
    "training metrics in validation_step, where the output is real"
)


class PendingOutput:
    """What the network returns in a pipelined training step: its inputs, recorded for the loss method."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise RuntimeError(f"pipelined networks take positional inputs only; got keywords {sorted(kwargs)}")
        self._args = args

    @classmethod
    def recorder(cls) -> Callable[..., PendingOutput]:
        return lambda *args, **kwargs: cls(args, kwargs)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self._args

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(MESSAGE)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> NoReturn:
        raise RuntimeError(MESSAGE)

    def __getattr__(self, name: str) -> NoReturn:
        raise RuntimeError(f"{MESSAGE} (accessed .{name})")

    __getitem__ = __len__ = __iter__ = __add__ = __mul__ = __sub__ = __truediv__ = __float__ = __bool__ = _refuse


@contextmanager
def swap_attribute(obj: object, name: str, value: Any) -> Iterator[None]:
    """Set `obj.name = value` in the instance dict (shadowing methods and submodules), then undo it."""
    saved = obj.__dict__.get(name, _MISSING)
    obj.__dict__[name] = value
    try:
        yield
    finally:
        if saved is _MISSING:
            del obj.__dict__[name]
        else:
            obj.__dict__[name] = saved


_MISSING = object()
