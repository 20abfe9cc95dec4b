"""The processes a mesh strategy runs on: launch (checking the model before any child starts), the rendezvous and
process group with a short timeout, one named DeviceMesh over them, collectives, and data loaders sharded over the
data-parallel replicas only. Knows nothing of networks, pipelines or tensor plans.

With `strategies/sharded_checkpoints.py` and `strategies/base.py` the one place allowed to touch Lightning/Fabric
private helpers.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    DistributedSamplerWrapper,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader, has_iterable_dataset
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler
from typing_extensions import override

from lightning_parallel.dims import ParallelDims
from lightning_parallel.seams import changed
from lightning_parallel.strategies.arguments import check_backend, check_timeout
from lightning_parallel.strategies.peers import PeerFailure, check_launched, check_nodes, stop_peers
from lightning_parallel.strategies.process_group import name_the_hang, start_process_group

DEFAULT_TIMEOUT = timedelta(minutes=5)  # Lightning's default is 30 minutes of a silent hang


class _ValidatingLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, but the strategy checks the model before children start."""

    def __init__(self, strategy: MeshProcesses, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None and trainer.lightning_module is not None:
            # fit/validate/test/predict(model, dataloaders, ...): a loader given directly offers a first batch
            module = trainer.lightning_module
            loaders = [a for a in args if isinstance(a, DataLoader)]
            if not loaders and trainer.state.fn == "fit" and is_overridden("train_dataloader", module):
                loaders = [module.train_dataloader()]  # the module's own loader hook (BoringModel's style)
            batch = next(iter(loaders[0])) if loaders and isinstance(loaders[0], DataLoader) else None
            self._strategy.validate(module, batch=batch)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class MeshProcesses(ParallelStrategy):
    """Processes over one DeviceMesh with named dimensions ("dp", "pp", "tp"); subclasses say how the world splits
    (`resolve_dims`) and what to check before launch (`validate`).

    Args:
        timeout: how long a collective may wait before the run fails (seconds or a timedelta).
        process_group_backend: None picks gloo on CPU and nccl on GPU.
    """

    def __init__(
        self,
        *,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
        )
        check_timeout(self, timeout)  # a negative one would only fail later, inside the launched processes
        check_backend(self, process_group_backend)
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._process_group_backend = process_group_backend
        self._dims: ParallelDims | None = None
        self._mesh: DeviceMesh | None = None
        self._use_distributed_sampler: bool | None = None
        self.num_nodes = 1
        self.peer_failure: PeerFailure | None = None

    @abstractmethod
    def resolve_dims(self, world_size: int) -> ParallelDims:
        """How this strategy splits `world_size` processes; raises ValueError with a fix."""

    def validate(self, module: pl.LightningModule, *, batch: Any = None) -> None:
        """Check the LightningModule before any process is launched (subclasses extend); `batch` is a first
        batch when the data came as a DataLoader."""

    @property
    def dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError(f"{type(self).__name__}.dims is known only once the Trainer has set the devices")
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__}.device_mesh exists only after the processes have started")
        return self._mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning syncs `self.log(..., sync_dist=True)` and injects samplers only for strategies it
        # knows, or that say so here.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every pipeline and tensor rank of one replica must see the same batch.
        coords = self.dims.coords(self.global_rank)
        return {"num_replicas": self.dims.dp, "rank": coords[0]}

    @override
    def _configure_launcher(self) -> None:
        # Runs in the main process when the Trainer is built: the place to fail before any launch.
        check_nodes(self.num_nodes, self.cluster_environment)
        check_launched(self.num_processes, self.cluster_environment)  # torchrun/srun: before root_device is read
        self._dims = self.resolve_dims(self.num_processes * self.num_nodes)
        self._dims.check_tp_fits_nodes(self.num_processes)  # tp inside a node; pp and dp may cross nodes
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _ValidatingLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        start_process_group(
            self.cluster_environment, backend, rank=self.global_rank, world_size=self.world_size, timeout=self._timeout
        )
        self._dims = self.resolve_dims(self.world_size)
        self._check_placement()
        self._mesh = self.dims.build_mesh(self.root_device.type, timeout=self._timeout)
        self._take_over_sampler_injection()

    def _check_placement(self) -> None:
        """Across nodes, check where the launcher really put each rank (SLURM may deal them out round-robin):
        a tensor-parallel group split over nodes would run, only slowly. Every rank sees the same list."""
        if self.num_nodes == 1 or self.dims.tp == 1:
            return
        nodes: list[Any] = [None] * self.world_size
        dist.all_gather_object(nodes, self.node_rank)
        self.dims.check_tp_placement(nodes)

    def _take_over_sampler_injection(self) -> None:
        """Lightning injects a shuffling DistributedSampler into the training loader of any distributed
        strategy, even where there is one replica and even under `shuffle=False`; `process_dataloader` does it
        instead, keeping the user's choice. The user's `use_distributed_sampler` is kept and honoured."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is None:
            return
        connector: Any = getattr(trainer, "_accelerator_connector", None)
        if not hasattr(connector, "use_distributed_sampler"):
            raise changed(
                "lightning", "Trainer._accelerator_connector.use_distributed_sampler", "keep samplers per replica"
            )
        if self._use_distributed_sampler is None:
            self._use_distributed_sampler = connector.use_distributed_sampler
        connector.use_distributed_sampler = False

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Shard a loader over the data-parallel replicas only, keeping its shuffle choice; at one replica, or
        with `use_distributed_sampler=False`, leave it exactly as the user built it."""
        if (
            not self._use_distributed_sampler
            or self.dims.dp == 1
            or not isinstance(dataloader, DataLoader)
            or isinstance(dataloader.sampler, DistributedSampler)
            or has_iterable_dataset(dataloader)
        ):
            return dataloader
        sampler = dataloader.sampler
        kwargs: dict[str, Any] = {"num_replicas": self.dims.dp, "rank": self.dims.coords(self.global_rank)[0]}
        kwargs["seed"] = int(os.getenv("PL_GLOBAL_SEED", 0))
        predicting = self.lightning_module is not None and self.lightning_module.trainer.predicting
        new: Sampler
        if predicting:
            new, mode = UnrepeatedDistributedSamplerWrapper(sampler, shuffle=False, **kwargs), RunningStage.PREDICTING
        elif isinstance(sampler, (RandomSampler, SequentialSampler)):
            new = DistributedSampler(dataloader.dataset, shuffle=isinstance(sampler, RandomSampler), **kwargs)
            mode = None
        else:
            new, mode = DistributedSamplerWrapper(sampler, shuffle=False, **kwargs), None
        return _update_dataloader(dataloader, new, mode=mode)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # as Lightning's DDPStrategy does: the rank is an attribute set on the (overloaded) function itself
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.peer_failure = stop_peers(
            self.launcher,
            exception,
            node_rank=self.node_rank,
            num_processes=self.num_processes,
            hang=name_the_hang(exception),
        )

    @override
    def teardown(self) -> None:
        module = self._lightning_module
        if module is None or not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            super().teardown()
            return
        # A run that stopped before materialising: Lightning's move to the CPU would raise "Cannot copy out of
        # meta tensor" and hide the error that stopped it.
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of this rank along one mesh dimension ("dp", "pp" or "tp")."""
        return self.device_mesh.get_group(dim)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- sharded checkpoints (DCP), keyed by original parameter names ----------------------------
