"""Worker: fit the tiny GPT under each pipeline configuration in the payload; save losses and local weights."""

from __future__ import annotations

import torch
from common import fit_tiny_gpt, local_state, payload

from lightning_parallel import PipelineParallelStrategy

configs, out = payload()
results = []
for config in configs:
    strategy = PipelineParallelStrategy(**config["strategy"], timeout=60)
    task, losses = fit_tiny_gpt(
        strategy,
        devices=config["devices"],
        global_batch=config["global_batch"],
        replicas=config["strategy"].get("data_parallel_size", 1),
        steps=config["steps"],
        **config.get("trainer", {}),
    )
    results.append({"losses": losses, "state": local_state(task)})
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
# Leave together and tear down cleanly: gloo aborts ranks still connected at exit.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
