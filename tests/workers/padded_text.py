"""Worker: fit the padded-text modules (tests/padded_modules.py) once per config ({"name", "devices", "steps",
"batch_size" (per replica), "validate"?, "kind": "pipeline" (default), "ddp" or "tensor", "strategy": constructor
kwargs, "trainer": Trainer kwargs}); save each fit's losses, logged metrics, local weights and the warnings raised on
the rank."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import payload

sys.path.insert(0, str(Path(__file__).parents[1]))
from padded_modules import fit  # noqa: E402

from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy  # noqa: E402
from lightning_parallel.strategies.ddp import DDPStrategy  # noqa: E402

KINDS = {"pipeline": PipelineParallelStrategy, "ddp": DDPStrategy, "tensor": TensorParallelStrategy}
configs, out = payload()
results = []
for config in configs:
    strategy = KINDS[config.get("kind", "pipeline")](**config.get("strategy", {}))
    run = {key: config[key] for key in ("devices", "steps", "batch_size", "validate") if key in config}
    result = fit(config["name"], strategy=strategy, **run, **config.get("trainer", {}))
    tensor = config.get("strategy", {}).get("tensor_parallel_size", 1) > 1
    result["parallel"] = strategy.describe() if tensor else None
    results.append(result)
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
