"""What a pipeline rank does to its own stages beyond pipelining them: tensor parallelism inside them ("3D") and
FSDP2 across data-parallel replicas. Plain functions over the network and mesh groups; the strategy decides when.
An nn.Sequential's blocks are sharded with torch's styles; a traced network's planned modules hold DTensor shards
that its traced stages compute on (`tensor/traced_stages.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_parallel.pipeline.runtime import StageFactory
from lightning_parallel.pipeline.tied import TiedGroup
from lightning_parallel.replicas import broadcast_module
from lightning_parallel.seams import refuse_older_torch
from lightning_parallel.strategies.tensor import resolve_plan
from lightning_parallel.tensor.plans import apply_plan, retie, sharding_first, tied_groups
from lightning_parallel.tensor.traced_stages import distribute_planned, parameter_placements, run_on_mesh
from lightning_parallel.weights import materialize_in_parts


def resolve_stage_plan(
    network: nn.Module, plan: Mapping[str, str] | str | None, tensor_parallel_size: int
) -> tuple[str, dict[str, str], dict[str, str]]:
    """(source, exact-name plan, why modules stay whole), resolved on the whole network before it is cut into stages:
    an nn.Sequential's blocks, or a traced network's modules by their original names."""
    return resolve_plan(network, plan, tensor_parallel_size=tensor_parallel_size, sequence_parallel=False)


def shard_stage(
    network: nn.Module,
    plan: Mapping[str, str],
    mesh: DeviceMesh,
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    traced: bool = False,
) -> int:
    """Materialise this rank's blocks one planned layer at a time, each sharded over the "tp" `mesh` at once (so no
    rank holds even its whole stage); returns the most parameter bytes held on the way. A network built for real
    starts from the first tensor peer's values (`group`). `traced`: the layers only hold DTensor shards, which
    traced stages compute on (`run_on_mesh`); otherwise torch's styles wrap their forwards."""
    if not any(p.is_meta for p in network.parameters()):
        network.to(device)
        broadcast_module(network, group)
    held = {name for name, mod in network.named_modules() if any(True for _ in mod.parameters())}
    local = {name: style for name, style in plan.items() if name in held}  # pruned blocks are Identity

    def shard(name: str) -> None:
        if traced:
            distribute_planned(network.get_submodule(name), local[name], mesh)
        else:
            apply_plan(network, {name: local[name]}, mesh, sequence_parallel=False)

    tied = tied_groups(network)  # tied within this rank's blocks: each name sharded alike (`check_plan`), one again
    peak = materialize_in_parts(network, device, sharding_first(local), shard)
    retie(network, tied)
    return peak


def refuse_traced_sharding(
    network: nn.Module, plan: Mapping[str, str], tied: Sequence[TiedGroup], *, replicas: str, dp: int
) -> None:
    """What tensor parallelism inside traced stages does not do yet, one line each (on every rank, before any
    collective): shard a parameter tied across stages, or run under FSDP2 replicas (whose hooks are on the real
    modules' forwards, which traced stages never call), or run on a torch older than it passed on."""
    refuse_older_torch(
        "tensor parallelism inside traced pipeline stages",
        "use tensor_parallel_size=1, or write the network as an nn.Sequential of blocks",
    )
    if replicas == "fsdp" and dp > 1:
        raise ValueError(
            f"replicas='fsdp' does not yet shard replicas of {type(network).__name__}, which is split by tracing, "
            "with tensor_parallel_size > 1 (traced stages never call the modules' forwards, where FSDP2 gathers). "
            "HINT: use replicas='replicate'"
        )
    tied_names = {name for group in tied for name in group.names}
    for module_name, style in plan.items():
        shared = sorted(
            f"{module_name}.{key}" for key in parameter_placements(network.get_submodule(module_name), style)
            if f"{module_name}.{key}" in tied_names
        )  # fmt: skip
        if shared:
            raise ValueError(
                f"tensor plan: {module_name} ({style}) would shard {', '.join(shared)}, which is tied across "
                f"pipeline stages. HINT: map {module_name} to 'replicate'"
            )


def stages_on_mesh(
    modules: dict[int, nn.Module], factory: StageFactory | None, mesh: DeviceMesh
) -> tuple[dict[int, nn.Module], StageFactory | None]:
    """Traced stage modules (and those a factory traces later, per micro-batch shape) computing on DTensors over
    the "tp" `mesh`: they take and return plain tensors, as the schedule expects."""
    on_mesh = {index: run_on_mesh(module, mesh) for index, module in modules.items()}
    return on_mesh, (partial(_traced_on_mesh, factory, mesh) if factory is not None else None)


def _traced_on_mesh(factory: StageFactory, mesh: DeviceMesh, micro: tuple[torch.Tensor, ...]) -> dict[int, nn.Module]:
    return {index: run_on_mesh(module, mesh) for index, module in factory(micro).items()}


def shard_over_replicas(network: nn.Module, mesh: DeviceMesh, tied: Sequence[TiedGroup]) -> None:
    """FSDP2 over the "dp" `mesh` for each block this rank holds: replicas keep a 1/dp share of its parameters
    (torch reduce-scatters the gradients in each backward, so no all-reduce is left for the optimizer step)."""
    if tied:
        raise ValueError(
            "replicas='fsdp' does not yet shard parameters tied across pipeline stages "
            f"({', '.join(t.names[0] for t in tied)}). HINT: use replicas='replicate'"
        )
    for _, block in network.named_children():
        if any(p.requires_grad for p in block.parameters()):
            fully_shard(block, mesh=mesh)
