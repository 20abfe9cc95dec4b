"""The private parts of torch.distributed that a process group written in Python (gloo_host.py) relies on: a gloo
group built by hand, and the method names torch calls on a Python group, which differ between torch versions.

Like seams.py, each part is reached here once and fails with one line when torch changed it; nothing else here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_parallel.seams import changed

# Every name under which torch may call an op on a Python ProcessGroup, first the one this package implements.
# torch 2.11 calls the second names (its C++ trampoline for Python groups and torch.distributed's own functions);
# torch 2.13 prefers the first ones and falls back to the second in its trampoline, but its Python functions call only
# the first. Functional collectives (DTensor) reach the coalesced all-gather and reduce-scatter through the trampoline.
_Group = TypeVar("_Group", bound=type)

OP_NAMES: dict[str, tuple[str, ...]] = {
    "all_gather_single": ("all_gather_single", "_allgather_base"),
    "all_gather_single_coalesced": ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
    "reduce_scatter_single": ("reduce_scatter_single", "_reduce_scatter_base"),
    "reduce_scatter_single_coalesced": ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
    "all_to_all_single": ("all_to_all_single", "alltoall_base"),
}


def answer_to_every_name(cls: _Group) -> _Group:
    """`cls` (a Python ProcessGroup) answering each op of OP_NAMES under all of its names, and keeping its own name and
    description (torch keeps them in a group's C++ backends, which a Python group need not have; DeviceMesh and
    functional collectives find groups by name): torch.distributed sets and reads them through `_set_group_name` /
    `group_name`, C++ through `setGroupName` / `getGroupName` (a class decorator)."""
    for name, names in OP_NAMES.items():
        for alias in names[1:]:
            setattr(cls, alias, getattr(cls, name))
    for what in ("name", "desc"):
        slot = f"_own_group_{what}"
        read, write = (
            (lambda self, slot=slot: getattr(self, slot, "")),
            (lambda self, v, slot=slot: setattr(self, slot, v)),
        )
        setattr(cls, f"group_{what}", property(read))
        setattr(cls, f"_set_group_{what}", write)
        setattr(cls, f"getGroup{what.capitalize()}", read)
        setattr(cls, f"setGroup{what.capitalize()}", write)
    return cls


def inner_method(group: dist.ProcessGroup, name: str) -> Callable[..., dist.Work]:
    """The bound method of a C++ ProcessGroup (gloo's) for op `name`, under whichever of its names this torch has."""
    for candidate in OP_NAMES.get(name, (name,)):
        method = getattr(group, candidate, None)
        if callable(method):
            return method
    raise changed("torch", f"ProcessGroup.{name}", "stage collectives through host memory (gloo_host)")


def gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> tuple[dist.ProcessGroup, Any]:
    """A ProcessGroup over gloo on the CPU alone, built as torch.distributed builds one (not registered as a group of
    its own: it carries a Python group's ops), and its gloo backend."""
    try:
        group = dist.ProcessGroup(store, rank, size)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    except (AttributeError, TypeError) as error:
        raise changed("torch", "ProcessGroup._register_backend", "build gloo_host's inner gloo group") from error
    return group, gloo


def serve_cpu_by(group: dist.ProcessGroup, gloo: Any) -> None:
    """Give a Python `group` gloo as its CPU backend, which an op torch calls past the Python methods reaches (on a
    CPU tensor; a CUDA one finds no backend and fails)."""
    try:
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    except (AttributeError, TypeError) as error:
        raise changed("torch", "ProcessGroup._register_backend", "serve gloo_host's CPU ops") from error
