"""Pipeline parallelism: the schedule table and the split of an ``nn.Sequential`` into stages (torch only)."""

from lightning_parallel.pipeline.balance import split_by_cost, split_explicit
from lightning_parallel.pipeline.partition import (
    Partition,
    loop_stage_to_rank,
    make_partition,
    parameter_costs,
    v_stage_to_rank,
)
from lightning_parallel.pipeline.prune import prune_to_blocks, stage_module
from lightning_parallel.pipeline.schedules import SCHEDULE_TRAITS, ScheduleTraits

__all__ = [
    "SCHEDULE_TRAITS",
    "Partition",
    "ScheduleTraits",
    "loop_stage_to_rank",
    "make_partition",
    "parameter_costs",
    "prune_to_blocks",
    "split_by_cost",
    "split_explicit",
    "stage_module",
    "v_stage_to_rank",
]
