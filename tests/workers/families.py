"""Worker: fit transformers decoder families (tests/hf_families.py) on padded text, one fit per config ({"family",
"devices", "steps", "kind": "pipeline" or "tensor", "strategy": constructor kwargs}); save each fit's losses, local
weights (tensor-parallel shards gathered) and `describe()`. An error stops the rank (the launcher stops the others)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import payload

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_families import build  # noqa: E402
from padded_modules import padded_loader  # noqa: E402
from user_modules import fit  # noqa: E402

from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy  # noqa: E402

configs, out = payload()
results = []
for config in configs:
    kind = TensorParallelStrategy if config.get("kind") == "tensor" else PipelineParallelStrategy
    strategy = kind(**config.get("strategy", {}))
    module = build(config["family"])
    run = fit(module, strategy=strategy, devices=config["devices"], steps=config["steps"], shuffle=False,
              data=padded_loader())  # fmt: skip
    results.append({**run, "parallel": strategy.describe()})
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
