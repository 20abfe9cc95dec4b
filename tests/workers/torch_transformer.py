"""Worker: fit tests/transformer_modules.py's modules under a strategy given by registry name (one fit per config:
{"name", "strategy", "devices", "steps", "kwargs"}); save each fit's losses, local weights (DTensors gathered whole)
and the names of its DTensor parameters, or the error it stopped with."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
from common import payload
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parents[1]))
from transformer_modules import build, loader  # noqa: E402
from user_modules import fit  # noqa: E402

import lightning_parallel  # noqa: E402, F401 - registers the strategies

configs, out = payload()
results = []
for config in configs:
    module = build(config["name"])
    strategy = StrategyRegistry[config["strategy"]]["strategy"](**config.get("kwargs", {}))
    try:
        run = {"devices": config["devices"], "steps": config["steps"], "data": loader(config["name"])}
        result = fit(module, strategy=strategy, shuffle=False, **run)
        result["sharded"] = sorted(name for name, p in module.named_parameters() if isinstance(p, DTensor))
        results.append(result)
    except Exception as error:  # a refusal raises the same line on every rank
        traceback.print_exc()
        results.append({"error": f"{type(error).__name__}: {error}"})
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
