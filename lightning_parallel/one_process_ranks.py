"""Many ranks played in one process, through torch's private machinery (each part checked, failing in one line
through `seams.changed`): the fake process group and fake tensors for the dry run (one rank at a time, no values),
and `LocalTensorMode` for checking the arithmetic of many ranks at once (real values). Nothing here launches.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_parallel.seams import changed


@contextlib.contextmanager
def simulated_ranks(world_size: int) -> Iterator[Any]:
    """One process computing as `world_size` ranks at once (torch's `LocalTensorMode`, private since about torch
    2.10): every tensor made inside holds each rank's value, and collectives run across them for real, over torch's
    fake process group (opened here when none is). Yields the mode (`mode.rank_map(lambda rank: ...)` gives each
    rank its own value). For tests of the arithmetic at degrees no small machine can launch; it has no FSDP2 and
    no point-to-point without a runner, so pipeline stages are chained by the caller.

    Each rank draws random numbers as one process would: the mode keeps a generator state per rank that only
    `torch.manual_seed` reaches, so a name-keyed initialisation (`weights.init_by_name`, which forks the global
    generator and seeds it) would otherwise give every rank values that no single process gives; the per-rank
    states are dropped, so the global generator serves every rank alike.
    """
    import torch.distributed as dist

    why = "check the arithmetic of many ranks in one process"
    try:
        from torch.distributed._local_tensor import LocalTensorMode
    except ImportError as error:
        raise changed("torch", "torch.distributed._local_tensor.LocalTensorMode", why) from error
    mode = LocalTensorMode(world_size)
    if not isinstance(getattr(mode, "_per_rank_rng_states", None), dict) or not callable(getattr(mode, "rank_map", 0)):
        raise changed("torch", "LocalTensorMode._per_rank_rng_states / rank_map", why)
    opened = not dist.is_initialized()
    if opened:
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    elif dist.get_world_size() != world_size:
        raise ValueError(f"simulated_ranks({world_size}) inside a process group of {dist.get_world_size()} ranks")
    try:
        with mode:
            mode._per_rank_rng_states.clear()
            yield mode
    finally:
        if opened:
            dist.destroy_process_group()


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank `rank` of `world_size` on torch's fake process group (collectives return at once and
    move nothing; `torch.testing._internal.distributed.fake_pg`, private): for the dry run, one role at a time."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as error:  # pragma: no cover - present from torch 2.1 to 2.15 at least
        raise changed("torch", "torch.testing._internal.distributed.fake_pg.FakeStore", "run a dry run") from error
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        _forget_sharding_cache()


def _forget_sharding_cache() -> None:
    """DTensor caches each op's output sharding (in Python and in C++) by its inputs' specs, whose meshes compare
    equal across process groups: after one role's group is gone, the next role's ops would get outputs on the old
    mesh (torch 2.13: "Could not resolve the process group registered under the name 9"). Cleared when a fake rank
    ends, with `torch.distributed.tensor.debug._clear_sharding_prop_cache` (private)."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if not callable(clear):
        raise changed("torch", "torch.distributed.tensor.debug._clear_sharding_prop_cache", "dry-run several ranks")
    clear()


@contextlib.contextmanager
def fake_tensors() -> Iterator[Any]:
    """torch's FakeTensorMode (tensors with shapes and devices and no storage), with device meshes built outside it:
    `DeviceMesh.__init__` finds this rank's coordinates with `nonzero` on its rank table, which a fake tensor cannot
    answer (torch 2.13: FSDP2 builds a dp x tp mesh inside `fully_shard`). Yields the mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__
    if not callable(original) or not callable(unset_fake_temporarily):
        raise changed("torch", "DeviceMesh.__init__ / unset_fake_temporarily", "build meshes during a dry run")

    def build_outside(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = build_outside  # type: ignore[method-assign]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, _strided_offsets_outside(unset_fake_temporarily):
            yield mode
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _strided_offsets_outside(unset_fake: Callable[[], Any]) -> Iterator[None]:
    """A `_StridedShard`'s local size and offsets computed on real tensors: torch 2.13 finds them with
    `torch.arange(size)...tolist()`, which a fake tensor cannot answer (DataDependentOutputException,
    aten._local_scalar_dense), when it gathers a strided shard (a head-sharded (B, H, T, T) attention viewed as
    (B*H, T, T) for a matmul's backward; GPT-2's fused q/k/v split). Index arithmetic on the sizes only, no data.
    A torch without the method computes them elsewhere: nothing to wrap."""
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _StridedShard.__dict__.get("local_shard_size_and_offset")
    if not isinstance(original, types.FunctionType):  # a method of the placement, as in 2.13
        yield
        return

    def outside(self: Any, *args: Any, **kwargs: Any) -> Any:
        with unset_fake():
            return original(self, *args, **kwargs)

    _StridedShard.local_shard_size_and_offset = outside  # type: ignore[method-assign]
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original  # type: ignore[method-assign]


@contextlib.contextmanager
def outside_fake_tensors() -> Iterator[None]:
    """Inside `fake_tensors()`, a stretch where tensors are made for real again (torch's `unset_fake_temporarily`):
    for copying and tracing modules that hold meta tensors, whose copies the fake mode would turn into fake ones
    (`Tensor.__deepcopy__` then refuses: the clone's type is not the original's)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard without `to_local()`'s autograd function (`DTensor._local_tensor`, private), which
    costs a dispatch per parameter under FakeTensorMode; any other tensor as it is."""
    local = getattr(tensor, "_local_tensor", None)
    if hasattr(tensor, "to_local") and not isinstance(local, torch.Tensor):
        raise changed("torch", "DTensor._local_tensor", "count the bytes of a shard")
    return local if isinstance(local, torch.Tensor) else tensor


def per_rank(func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` run once per simulated rank under `simulated_ranks` (its rank-dependent ints, e.g. a shard's first row,
    become plain ints; torch's `maybe_run_for_local_tensor`, private), and as it is anywhere else."""
    try:
        from torch.distributed._local_tensor import maybe_run_for_local_tensor
    except ImportError:  # no LocalTensorMode in this torch either: nothing to simulate
        return func
    return maybe_run_for_local_tensor(func)
