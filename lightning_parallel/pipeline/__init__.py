"""Pipeline parallelism: planning the split of an ``nn.Sequential`` into stages (torch only, no Lightning)."""

from lightning_parallel.pipeline.partition import (
    Partition,
    loop_stage_to_rank,
    make_partition,
    parameter_costs,
    prune_to_blocks,
    split_by_cost,
    split_explicit,
    stage_module,
    v_stage_to_rank,
)

__all__ = [
    "Partition",
    "loop_stage_to_rank",
    "make_partition",
    "parameter_costs",
    "prune_to_blocks",
    "split_by_cost",
    "split_explicit",
    "stage_module",
    "v_stage_to_rank",
]
