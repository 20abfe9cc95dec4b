"""How a network becomes one rank's pipeline stages: an ``nn.Sequential`` by its children, any other module by
torch's tracing frontend (``traced.py``). Both keep the original parameter names and prune in place.

One interface for the strategy: blocks and their costs, the partition, tied-parameter refusal, pruning, and
stage modules (fixed for a Sequential, per micro-batch shape for a traced network). No process groups here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_parallel.pipeline.call import NetworkCall
from lightning_parallel.pipeline.partition import (
    Partition,
    holds_parameters,
    make_partition,
    plan_partition,
    shared_across_ranks,
)
from lightning_parallel.pipeline.prune import prune_to_blocks, stage_module
from lightning_parallel.pipeline.runtime import StageFactory
from lightning_parallel.pipeline.tied import TiedGroup
from lightning_parallel.pipeline.traced import TracedNetwork

Balance = str | Sequence[Sequence[str]]


class NetworkSplit:
    """An ``nn.Sequential`` of named blocks: the children are the blocks, costs are parameters (or measured
    seconds), and a stage is a Sequential over the shared block objects."""

    def __init__(self, network: nn.Module) -> None:
        self.network = network

    @property
    def blocks(self) -> list[str]:
        return [name for name, _ in self.network.named_children()]

    def partition(
        self, *, pp: int, stages_per_rank: int, style: str, balance: Balance, block_costs: Sequence[float] | None
    ) -> Partition:
        if balance == "flops":
            raise ValueError(
                "balance='flops' counts the compute of a traced network; an nn.Sequential is split by its children. "
                "HINT: use balance='parameters' or 'time' for it"
            )
        return make_partition(
            self.network,  # type: ignore[arg-type]
            pp=pp,
            stages_per_rank=stages_per_rank,
            style=style,
            balance=balance,
            block_costs=block_costs,
        )

    def tied_across_ranks(self, partition: Partition) -> list[TiedGroup]:
        """Parameters used by blocks on different ranks (call before pruning)."""
        groups = []
        for names in shared_across_ranks(self.network, partition).values():
            groups.append(self._tied(names[0], [name.split(".")[0] for name in names], partition))
        return groups

    def tied_blocks(self) -> dict[str, list[str]]:
        """Parameters read by more than one block: first name -> those blocks."""
        users: dict[int, tuple[str, list[str]]] = {}
        for block, child in self.network.named_children():
            for name, param in child.named_parameters(remove_duplicate=False):
                blocks = users.setdefault(id(param), (f"{block}.{name}", []))[1]
                if block not in blocks:
                    blocks.append(block)
        return {name: blocks for name, blocks in users.values() if len(blocks) > 1}

    def _tied(self, name: str, blocks: Sequence[str], partition: Partition) -> TiedGroup:
        rank_of = {block: partition.stage_to_rank[i] for i, stage in enumerate(partition.stages) for block in stage}
        param = self.network.get_parameter(name)
        aliases = [n for n, p in self.network.named_parameters(remove_duplicate=False) if p is param]
        last = max(blocks, key=self.blocks.index)
        return TiedGroup(
            names=tuple(aliases),
            ranks=tuple(sorted({rank_of[block] for block in blocks})),
            source=rank_of[last],
            shape=tuple(param.shape),
            dtype=param.dtype,
        )

    def prune(self, keep: Sequence[str]) -> None:
        prune_to_blocks(self.network, keep)  # type: ignore[arg-type]

    def stage_modules(self, partition: Partition, rank: int, example: tuple[torch.Tensor, ...]) -> dict[int, nn.Module]:
        return {i: stage_module(self.network, partition.stages[i]) for i in partition.stages_of(rank)}  # type: ignore[arg-type]

    def stage_factory(self, partition: Partition, rank: int) -> StageFactory | None:
        return None

    def output(self, value: object) -> object:
        """The network's output from what its last stage returns (a Sequential's last block returns it as is)."""
        return value


class TracedSplit(NetworkSplit):
    """Any other module: the blocks are the submodules its forward calls once, costs are FLOPs by default, and
    stages are traced per micro-batch shape (a trace bakes the batch size in)."""

    def __init__(self, network: nn.Module, example: tuple[torch.Tensor, ...], call: NetworkCall | None = None) -> None:
        super().__init__(network)
        self.traced = TracedNetwork(network, example, call)

    @property
    def blocks(self) -> list[str]:
        return list(self.traced.blocks)

    def partition(
        self, *, pp: int, stages_per_rank: int, style: str, balance: Balance, block_costs: Sequence[float] | None
    ) -> Partition:
        if balance == "time":
            raise ValueError(
                f"balance='time' times the children of an nn.Sequential; {type(self.network).__name__} is split by "
                "tracing. HINT: use balance='flops' (the default) or 'parameters', or name the blocks per stage"
            )
        if balance == "parameters":
            costs = [float(sum(p.numel() for p in self.network.get_submodule(b).parameters())) for b in self.blocks]
            unit = "parameters"
        else:
            costs, unit = [float(c) for c in self.traced.costs], "FLOPs"
        return plan_partition(
            self.blocks,
            costs,
            unit,
            pp=pp,
            stages_per_rank=stages_per_rank,
            style=style,
            balance=balance,
            holds_parameters=holds_parameters(self.network, self.blocks),
        )

    def tied_blocks(self) -> dict[str, list[str]]:
        return self.traced.tied_parameters()

    def tied_across_ranks(self, partition: Partition) -> list[TiedGroup]:
        groups = [self._tied(name, blocks, partition) for name, blocks in self.traced.tied_parameters().items()]
        return [group for group in groups if len(group.ranks) > 1]

    def prune(self, keep: Sequence[str]) -> None:
        self.traced.prune(self.network, keep)

    def stage_modules(self, partition: Partition, rank: int, example: tuple[torch.Tensor, ...]) -> dict[int, nn.Module]:
        stages = [list(stage) for stage in partition.stages]
        return self.traced.stage_modules(stages, partition.stages_of(rank), example, self.network)

    def stage_factory(self, partition: Partition, rank: int) -> StageFactory | None:
        return lambda micro: self.stage_modules(partition, rank, micro)

    def output(self, value: object) -> object:
        return self.traced.output(value)


def network_split(
    network: nn.Module, example: tuple[torch.Tensor, ...] | None, call: NetworkCall | None = None
) -> NetworkSplit:
    """The split for this network; a non-Sequential network needs an example of its inputs (and how they are
    passed, `call`) to be traced."""
    if isinstance(network, nn.Sequential):
        if call is not None and (call.keywords or call.constants):
            raise ValueError(
                f"the nn.Sequential network is called as {call.describe()}; an nn.Sequential takes one positional "
                "input. HINT: call it as self.<network>(x), or give the network its own forward taking keywords"
            )
        if example is not None and len(example) == 1:
            check_block_outputs(network, example[0])
        return NetworkSplit(network)
    if example is None:
        raise ValueError(
            f"{type(network).__name__} is not an nn.Sequential, so it is split by tracing, which needs an example "
            "input. HINT: set `self.example_input_array` on the LightningModule, or pass a DataLoader or datamodule"
        )
    return TracedSplit(network, example, call)


def check_block_outputs(network: nn.Sequential, example: torch.Tensor) -> None:
    """Stages of an nn.Sequential hand one tensor from block to block; a block that returns a tuple (or a dict)
    would reach the next stage as several inputs or fail in the next block with torch's own words. One row is
    run through the blocks in eval mode (no running statistics touched) to name such a block before any step."""
    children = list(network.named_children())
    modes = [m.training for m in network.modules()]
    on_meta = any(p.is_meta for p in network.parameters())
    value: object = example[:1].to("meta") if on_meta else example[:1]
    try:
        network.eval()
        with torch.no_grad():
            for name, block in children[:-1]:
                try:
                    value = block(value)
                except Exception:  # noqa: BLE001 - e.g. an op without a meta kernel: leave it to the run itself
                    return
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"block {name!r} ({type(block).__name__}) of the nn.Sequential returns a "
                        f"{type(value).__name__}, and pipeline stages pass one tensor from block to block. HINT: "
                        "return one tensor from it (keep the other values inside the block), or write the network "
                        "as an nn.Module with its own forward, which is split by tracing"
                    )
    finally:
        for module, mode in zip(network.modules(), modes, strict=True):
            module.training = mode
