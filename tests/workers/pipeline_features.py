"""Worker: run every scenario of pipeline_scenarios.py under PipelineParallelStrategy on this launch's ranks."""

from __future__ import annotations

import os

import torch
from common import payload
from pipeline_scenarios import SCENARIOS

from lightning_parallel import PipelineParallelStrategy

names, out = payload()
world_size = int(os.environ["WORLD_SIZE"])  # read now: Lightning's teardown deletes it after each fit
results = {}
for name in names:
    scenario, options = SCENARIOS[name]
    strategy = PipelineParallelStrategy(**options, timeout=60)
    results[name] = scenario(strategy, world_size, out / name)
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
