"""One trace for several like networks: inside `sharing_traces()`, the first `TracedNetwork` built serves each later
one of a network like it (same class, parameter names, shapes and dtypes, same example shapes and call). Holds only
the bookkeeping; `traced.py` copies the template's traces and binds copies of its stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_parallel.pipeline.call import NetworkCall

if TYPE_CHECKING:
    from lightning_parallel.pipeline.traced import TracedNetwork

_SHARED: ContextVar[list[Any] | None] = ContextVar("lightning_parallel_shared_trace", default=None)


@contextlib.contextmanager
def sharing_traces() -> Iterator[None]:
    """Inside, the first `TracedNetwork` built traces its network, and each later one of a network like it reuses its
    traces, blocks and costs instead of tracing again, binding copies of the traced stages (each network its own):
    the dry run checks and sets up every pipeline rank of one network from one trace (~11 s of CPU per trace of
    Llama-3-8B's shapes). Outside, each `TracedNetwork` traces its own network."""
    token = _SHARED.set([])
    try:
        yield
    finally:
        _SHARED.reset(token)


def template_for(network: nn.Module, inputs: tuple[torch.Tensor, ...], call: NetworkCall) -> TracedNetwork | None:
    """The trace this network may reuse: inside `sharing_traces()`, the first one built, if its network is alike."""
    shared = _SHARED.get()
    if shared and shared[0].signature == signature(network, inputs, call):
        return shared[0]
    return None


def offer(traced: TracedNetwork) -> None:
    """A finished trace: the template for what follows, if it is the first inside `sharing_traces()`."""
    shared = _SHARED.get()
    if shared is not None and not shared:
        shared.append(traced)


def signature(network: nn.Module, inputs: tuple[torch.Tensor, ...], call: NetworkCall) -> tuple:
    """What a trace depends on besides values: the network's class and parameters, and the inputs' shapes."""
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in network.named_parameters(remove_duplicate=False))
    return type(network), params, tuple((tuple(t.shape), t.dtype) for t in inputs), call
