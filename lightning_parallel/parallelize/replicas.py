"""Set-up step "replicas": FSDP2 over "dp" shards each block's parameters, gradients and optimizer state across
data-parallel replicas (torch reduce-scatters gradients in each backward), after the blocks are sharded over "tp",
checkpointed and compiled. Nothing at dp=1, or where replicas are kept equal by an all-reduce at the optimizer step
(the pipeline's replicas="replicate"; `replicas.average_`). Also which mesh dimensions a parameter spans (`spans`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lightning_parallel.parallelize.split import Stages
from lightning_parallel.seams import initialise_fsdp_root


def shard_stages_over_replicas(
    network: nn.Module, stages: Stages | None, mesh: DeviceMesh | None, *, replicas: str, dp: int
) -> None:
    """The pipeline's replicas="fsdp": FSDP2 over "dp" for each block this rank holds (the whole network's at pp=1)."""
    if replicas != "fsdp" or dp == 1:
        return
    assert mesh is not None  # dp > 1
    tied = stages.tied if stages is not None else []
    if tied:
        raise ValueError(
            "replicas='fsdp' does not yet shard parameters tied across pipeline stages "
            f"({', '.join(t.names[0] for t in tied)}). HINT: use replicas='replicate'"
        )
    dp_mesh = mesh["dp"]
    sharded: set[nn.Parameter] = set()
    for _, block in network.named_children():
        if any(p.requires_grad for p in block.parameters()):
            fully_shard(block, mesh=dp_mesh)
            sharded.update(block.parameters())
    # One root over the blocks, so they share FSDP2's state: as roots of their own, each block would hold its whole
    # gathered gradient (the reduce-scatter's input) until the end of backward, and its gathered parameters from
    # forward to backward. The stages call the blocks, never the network, so the root is initialised here.
    fully_shard(network, mesh=dp_mesh, ignored_params={p for p in network.parameters() if p not in sharded})
    initialise_fsdp_root(network)


def shard_layers_over_replicas(module: nn.Module, network: nn.Module, mesh: DeviceMesh | None, *, dp: int) -> None:
    """The tensor strategy's replicas: FSDP2 over "dp" per child of the network, then the network, unless the
    module's `configure_model()` already called `fully_shard`; every parameter of `module` must then span "dp"."""
    if dp == 1:
        return
    assert mesh is not None  # dp > 1
    if not any(isinstance(m, FSDPModule) for m in module.modules()):
        dp_mesh = mesh["dp"]
        for child in network.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=dp_mesh)
        fully_shard(network, mesh=dp_mesh)
    loose = [name for name, p in module.named_parameters() if not spans(p, "dp")]
    if loose:
        raise RuntimeError(
            f"with data_parallel_size {dp}, parameters {loose[:3]} are not sharded over the 'dp' mesh "
            "dimension, so replicas would drift apart. HINT: keep every parameter inside the network, or call "
            "fully_shard(..., mesh=self.device_mesh['dp']) on them in configure_model()"
        )


def modules_split_over(network: nn.Module, dim: str) -> set[str]:
    """The modules holding a parameter of their own split along mesh dimension `dim` (for the tensor strategy's
    report: the layers a plan, or `configure_model()`, sharded over "tp")."""
    return {
        name
        for name, module in network.named_modules()
        if any(spans(p, dim, sharded=True) for p in module.parameters(recurse=False))
    }


def spans(param: torch.Tensor, dim: str, *, sharded: bool = False) -> bool:
    """Whether `param` is a DTensor over mesh dimension `dim` (and, if `sharded`, split along it)."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(
        name == dim and not (sharded and p.is_replicate()) for name, p in zip(names, param.placements, strict=True)
    )
