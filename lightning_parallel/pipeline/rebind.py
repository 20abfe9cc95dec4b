"""Traced stages bound to a rank's real network: a meta-device copy to trace (never the real weights), and each
traced stage's parameter and buffer slots pointed at the real network's tensors under any of their names (tied
weights have several); tensors the forward creates from Python values given the values a meta trace drops. No
tracing here (`traced.py`), no graph surgery (`chain.py`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn


def meta_copy(network: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers live on the meta device; real storage is never copied.

    ``deepcopy`` returns memo entries as they are, so shared (tied) tensors stay shared in the copy.
    """
    memo: dict[int, object] = {}
    for param in network.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in network.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(network, memo)


def shared_copy(network: nn.Module) -> nn.Module:
    """A deep copy holding the very parameters and buffers of `network` (no storage copied), for a trace that
    needs real values; torch wraps forwards of the copy, not of `network`."""
    memo: dict[int, object] = {id(t): t for t in [*network.parameters(), *network.buffers()]}
    return copy.deepcopy(network, memo)


_CONSTANTS = ("lifted_tensor_", "_tensor_constant")  # torch.export's names for tensors a forward creates


_UNREAD: ContextVar[bool] = ContextVar("lightning_parallel_constants_unread", default=False)


@contextlib.contextmanager
def constants_unread() -> Iterator[None]:
    """Inside, the values of tensors a forward creates from Python values are never read (the dry run computes on
    fake tensors), so a network traced on the meta device takes zeros of their shapes for them (`placeholders`)
    instead of being refused for want of them."""
    token = _UNREAD.set(True)
    try:
        yield
    finally:
        _UNREAD.reset(token)


def placeholders(found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Zeros in the shapes and dtypes of a meta trace's constants inside `constants_unread()`; None outside."""
    if not _UNREAD.get():
        return None
    return {name: torch.zeros(t.shape, dtype=t.dtype, device="cpu") for name, t in found.items()}


def traced_constants(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a trace made constants of (a ``torch.tensor(x)`` or list index inside forward), by their name in
    the traced module: values of the trace, not of the network, so on the meta device when it traced a meta copy."""
    return {name: t for name, t in stage.named_buffers() if name.rpartition(".")[2].startswith(_CONSTANTS)}


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


def _real_name(name: str) -> str:
    """``shared@1.weight`` (a second call of ``shared`` in torch's unflattened graph) -> ``shared.weight``."""
    return ".".join(part.split("@")[0] for part in name.split("."))


def tensor_aliases(network: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter and buffer -> all names of that tensor (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *network.named_parameters(remove_duplicate=False),
        *network.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    return {name: group for group in names.values() for name in group}


def rebind(stage: nn.Module, network: nn.Module, label: str, aliases: dict[str, list[str]]) -> None:
    """Point every parameter and buffer slot of a traced stage at ``network``'s tensor of the same name, or of
    another name of the same tensor: torch's trace names a tied weight by one of its names (``lm_head.weight`` for
    the embedding too), and a rank may hold it only under another (the embedding's, with the head pruned)."""
    for store, named, lookup in (
        ("_parameters", stage.named_parameters, network.get_parameter),
        ("_buffers", stage.named_buffers, network.get_buffer),
    ):
        for name, _ in list(named(remove_duplicate=False)):
            owner, _, leaf = name.rpartition(".")
            if leaf.startswith(_CONSTANTS):
                continue  # the trace's own (`fill_constants`), not the network's
            real = None
            for candidate in dict.fromkeys([_real_name(name), *aliases.get(_real_name(name), [])]):
                with contextlib.suppress(AttributeError):
                    real = lookup(candidate)
                    break
            if real is None:
                raise ValueError(
                    f"{label} reads {store[1:-1]} {_real_name(name)!r}, which the network does not hold. "
                    "HINT: build only the stages whose blocks this rank kept (see prune_children)."
                )
            getattr(stage.get_submodule(owner), store)[leaf] = real


def canonical_names(stage: nn.Module, meta: nn.Module) -> set[str]:
    """The network-level names (first name of each tensor) of the parameters one traced stage reads."""
    canonical = {id(p): name for name, p in meta.named_parameters()}
    return {
        canonical[id(meta.get_parameter(_real_name(name)))]
        for name, _ in stage.named_parameters(remove_duplicate=False)
    }
