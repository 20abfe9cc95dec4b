"""Tensors a traced forward creates from Python values (GPT-Neo's `torch.tensor(finfo.min)`, Falcon's list index):
which ones a trace made constants, their values (a trace of the meta copy keeps none), and a stage traced on the meta
device given them. No tracing here (`traced.py` traces), no binding of the network's tensors (`rebind.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch import nn

_CONSTANTS = ("lifted_tensor_", "_tensor_constant")  # torch.export's names for tensors a forward creates
_UNREAD: ContextVar[bool] = ContextVar("lightning_parallel_constants_unread", default=False)


def is_constant(name: str) -> bool:
    """Whether a traced module's buffer `name` is the trace's own constant, not one of the network's tensors."""
    return name.rpartition(".")[2].startswith(_CONSTANTS)


@contextlib.contextmanager
def constants_unread() -> Iterator[None]:
    """Inside, the values of tensors a forward creates from Python values are never read (the dry run computes on
    fake tensors), so a network traced on the meta device takes zeros of their shapes for them instead of being
    refused for want of them."""
    token = _UNREAD.set(True)
    try:
        yield
    finally:
        _UNREAD.reset(token)


def traced_constants(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a trace made constants of (a ``torch.tensor(x)`` or list index inside forward), by their name in
    the traced module: values of the trace, not of the network, so on the meta device when it traced a meta copy."""
    return {name: t for name, t in stage.named_buffers() if is_constant(name)}


def constant_values(
    network: nn.Module, found: dict[str, torch.Tensor], label: str, trace_real: Callable[[], nn.Module]
) -> dict[str, torch.Tensor]:
    """The values of the constants `found` in a trace of `network`'s meta copy: from `trace_real()`, one more trace,
    of the real network (still whole, storage shared, nothing computed: export runs on fake tensors); zeros of their
    shapes inside `constants_unread()`. A network on the meta device has none to give: one ValueError line."""
    if not any(t.is_meta for t in found.values()):
        return dict(found)
    if any(t.is_meta for t in [*network.parameters(), *network.buffers()]):
        if _UNREAD.get():  # the dry run's: no value is ever read
            return {name: torch.zeros(t.shape, dtype=t.dtype, device="cpu") for name, t in found.items()}
        raise ValueError(
            f"pipeline tracing: {label}.forward creates tensors from Python values ({', '.join(found)}), "
            "whose values a trace of a network on the meta device does not keep. HINT: build the model on the "
            "CPU (not under trainer.init_module() or torch.device('meta'))"
        )
    return {name: t.detach().clone() for name, t in traced_constants(trace_real()).items()}


def fill_constants(stage: nn.Module, values: dict[str, torch.Tensor], device: torch.device, label: str) -> None:
    """Give a stage traced on the meta device the real values of its constants (`values`: from a trace of the real
    network, by the same names), on `device`."""
    for name, meta in traced_constants(stage).items():
        real = values.get(name)
        if real is None or real.shape != meta.shape or real.dtype != meta.dtype:
            raise ValueError(
                f"{label}: the tensor {name!r} its forward creates from Python values has no value known for a "
                f"{tuple(meta.shape)} {meta.dtype} tensor here (this micro-batch shape or mode creates other ones). "
                "HINT: create it in __init__ as a registered buffer instead, or train in one shape and mode"
            )
        owner, _, leaf = name.rpartition(".")
        stage.get_submodule(owner)._buffers[leaf] = real.to(device)
