"""Pipeline layouts in one process: every pipeline rank's network set up by the pipeline strategy's own order
(split -> plan -> prune -> materialise and shard -> tie), the stage modules torch's schedule would run on each rank
(`NetworkSplit.stage_modules`) chained in stage order per micro-batch, on simulated tensor and data ranks. What it
checks is the split, the pruning and the sharding at pp 8 and in 16 ranks; the schedule's order of work and its
point-to-point transport (torch's, which the simulation cannot run) are checked by the multi-process parity tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from simulated import EPS, LR, Batch, next_token_loss, replicas_mean, rows_of_replica, settings
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_parallel.dims import ParallelDims
from lightning_parallel.parallelize import parallelize_pipeline
from lightning_parallel.replicas import average_
from lightning_parallel.token_mean import TokenMean, summed


class AsPipelineRank:
    """The run's mesh, as pipeline rank `rank` sees it (every simulated rank holds every stage here)."""

    def __init__(self, mesh: Any, rank: int) -> None:
        self.mesh, self.rank = mesh, rank

    def get_local_rank(self, dim: str) -> int:
        return self.rank if dim == "pp" else self.mesh.get_local_rank(dim)

    def __getitem__(self, dim: str) -> Any:
        return self.mesh[dim]

    def get_group(self, dim: str) -> Any:
        return self.mesh.get_group(dim)


def set_up_stages(
    dims: ParallelDims, build: Callable[[], nn.Module], example: torch.Tensor
) -> tuple[list[nn.Module], list[nn.Module]]:
    """Each pipeline rank's network (pruned to its stages) and every stage module in stage order."""
    mesh = dims.build_mesh("cpu")
    networks, stages = [], {}
    for rank in range(dims.pp):
        torch.manual_seed(0)
        network = build()
        done = parallelize_pipeline(network, settings(dims, AsPipelineRank(mesh, rank)), lambda: (None, (example,)))
        assert done.stages is not None
        stages.update(done.stages.split.stage_modules(done.stages.partition, rank, (example,)))
        networks.append(network)
    assert sorted(stages) == list(range(dims.pp)), sorted(stages)
    return networks, [stages[index] for index in range(dims.pp)]


def train_pipelined(
    mode: Any, dims: ParallelDims, build: Callable[[], nn.Module], data: list[Batch], *, microbatches: int
) -> tuple[list[float], list[nn.Module]]:
    """The steps of one process's batches through the chained stages: each micro-batch's loss its sum over valid
    tokens divided by the whole batch's count per micro-batch and replica (as `pipeline/token_shares.py` divides),
    its gradient scaled by 1 / micro-batches as torch's schedules scale it, replicas averaged over "dp"."""
    mesh = dims.build_mesh("cpu")
    networks, stages = set_up_stages(dims, build, data[0][0][:1])
    optimizer = torch.optim.AdamW([p for n in networks for p in n.parameters()], lr=LR, eps=EPS)
    losses = []
    for ids, labels in data:
        ids, labels = rows_of_replica(mode, dims, ids), rows_of_replica(mode, dims, labels)
        total = summed((labels[:, 1:] != -100).sum().to(torch.float64), mesh.get_group("dp"))
        share = total / (microbatches * dims.dp)
        step = []
        for part_ids, part_labels in zip(ids.chunk(microbatches), labels.chunk(microbatches), strict=True):
            hidden = part_ids
            for stage in stages:
                hidden = stage(hidden)
            with TokenMean(lambda count, share=share: share) as normalised:
                loss = next_token_loss(hidden, part_labels)
            assert normalised.normalised == "cross_entropy"
            (loss / microbatches).backward()
            step.append(loss.detach())
        grads = [p.grad for n in networks for p in n.parameters() if p.grad is not None]
        average_([g.to_local() if isinstance(g, DTensor) else g for g in grads], mesh.get_group("dp"))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(replicas_mean(mode, dims, sum(step) / microbatches))
    return losses, networks
