"""Worker: fit user-style modules (tests/user_modules.py) under a strategy given by registry name; save each
run's losses, logged metrics and local weights, or the error it stopped with."""

from __future__ import annotations

import sys
import traceback
from functools import partial
from pathlib import Path

import torch
from common import payload
from lightning.pytorch.strategies import StrategyRegistry

sys.path.insert(0, str(Path(__file__).parents[1]))
from user_modules import build, fit  # noqa: E402

import lightning_parallel  # noqa: E402, F401 - registers the strategies

configs, out = payload()
results = []
for config in configs:
    module = build(config["net"], config["step"])
    strategy = config["strategy"]
    if config.get("kwargs"):
        kwargs = dict(config["kwargs"])
        if "outer_sgd" in kwargs:  # DiLoCo's outer optimizer, [lr, momentum] in the JSON payload
            lr, momentum = kwargs.pop("outer_sgd")
            kwargs["outer_optimizer"] = partial(torch.optim.SGD, lr=lr, momentum=momentum)
        strategy = StrategyRegistry[strategy]["strategy"](**kwargs)
    try:
        run = {"devices": config["devices"], "steps": config["steps"], "batch_size": config.get("batch_size", 16)}
        results.append(fit(module, strategy=strategy, shuffle=False, **run, **config.get("trainer", {})))
    except Exception as error:  # a refused step raises the same line on every rank
        traceback.print_exc()
        results.append({"error": f"{type(error).__name__}: {error}"})
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
