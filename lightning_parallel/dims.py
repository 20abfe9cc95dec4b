"""ParallelDims: the data x pipeline x tensor sizes of a run, validated against the world size.

Pure arithmetic until `build_mesh`; it never creates a process group, it only names the one that exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend

_AXES = ("dp", "pp", "tp")
_LONG_NAMES = {"dp": "data-parallel size", "pp": "pipeline size", "tp": "tensor-parallel size"}


class PlacementError(ValueError):
    """Ranks placed so that a tensor-parallel group spans nodes; every rank raises the same one (so a caller
    prints it once)."""

    same_on_every_rank = True


def _factors(sizes: dict[str, int]) -> str:
    """`dp(2) * pp(3) * tp(2)`: every factor printed, so a wrong one is visible at a glance."""
    return " * ".join(f"{name}({value})" for name, value in sizes.items())


def _example(world_size: int, sizes: dict[str, int | None]) -> str:
    """A valid choice close to the user's: keep two given sizes and derive the third, else pure data parallel."""
    for derived in _AXES:
        kept = {name: sizes[name] for name in _AXES if name != derived}
        if any(value is None for value in kept.values()):
            continue
        product = math.prod(value for value in kept.values() if value is not None)
        if world_size % product == 0:
            choice = {**kept, derived: world_size // product}
            return ", ".join(f"{name}={choice[name]}" for name in _AXES)
    return f"dp={world_size}, pp=1, tp=1"


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of the three parallel dimensions; ranks are laid out dp outermost, tp innermost.

    Tensor-parallel peers get adjacent ranks because they communicate the most (on a GPU node they share
    the fastest links); pipeline peers come next; data-parallel replicas are furthest apart.

    Args:
        dp: Data-parallel size (number of model replicas).
        pp: Pipeline size (number of pipeline ranks per replica).
        tp: Tensor-parallel size (number of shards per pipeline rank).
    """

    dp: int
    pp: int
    tp: int

    def __post_init__(self) -> None:
        for name in _AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"{name}({value!r}) must be an integer >= 1 (the {_LONG_NAMES[name]}). HINT: use 1 to switch "
                    f"this dimension off."
                )

    @classmethod
    def resolve(
        cls, world_size: int, *, dp: int | None = None, pp: int | None = None, tp: int | None = None
    ) -> ParallelDims:
        """Check the sizes against the world size, deriving at most one that is left as None.

        Args:
            world_size: Total number of processes.
            dp: Data-parallel size, or None to derive it.
            pp: Pipeline size, or None to derive it.
            tp: Tensor-parallel size, or None to derive it.

        Returns:
            The validated sizes, whose product is ``world_size``.

        Raises:
            ValueError: A size is below 1, more than one size is None, or the sizes do not fit the world size.
        """
        if world_size < 1:
            raise ValueError(f"world size {world_size} must be >= 1. HINT: launch at least one process.")
        sizes: dict[str, int | None] = {"dp": dp, "pp": pp, "tp": tp}
        missing = [name for name, value in sizes.items() if value is None]
        given = {name: value for name, value in sizes.items() if value is not None}
        for name, value in given.items():
            if value < 1:
                raise ValueError(
                    f"{name}({value}) must be >= 1 (the {_LONG_NAMES[name]}). HINT: use 1 to switch this "
                    f"dimension off, or None to derive it from world size {world_size}."
                )
        if len(missing) > 1:
            raise ValueError(
                f"only one of dp, pp, tp can be derived from world size {world_size}, but {' and '.join(missing)} "
                f"are None. HINT: set all but one, e.g. {_example(world_size, {**sizes, **dict.fromkeys(missing, 1)})}."
            )
        product = math.prod(given.values())
        if not missing:
            if product != world_size:
                raise ValueError(
                    f"{_factors(given)} = {product} != world size {world_size}. HINT: choose sizes whose product "
                    f"is {world_size}, e.g. {_example(world_size, sizes)}; or leave one of them None to derive it."
                )
            return cls(**given)
        derived = missing[0]
        if world_size % product != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by {_factors(given)} = {product}, so the "
                f"{_LONG_NAMES[derived]} cannot be derived. HINT: choose sizes whose product divides {world_size}, "
                f"e.g. {_shrunk_example(world_size, given, derived)}."
            )
        return cls(**given, **{derived: world_size // product})

    @property
    def world_size(self) -> int:
        """Number of processes these sizes need: ``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Position of a global rank in the mesh, inverse of ``rank = (d * pp + p) * tp + t``.

        Args:
            rank: Global rank in ``[0, world_size)``.

        Returns:
            ``(d, p, t)``: the data-parallel, pipeline and tensor-parallel indices.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} is outside [0, {self.world_size}) for {_factors(self._sizes())}. "
                "HINT: pass a global rank of this run."
            )
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def check_tp_fits_nodes(self, devices_per_node: int) -> None:
        """Before launch: every tensor-parallel group lies on one node. Launchers number ranks node by node and
        tensor-parallel peers are adjacent ranks, so that holds exactly when tp divides the devices per node;
        otherwise the most frequent collectives of every layer would cross the network.

        Raises:
            ValueError: tp does not divide ``devices_per_node`` (one line with the sizes and a layout that fits).
        """
        if devices_per_node % self.tp == 0:
            return
        nodes = self.world_size // devices_per_node
        fits = math.gcd(self.tp, devices_per_node)
        moved = self.tp // fits  # the factor that leaves the node moves to the pipeline (or data-parallel) size
        raise ValueError(
            f"tp({self.tp}) does not divide the {devices_per_node} devices per node ({nodes} nodes x "
            f"{devices_per_node}), so a tensor-parallel group would span nodes. HINT: keep tp inside a node, e.g. "
            f"dp={self.dp * moved}, pp={self.pp}, tp={fits} or dp={self.dp}, pp={self.pp * moved}, tp={fits}; or "
            f"put a multiple of {self.tp} devices on each node"
        )

    def check_tp_placement(self, node_of_rank: Sequence[int]) -> None:
        """After the rendezvous: the node each global rank actually runs on (gathered from every rank) keeps each
        tensor-parallel group on one node. A launcher that deals ranks out round-robin (srun
        --distribution=cyclic) breaks the node-by-node numbering `check_tp_fits_nodes` relies on.

        Raises:
            PlacementError: a group spans nodes (the same line on every rank, which gathered the same list).
        """
        if len(node_of_rank) != self.world_size:
            raise ValueError(
                f"{len(node_of_rank)} node ranks for world size {self.world_size}. HINT: give one per global rank"
            )
        for first in range(0, self.world_size, self.tp):
            group = range(first, first + self.tp)
            nodes = sorted({node_of_rank[rank] for rank in group})
            if len(nodes) > 1:
                where = ", ".join(f"rank {rank} on node {node_of_rank[rank]}" for rank in group)
                raise PlacementError(
                    f"tensor-parallel group of ranks {first}-{first + self.tp - 1} spans nodes {nodes} ({where}): "
                    "the launcher did not number ranks node by node. HINT: launch consecutive ranks on the same node "
                    "(srun --distribution=block, torchrun does so)"
                )

    def build_mesh(self, device_type: str, *, timeout: timedelta | None = None) -> DeviceMesh:
        """Build the 3-D device mesh with dimensions named ``dp``, ``pp``, ``tp`` (sizes of 1 included).

        Args:
            device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl), as understood by ``init_device_mesh``.
            timeout: how long collectives of the mesh's groups may wait; torch would give new groups its
                30-minute default, whatever the default group was created with.

        Returns:
            The mesh; slice it by name, e.g. ``mesh["pp"].get_group()``.

        Raises:
            RuntimeError: No default process group exists yet.
            ValueError: The process group's size differs from ``world_size``.
        """
        # init_device_mesh would otherwise create a process group from environment variables on its own,
        # hiding a strategy that forgot to set one up behind an unrelated rendezvous error.
        if not dist.is_initialized():
            raise RuntimeError(
                "build_mesh needs an initialised default process group, and there is none. "
                "HINT: call torch.distributed.init_process_group first (the strategy's setup does this)."
            )
        actual = dist.get_world_size()
        if actual != self.world_size:
            raise ValueError(
                f"{_factors(self._sizes())} = {self.world_size} != process group size {actual}. "
                f"HINT: resolve the sizes with ParallelDims.resolve({actual}, ...)."
            )
        override: dict[int | str, str | C10dBackend.Options | tuple[str, C10dBackend.Options]] | None = None
        if timeout is not None:
            backend = dist.get_backend()
            if backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
            else:  # Gloo's own options class is private (its public `Options` is the generic base) and not in the stubs
                options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            override = {name: (backend, options) for name in _AXES}
        return init_device_mesh(
            device_type, (self.dp, self.pp, self.tp), mesh_dim_names=_AXES, backend_override=override
        )

    def _sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}


def _shrunk_example(world_size: int, given: dict[str, int], derived: str) -> str:
    """A fix for a divisibility error: shrink one given size to the largest divisor that fits."""
    for name, value in given.items():
        others = math.prod(size for other, size in given.items() if other != name)
        if world_size % others != 0:
            continue
        room = world_size // others
        fitting = max(d for d in range(1, min(value, room) + 1) if room % d == 0)
        choice = {**given, name: fitting}
        shown = ", ".join(f"{axis}={size}" for axis, size in choice.items())
        return f"{shown} ({_LONG_NAMES[derived]} {world_size // math.prod(choice.values())})"
    return f"{', '.join(f'{axis}=1' for axis in given)} ({_LONG_NAMES[derived]} {world_size})"
