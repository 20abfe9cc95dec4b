"""What a fault-tolerant strategy (`fault_tolerant.py`) checks of its arguments and of the Trainer, one line each, and
how it makes the Trainer count and stop by the groups' applied steps (`count_steps`, `lift_epoch_limit`). No torchft
and no process groups here.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_parallel.strategies.arguments import check_int, reject
from lightning_parallel.strategies.diloco import check_outer_optimizer

__all__ = ["check_fit", "check_groups", "check_period", "check_seconds", "count_steps", "lift_epoch_limit"]


def count_steps(trainer: pl.Trainer, applied: int) -> None:
    """Make `trainer.global_step` read `applied` once the optimizer step now running completes (Lightning adds one
    right after `optimizer_step` returns): max_steps, checkpoints every n steps and the logs count steps in effect."""
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    progress.ready, progress.completed = applied, applied - 1


def lift_epoch_limit(owner: object, trainer: pl.Trainer) -> None:
    """Groups end together at max_steps only: a rejoining group takes the others' step count but starts its epochs
    afresh, and a refused step uses a batch without counting, so an epoch limit ends each group at a step of its own
    (a group that rejoined then trains on alone). A finite max_epochs is lifted, in one line."""
    loop = trainer.fit_loop
    if loop.max_epochs is None or loop.max_epochs < 0:
        return
    rank_zero_warn(
        f"{type(owner).__name__}: trainer.max_epochs={loop.max_epochs} lifted; replica groups end together at "
        f"trainer.max_steps={trainer.max_steps} (a rejoining group takes the others' step count, not their epoch). "
        "HINT: trainer.max_epochs=-1 says the same without this line"
    )
    loop.max_epochs = -1


def check_groups(owner: object, replica_group: Any, replica_groups: Any, min_replicas: Any) -> None:
    check_int(owner, "replica_groups", replica_groups, example=2)
    check_int(owner, "replica_group", replica_group, example=0, minimum=0)
    check_int(owner, "min_replicas", min_replicas, example=1)
    if replica_group >= replica_groups:
        expected = f"below replica_groups={replica_groups} (groups are numbered from 0)"
        reject(owner, "replica_group", replica_group, expected, f"replica_groups={replica_group + 1}")
    if min_replicas > replica_groups:
        expected = f"at most replica_groups={replica_groups}"
        reject(owner, "min_replicas", min_replicas, expected, f"min_replicas={replica_groups}")


def check_period(owner: object, sync: str, period: Any, outer_optimizer: Any) -> None:
    if sync == "ddp" and period is not None:
        reject(owner, "period", period, "None with sync='ddp' (every step syncs)", "sync='diloco' or leave period out")
    if sync != "ddp":
        check_int(owner, "period", period, example=10)
    if outer_optimizer is not None and sync != "diloco":
        reject(owner, "outer_optimizer", outer_optimizer, "None unless sync='diloco'", "leave outer_optimizer out")
    if outer_optimizer is not None:
        check_outer_optimizer(owner, outer_optimizer)


def check_seconds(owner: object, name: str, value: Any) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf):
        reject(owner, name, value, "a positive number of seconds", f"{name}=60")


def check_fit(owner: object, trainer: pl.Trainer, *, per_step: bool) -> None:
    """What a fault-tolerant fit needs of the Trainer and the module (`per_step`: sync="ddp"): one line each."""
    name = type(owner).__name__
    if trainer.max_steps < 0:
        raise ValueError(
            f"{name}: trainer.max_steps={trainer.max_steps}; groups finish together only at a step count (a "
            "rejoining group takes the others' count, not their epoch). HINT: set trainer.max_steps=N"
        )
    module = trainer.lightning_module
    if module is not None and not module.automatic_optimization:
        raise ValueError(
            f"{name}: {type(module).__name__} uses manual optimization; torchft's commit vote sits inside the "
            "automatic optimizer step. HINT: use automatic optimization (self.automatic_optimization = True)"
        )
    if len(trainer.optimizers) != 1:
        raise ValueError(
            f"{name}: configure_optimizers returned {len(trainer.optimizers)} optimizers; the groups agree on one. "
            "HINT: return one optimizer"
        )
    if per_step and getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            f"{name}: precision={trainer.precision!r} steps through a GradScaler, which fails on a step the groups "
            "refuse (it leaves no gradient to check for infs). HINT: precision=bf16-mixed, or sync='diloco'"
        )
