"""Lightning's own DDP, with the mesh strategies' checks on the other processes: an impossible node count is
refused before launch, and when a run fails the rank that died first is named in one line and no launched rank
is left running (Lightning stops its children only on Ctrl+C). A mean over valid tokens is the whole batch's, not
each replica's own (`token_mean.py`), in training, validation and test steps."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_parallel.lightning_seams import finish_restored_epoch
from lightning_parallel.replica_calls import ReplicaCalls
from lightning_parallel.strategies.arguments import check_timeout
from lightning_parallel.strategies.module_access import ModuleAccess
from lightning_parallel.strategies.peers import PeerFailure, check_launched, check_nodes, stop_peers
from lightning_parallel.strategies.process_group import name_the_hang, replica_calls, start_process_group
from lightning_parallel.token_mean import step_over_replicas

DEFAULT_TIMEOUT = default_pg_timeout  # Lightning's own default


class DDPStrategy(ModuleAccess, LightningDDPStrategy):
    """`lightning.pytorch.strategies.DDPStrategy` (same arguments), refusing an impossible `num_nodes` before
    launch and stopping every rank when one fails."""

    peer_failure: PeerFailure | None = None
    # Replicas average their gradients every step, so each step's loss is made a share of the whole batch's mean
    # over valid tokens; strategies whose replicas step alone (local SGD, DiLoCo, async SGD) keep their own means.
    token_mean_over_replicas: ClassVar[bool] = True
    _warned_inexact = False
    _token_calls: ReplicaCalls | Literal[False] | None = None  # every replica makes the step's token mean (False: none)
    _evaluation_calls: ReplicaCalls | Literal[False] | None = None  # the same for evaluation steps

    def __init__(self, *, timeout: float | timedelta | None = DEFAULT_TIMEOUT, **kwargs: Any) -> None:
        if timeout is not None:
            check_timeout(self, timeout)  # Lightning would pass anything on to torch, after launch
            timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        super().__init__(timeout=timeout, **kwargs)

    def describe(self) -> dict[str, Any]:
        """summary.json's `parallel`: how the replicas agree (`sync_methods.SYNC_METHODS`), for the sweep report;
        `collectives` is false in one process, where no replica has anyone to agree with."""
        return {"kind": "ddp", "workers": self.world_size, "collectives": self.world_size > 1}

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.world_size == 1 or not self.token_mean_over_replicas:
            return super().training_step(*args, **kwargs)
        where = f"{type(self.module).__name__}.training_step"
        step = lambda: super(DDPStrategy, self).training_step(*args, **kwargs)  # noqa: E731
        if self._token_calls is None:
            self._token_calls = replica_calls(None) or False
        calls = self._token_calls or None
        result, inexact = step_over_replicas(step, group=None, replicas=self.world_size, where=where, calls=calls)
        if inexact is not None and not self._warned_inexact:
            rank_zero_warn(inexact)
            self._warned_inexact = True
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, "validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, "test_step", *args, **kwargs)

    def _evaluation_step(self, step: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        """An evaluation step's mean over valid tokens as a share of the whole batch's (every replica's rows), like
        the training step's, so its mean over the replicas (`sync_dist=True`) is one device's loss on that batch."""
        if self.world_size == 1 or not self.token_mean_over_replicas:
            return step(*args, **kwargs)
        if self._evaluation_calls is None:
            self._evaluation_calls = replica_calls(None) or False
        where, calls = f"{type(self.module).__name__}.{name}", self._evaluation_calls or None
        return step_over_replicas(
            lambda: step(*args, **kwargs), group=None, replicas=self.world_size, where=where, calls=calls
        )[0]

    @override
    def configure_ddp(self) -> None:
        # One process: DDP's wrapper would all-reduce every gradient with itself, a bucket copy per backward for the
        # same numbers (measured +4-10% per step on CPU). The module stays as it is, like strategy="auto".
        if self.world_size > 1:
            super().configure_ddp()

    @override
    def _configure_launcher(self) -> None:
        check_nodes(self.num_nodes, self.cluster_environment)  # in the main process, before any launch
        check_launched(self.num_processes, self.cluster_environment)
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        # Our rendezvous (a store per torchrun attempt, a heartbeat); Lightning's then finds the group started.
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend, rank, size = self._get_process_group_backend(), self.global_rank, self.world_size
        device = self.root_device if self.root_device.type != "cpu" else None  # as Lightning's own
        timeout = self._timeout or DEFAULT_TIMEOUT
        start_process_group(
            self.cluster_environment, backend, rank=rank, world_size=size, timeout=timeout, device_id=device
        )
        super().setup_distributed()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        finish_restored_epoch(self.module.trainer)  # a second resume stays exact (lightning_seams says why)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.peer_failure = stop_peers(
            self.launcher,
            exception,
            node_rank=self.node_rank,
            num_processes=self.num_processes,
            hang=name_the_hang(exception),
        )
