"""Layout planner: estimate memory and step time of every data x pipeline x tensor layout, rank them, explain the
winner. Torch only (models are analysed on the meta device); the ``plan`` command adds Hydra on top.
"""

from lightning_parallel.planner.estimate import CostModel, Estimate, Layout
from lightning_parallel.planner.hardware import Hardware, Network, human_bytes, parse_bytes, precision_bytes
from lightning_parallel.planner.measure import measure_block_seconds
from lightning_parallel.planner.network import workload_from_module, workload_from_network
from lightning_parallel.planner.schedule_costs import ScheduleCost, schedule_cost
from lightning_parallel.planner.search import Plan, describe, explain, plan
from lightning_parallel.planner.workload import Block, Workload, gpt_workload

__all__ = [
    "Block",
    "CostModel",
    "Estimate",
    "Hardware",
    "Layout",
    "Network",
    "Plan",
    "ScheduleCost",
    "Workload",
    "describe",
    "explain",
    "gpt_workload",
    "human_bytes",
    "measure_block_seconds",
    "parse_bytes",
    "plan",
    "precision_bytes",
    "schedule_cost",
    "workload_from_module",
    "workload_from_network",
]
