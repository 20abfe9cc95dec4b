"""Checkpoints of replicas that differ between syncs (local SGD, DiLoCo).

Lightning saves rank 0's weights and optimizer state only; a resume would restart every replica from rank 0's and
silently change the run. These put every replica's own state into the checkpoint (gathered to rank 0, which
writes it) and give each rank back its own on resume.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import ParallelStrategy


def gather_replica_states(strategy: ParallelStrategy) -> list[dict[str, Any]] | None:
    """Every rank's weights and optimizer states, on rank 0 (None elsewhere). A collective: every rank calls it."""
    own = {
        "module": strategy.lightning_module_state_dict(),
        "optimizers": [strategy.optimizer_state(optimizer) for optimizer in strategy.optimizers],
    }
    gathered: list[Any] | None = [None] * strategy.world_size if strategy.is_global_zero else None
    dist.gather_object(move_data_to_device(own, "cpu"), gathered, dst=0)
    return gathered


def restore_replica_state(strategy: ParallelStrategy, replicas: list[dict[str, Any]]) -> None:
    """Load this rank's own weights and optimizer states from ``replicas`` (saved by `gather_replica_states`).

    Raises:
        ValueError: The checkpoint holds another number of replicas than this run has ranks.
    """
    name = type(strategy).__name__
    if len(replicas) != strategy.world_size:
        raise ValueError(
            f"{name}: the checkpoint holds {len(replicas)} replicas, this run has {strategy.world_size}. "
            f"HINT: resume with trainer.devices={len(replicas)} (x trainer.num_nodes)"
        )
    own, module = replicas[strategy.global_rank], strategy.lightning_module
    assert module is not None  # restored after set-up
    module.load_state_dict(own["module"])
    for optimizer, optimizer_state in zip(strategy.optimizers, own["optimizers"], strict=True):
        optimizer.load_state_dict(optimizer_state)
