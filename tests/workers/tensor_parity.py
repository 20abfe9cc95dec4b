"""Worker: fit under each tensor-parallel configuration in the payload (a library model, or with "network" one of
`user_networks.NETWORKS`); save losses, whole weights, the strategy's description and the bytes each sharded module
holds on this rank."""

from __future__ import annotations

from typing import Any

import torch
from common import fit_model, full_state, payload
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from user_networks import fit_user_network

from lightning_parallel.strategies.tensor import TensorParallelStrategy
from lightning_parallel.tasks import LanguageModelTask


class SelfShardingTask(LanguageModelTask):
    """A user who writes configure_model() the Lightning way: the strategy must not apply a plan on top."""

    def configure_model(self) -> None:
        if isinstance(self.model.block_0.mlp.up.weight, DTensor):
            return  # already sharded (configure_model runs on every fit/validate)
        plan = {"block_*.mlp.up": ColwiseParallel(), "block_*.mlp.down": RowwiseParallel()}
        parallelize_module(self.model, self.device_mesh["tp"], plan)


def local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel() * tensor.element_size()


def sharded_bytes(network: torch.nn.Module, names: list[str]) -> dict[str, tuple[int, int, int]]:
    """name -> (parameter bytes on this rank, bytes of the whole module, gradient bytes on this rank; the last
    step's gradients are still there after fit) for the directly owned parameters."""
    result = {}
    for name in names:
        params = list(network.get_submodule(name).parameters(recurse=False))
        whole = sum(p.numel() * p.element_size() for p in params)
        result[name] = (sum(map(local_bytes, params)), whole, sum(local_bytes(p.grad) for p in params))
    return result


configs, out = payload()
results: list[dict[str, Any]] = []
for config in configs:
    strategy = TensorParallelStrategy(**config["strategy"], timeout=60)
    size = {"devices": config["devices"], "global_batch": config["global_batch"], "steps": config["steps"]}
    if "network" in config:
        task, losses = fit_user_network(strategy, network=config["network"], **size)
    else:
        task, losses, _ = fit_model(
            strategy,
            model=config["model"],
            replicas=config["strategy"].get("data_parallel_size", 1),
            task_class=SelfShardingTask if config.get("configure_model") else None,
            **size,
            **config.get("trainer", {}),
        )
    description = strategy.describe()
    results.append(
        {
            "losses": losses,
            "state": full_state(task.model),
            "describe": description,
            "bytes": sharded_bytes(task.model, list(description["sharded"])),
        }
    )
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
