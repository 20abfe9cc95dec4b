"""What a pipeline rank does to its own stages beyond pipelining them: tensor parallelism inside them ("3D") and
FSDP2 across data-parallel replicas. Plain functions over the network and mesh groups; the strategy decides when.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_parallel.pipeline.tied import TiedGroup
from lightning_parallel.replicas import broadcast_module
from lightning_parallel.strategies.tensor import resolve_plan
from lightning_parallel.tensor.plans import apply_plan
from lightning_parallel.weights import materialize_in_parts


def resolve_stage_plan(
    network: nn.Module, plan: Mapping[str, str] | str | None, tensor_parallel_size: int
) -> tuple[str, dict[str, str], dict[str, str]]:
    """(source, exact-name plan, why modules stay whole), resolved on the whole network before it is cut into stages.
    Only an nn.Sequential's blocks are sharded: a traced split rebinds torch's copies of the modules by name."""
    if not isinstance(network, nn.Sequential):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} inside pipeline stages needs the network as an "
            f"nn.Sequential of blocks; {type(network).__name__} is split by tracing, which does not shard. HINT: write "
            "the network as an nn.Sequential (as models/ does), or use tensor_parallel_size=1"
        )
    return resolve_plan(network, plan, tensor_parallel_size=tensor_parallel_size, sequence_parallel=False)


def shard_stage(
    network: nn.Module, plan: Mapping[str, str], mesh: DeviceMesh, group: dist.ProcessGroup, device: torch.device
) -> int:
    """Materialise this rank's blocks one planned layer at a time, each sharded over the "tp" `mesh` at once (so no
    rank holds even its whole stage); returns the most parameter bytes held on the way. A network built for real
    starts from the first tensor peer's values (`group`)."""
    if not any(p.is_meta for p in network.parameters()):
        network.to(device)
        broadcast_module(network, group)
    held = {name for name, mod in network.named_modules() if any(True for _ in mod.parameters())}
    local = {name: style for name, style in plan.items() if name in held}  # pruned blocks are Identity

    def shard(name: str) -> None:
        apply_plan(network, {name: local[name]}, mesh, sequence_parallel=False)

    return materialize_in_parts(network, device, list(local), shard)


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
