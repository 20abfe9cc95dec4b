"""Traced stages bound to a rank's real network: a meta-device copy to trace (never the real weights), and each
traced stage's parameter and buffer slots pointed at the real network's tensors under any of their names (tied
weights have several). No tracing here (`traced.py`), no graph surgery (`chain.py`), no trace's own constants
(`traced_constants.py`).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from lightning_parallel.pipeline.traced_constants import is_constant


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
            if is_constant(leaf):
                continue  # the trace's own (`traced_constants.fill_constants`), not the network's
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
