"""Set-up steps "split" and "prune" of the pipeline's order (`order.py`): where the whole network is cut into stages
(the partition, balanced by parameters, FLOPs or measured time, and the parameters tied across ranks), then this rank
keeping only its own stages' blocks. At pp=1 neither does anything. The cutting itself is `pipeline/split.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.dims import ParallelDims
from lightning_parallel.pipeline.call import NetworkCall
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.pipeline.profile import measure_block_costs
from lightning_parallel.pipeline.schedule_plan import ScheduleSpec
from lightning_parallel.pipeline.split import Balance, NetworkSplit, TracedSplit, network_split
from lightning_parallel.pipeline.tied import TiedGroup, refuse_ties_within_a_rank

# How the network is called and the tensors it receives (to trace it and time its blocks); (None, None) without any
NetworkInputs = tuple[NetworkCall | None, tuple[torch.Tensor, ...] | None]


@dataclass(frozen=True)
class Stages:
    """Where the whole network is cut: its split, the partition into stages, the parameters tied across ranks, and
    the inputs it was split on (the runtime traces and calls the stages with them)."""

    split: NetworkSplit
    partition: Partition
    tied: list[TiedGroup]
    call: NetworkCall | None
    example: tuple[torch.Tensor, ...] | None

    @property
    def traced(self) -> bool:
        """Split by tracing (not an nn.Sequential): the stages run torch.fx graphs, not the blocks' forwards."""
        return isinstance(self.split, TracedSplit)


def split_network(
    network: nn.Module,
    inputs: Callable[[], NetworkInputs],
    dims: ParallelDims,
    spec: ScheduleSpec,
    balance: Balance | None,
    *,
    microbatches: int,
    device: torch.device,
) -> Stages | None:
    """Cut the whole network into stages (nothing is pruned yet); None at pp=1, where nothing is cut and the
    network's `inputs` are not even asked for."""
    if dims.pp == 1:
        return None
    call, example = inputs()
    split = network_split(network, example, call)
    costs = measured_costs(network, example, microbatches, device) if balance == "time" else None
    partition, tied = partition_stages(split, spec=spec, pp=dims.pp, balance=balance, block_costs=costs)
    return Stages(split, partition, tied, call, example)


def partition_stages(
    split: NetworkSplit, *, spec: ScheduleSpec, pp: int, balance: Balance | None, block_costs: list[float] | None
) -> tuple[Partition, list[TiedGroup]]:
    """The partition (also checked before launch, where a time-balanced split cannot be measured yet: it is checked
    as balanced by parameters) and the parameters tied across pipeline ranks."""
    if balance is None:  # FLOPs need a trace; a Sequential's children are split by parameters, as before
        balance = "parameters" if isinstance(split.network, nn.Sequential) else "flops"
    elif balance == "time" and block_costs is None:
        balance = "parameters"  # before launch: only checks that a split exists; setup measures the times
    partition = split.partition(
        pp=pp, stages_per_rank=spec.stages_per_rank, style=spec.style, balance=balance, block_costs=block_costs
    )
    if spec.splits_backward:
        refuse_ties_within_a_rank(split.tied_blocks(), partition.stages, partition.stage_to_rank, spec.name)
    return partition, split.tied_across_ranks(partition)


def measured_costs(
    network: nn.Module, example: tuple[torch.Tensor, ...] | None, microbatches: int, device: torch.device
) -> list[float]:
    """Rank 0 times every block on one micro-batch of the network's own inputs; every rank uses its numbers, so
    splits agree."""
    costs: list[list[float] | None] = [None]
    if dist.get_rank() == 0:
        if not example:
            raise ValueError(
                "balance='time' needs a sample input to time the blocks on. HINT: set `example_input_array` "
                "on the LightningModule, give the Trainer data, or use balance='parameters'"
            )
        sample = example[0][: max(1, len(example[0]) // microbatches)]
        costs[0] = measure_block_costs(network, sample, device=device)  # type: ignore[arg-type]
    dist.broadcast_object_list(costs, src=0)
    assert costs[0] is not None
    return costs[0]


def keep_own_stages(stages: Stages | None, mesh: DeviceMesh | None) -> None:
    """This rank keeps only its own stages' blocks (the others become `nn.Identity`; names unchanged), before any
    gets storage. Nothing at pp=1."""
    if stages is None:
        return
    assert mesh is not None  # a cut exists only over a pipeline mesh dimension
    stages.split.prune(stages.partition.blocks_of(mesh.get_local_rank("pp")))
