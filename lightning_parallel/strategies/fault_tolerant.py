"""`strategy=ft_ddp`, `ft_local_sgd`, `ft_diloco`: fault-tolerant replica groups over torchft. Each Lightning run is one
replica group (one process or several, its own world, started and restarted on its own); the groups agree through
torchft's Manager, so a group that dies leaves the others training and a restarted one receives the current state live.

Not here: the lighthouse (torchft's `torchft_lighthouse` command) and restarting a dead group (torchrun, SLURM, a shell
loop). The torch side is `lightning_parallel/replica_groups.py`, the kinds of agreement `group_sync.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.rendezvous import store_beside
from lightning_parallel.replica_groups import GroupSpec, join, lighthouse_address, require_torchft
from lightning_parallel.strategies.arguments import check_choice, check_name
from lightning_parallel.strategies.ddp import DDPStrategy
from lightning_parallel.strategies.diloco import DEFAULT_OUTER
from lightning_parallel.strategies.fault_tolerant_checks import (
    check_fit,
    check_groups,
    check_period,
    check_seconds,
    count_steps,
    lift_epoch_limit,
)
from lightning_parallel.strategies.group_sync import EveryStep, Periodic, StepLedger
from lightning_parallel.strategies.process_group import JOIN_TIMEOUT, group_store
from lightning_parallel.token_mean import TokenMean, inexact_warning

SYNCS = ("ddp", "local_sgd", "diloco")
_managers = itertools.count()  # Managers this process made: every rank of a group counts the same


class FaultTolerantStrategy(DDPStrategy):
    """One replica group of a fault-tolerant run: `DDPStrategy` (same arguments) inside the group, torchft across
    groups. `trainer.max_steps` counts steps in effect (`StepLedger.applied`): a step the groups did not commit is
    not counted, and a rejoining group takes the others' count with their state.

    Args:
        replica_group: this group's number, 0 .. replica_groups - 1; a restarted group takes its old number.
        replica_groups: the most groups the run has; the training data is split into this many shards per group rank
            (a dead group's shard goes untrained meanwhile, torchft's rule).
        sync: "ddp" (gradients averaged every step), "local_sgd" or "diloco" (every `period` steps, torchft's own).
        period: steps between syncs (local_sgd and diloco only).
        outer_optimizer: diloco's, built on the parameters; None: Nesterov SGD, lr 0.7, momentum 0.9.
        min_replicas: a step (a sync) commits only when at least this many groups took part.
        lighthouse: the torchft lighthouse's address; None: $TORCHFT_LIGHTHOUSE.
        replica_timeout: seconds before a collective across groups, the commit vote or a state transfer gives up.
        quorum_timeout: seconds a group waits for a quorum.
        **kwargs: `DDPStrategy`'s arguments, for the processes inside the group.
    """

    def __init__(
        self,
        *,
        replica_group: int,
        replica_groups: int,
        sync: str = "ddp",
        period: int | None = None,
        outer_optimizer: Callable[[list[torch.Tensor]], Optimizer] | None = None,
        min_replicas: int = 1,
        lighthouse: str | None = None,
        replica_timeout: float = 60.0,
        quorum_timeout: float = 300.0,
        **kwargs: Any,
    ) -> None:
        check_groups(self, replica_group, replica_groups, min_replicas)
        check_choice(self, "sync", sync, SYNCS, example="ddp")
        check_period(self, sync, period, outer_optimizer)
        check_name(self, "lighthouse", lighthouse, example="http://localhost:29510")
        for name, seconds in (("replica_timeout", replica_timeout), ("quorum_timeout", quorum_timeout)):
            check_seconds(self, name, seconds)
        super().__init__(**kwargs)
        self.replica_group, self.replica_groups, self.sync = replica_group, replica_groups, sync
        self.period, self.min_replicas, self.lighthouse = period, min_replicas, lighthouse
        self.outer_optimizer = DEFAULT_OUTER if sync == "diloco" and outer_optimizer is None else outer_optimizer
        self.replica_timeout, self.quorum_timeout = replica_timeout, quorum_timeout
        self.ledger = StepLedger()
        self._manager: Any = None
        self._agreement: EveryStep | Periodic | None = None

    @property
    def manager(self) -> Any:
        """This process's torchft Manager (exists while fitting)."""
        if self._manager is None:
            raise RuntimeError("FaultTolerantStrategy.manager exists once fitting has set the strategy up")
        return self._manager

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        module = self.lightning_module
        if module is None or not module.trainer.training:
            # Evaluation: groups never meet to reduce metrics, so each evaluates the whole set over its own ranks.
            return super().distributed_sampler_kwargs
        # Training: shard (group, rank in group) of replica_groups x world_size; groups see different data, and a
        # restarted group reads its old shard (torchft's DistributedSampler does the same).
        return {
            "num_replicas": self.replica_groups * self.world_size,
            "rank": self.replica_group * self.world_size + self.global_rank,
        }

    @override
    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "kind": self.sync,
            "fault_tolerant": True,
            "workers": self.replica_groups * self.world_size,
            "collectives": True,
            "replica_group": self.replica_group,
            "replica_groups": self.replica_groups,
            **({"period": self.period} if self.period is not None else {}),
            "steps": asdict(self.ledger),
        }

    @override
    def _configure_launcher(self) -> None:
        require_torchft()  # in the main process, before any launch: one line if it is missing
        lighthouse_address(self.lighthouse)
        super()._configure_launcher()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        check_fit(self, trainer, per_step=self.sync == "ddp")
        lift_epoch_limit(self, trainer)
        spec = GroupSpec(
            replica_group=self.replica_group,
            min_replicas=self.min_replicas,
            lighthouse=lighthouse_address(self.lighthouse),
            timeout=timedelta(seconds=self.replica_timeout),
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
        )
        self._manager = join(
            spec,
            rank=self.global_rank,
            world_size=self.world_size,
            store=self._manager_store(),
            device=self.root_device,
            state=self._live_state,
            load_state=self._load_live_state,
        )
        if self.sync == "ddp":
            self._agreement = EveryStep(self._manager)
        else:
            self._agreement = Periodic(
                self._manager,
                kind=self.sync,
                module=self.module,
                optimizer=self.optimizers[0],
                period=self.period or 1,
                outer_optimizer=self.outer_optimizer,
            )

    def _manager_store(self) -> tuple[str, int]:
        """Where the Manager keeps its keys (its server's address, read by the group's other ranks): a store of this
        attempt's own. MASTER_PORT is torchrun's agent store under torchrun, whose keys outlive a restart: a restarted
        rank could read the dead attempt's address there before its rank 0 wrote the new one."""
        environment = self.cluster_environment
        assert environment is not None
        store = group_store()
        if store is None:  # a process group this package did not start (the user's own): its main port, as torchft's
            return environment.main_address, environment.main_port
        key = f"lightning_parallel/torchft_store/{next(_managers)}"
        return store_beside(
            store, environment.main_address, key=key, rank=self.global_rank, world_size=self.world_size,
            timeout=JOIN_TIMEOUT,
        )  # fmt: skip

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """sync="ddp": the step's mean over valid tokens is made a share of the whole quorum's (the valid tokens of
        every group's batch, counted through the manager), so the averaged gradients are one process's on all the
        groups' batches together. Otherwise (local SGD, DiLoCo, not fitting) the group's own, as DDP's."""
        if not isinstance(self._agreement, EveryStep):
            return super().training_step(*args, **kwargs)
        step = lambda: super(DDPStrategy, self).training_step(*args, **kwargs)  # noqa: E731
        with TokenMean(self._agreement.token_divisor(self.world_size)) as mode:
            result = step()
        loss = mode.inexact()
        if loss is not None and not self._warned_inexact:
            where = f"{type(self.module).__name__}.training_step"
            averaged = f"the mean over the quorum's groups of {self.world_size} replicas' losses each"
            rank_zero_warn(inexact_warning(where, loss, averaged=averaged))
            self._warned_inexact = True
        return result

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.ledger.applied = self.module.trainer.global_step  # a resumed fit goes on from its checkpoint's step

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._agreement is not None:
            self._agreement.begin_batch(self.ledger)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._agreement is None:  # not fitting
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        closure = self._agreement.around_closure(closure, optimizer, parameters)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        note = self._agreement.after_step(self.ledger)
        if note is not None:
            rank_zero_warn(f"replica group {self.replica_group}: {note}")
        count_steps(self.module.trainer, self.ledger.applied)
        return output

    @override
    def teardown(self) -> None:
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        super().teardown()

    def _live_state(self) -> dict[str, Any]:
        """What a group behind the others receives: weights, optimizer and scheduler states, the step count."""
        return {
            "module": self.module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
            "applied": self.ledger.applied,
        }

    def _load_live_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        for config, scheduler_state in zip(self.lr_scheduler_configs, state["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(scheduler_state)
        self.ledger.applied = state["applied"]
        self.ledger.heals += 1
