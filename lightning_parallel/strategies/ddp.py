"""Lightning's own DDP, with the mesh strategies' checks on the other processes: an impossible node count is
refused before launch, and when a run fails the rank that died first is named in one line and no launched rank
is left running (Lightning stops its children only on Ctrl+C)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from typing_extensions import override

from lightning_parallel.seams import finish_restored_epoch
from lightning_parallel.strategies.arguments import check_timeout
from lightning_parallel.strategies.module_access import ModuleAccess
from lightning_parallel.strategies.peers import PeerFailure, check_nodes, stop_peers

DEFAULT_TIMEOUT = default_pg_timeout  # Lightning's own default


class DDPStrategy(ModuleAccess, LightningDDPStrategy):
    """`lightning.pytorch.strategies.DDPStrategy` (same arguments), refusing an impossible `num_nodes` before
    launch and stopping every rank when one fails."""

    peer_failure: PeerFailure | None = None

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
    def configure_ddp(self) -> None:
        # One process: DDP's wrapper would all-reduce every gradient with itself, a bucket copy per backward for the
        # same numbers (measured +4-10% per step on CPU). The module stays as it is, like strategy="auto".
        if self.world_size > 1:
            super().configure_ddp()

    @override
    def _configure_launcher(self) -> None:
        check_nodes(self.num_nodes, self.cluster_environment)  # in the main process, before any launch
        super()._configure_launcher()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        finish_restored_epoch(self.module.trainer)  # a second resume stays exact (seams.py says why)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.peer_failure = stop_peers(
            self.launcher, exception, node_rank=self.node_rank, num_processes=self.num_processes
        )
