"""The shared mesh strategy: launcher, process group with a short timeout, one named DeviceMesh, collectives,
sampler arguments over the data-parallel dimension only, validation before launch.

The ONE module allowed to touch Lightning/Fabric private helpers. It knows nothing about pipelines or
tensor plans; subclasses say how the world splits (`resolve_dims`) and what to check (`validate`).
"""

from __future__ import annotations

import os
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.distributed import (
    DistributedSamplerWrapper,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
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
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler
from typing_extensions import override

from lightning_parallel.blocks import (
    ACTIVATION_CHECKPOINTING,
    blocks_of,
    checkpoint_activations,
    compile_blocks,
    refuse_unrepeatable,
    repeated_kinds,
)
from lightning_parallel.checkpoint import (
    META_FILE,
    MODEL_KEY,
    compare_tensors,
    load_shards,
    partial_path,
    read_meta,
    recover,
    replace_with,
    sharded_tensors,
)
from lightning_parallel.dims import ParallelDims
from lightning_parallel.parameter_kinds import groups_by_kind, refuse_unsteppable, then_by_kind
from lightning_parallel.precision import clip_grad_norm_global
from lightning_parallel.rendezvous import bound_store, listen_address
from lightning_parallel.seams import changed, finish_restored_epoch, fit_weights_only, fused_steps_on_dtensor
from lightning_parallel.strategies.arguments import check_backend, check_choice, check_timeout, reject
from lightning_parallel.strategies.mesh_precision import mesh_precision
from lightning_parallel.strategies.peers import PeerFailure, check_nodes, stop_peers

# Flattened optimizer keys ("state.<param name>.exp_avg") are per parameter: no two ranks write the same
# key with different values, and a checkpoint loads into any other split of the parameters.
OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

DEFAULT_TIMEOUT = timedelta(minutes=5)  # Lightning's default is 30 minutes of a silent hang
# How long rank 0's store waits for the other processes to start (importing torch and Lightning can take 10 s
# on a loaded machine); a child that dies meanwhile ends the run at once through Lightning's process observer.
JOIN_TIMEOUT = timedelta(minutes=5)


class _ValidatingLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, but the strategy checks the model before children start."""

    def __init__(self, strategy: MeshStrategy, *args: Any) -> None:
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


class MeshStrategy(ParallelStrategy):
    """A multi-process strategy over one DeviceMesh with named dimensions ("dp", "pp", "tp").

    Args:
        timeout: how long a collective may wait before the run fails (seconds or a timedelta).
        process_group_backend: None picks gloo on CPU and nccl on GPU.
        activation_checkpointing: per block (`blocks.ACTIVATION_CHECKPOINTING`): "none", "full" (recompute each
            block's forward in backward) or "selective" (keep matmul, attention and convolution outputs).
        compile: `torch.compile` each block after it is sharded and before replicas wrap it: True, or a dict of
            `torch.compile` arguments (e.g. {"mode": "max-autotune"}); False for eager.
    """

    def __init__(
        self,
        *,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        activation_checkpointing: str = "none",
        compile: bool | Mapping[str, Any] = False,
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
        check_choice(
            self, "activation_checkpointing", activation_checkpointing, ACTIVATION_CHECKPOINTING, example="full"
        )
        if not isinstance(compile, (bool, Mapping)):
            reject(self, "compile", compile, "True, False or a dict of torch.compile arguments", "compile=True")
        self.activation_checkpointing = activation_checkpointing
        self.compile_options: dict[str, Any] | None = (
            dict(compile) if isinstance(compile, Mapping) else ({} if compile else None)
        )
        self._set_up = False
        self._first_step: dict[str, float] = {}  # compiled blocks, and the first step's seconds once it ran
        self._first_step_started: float | None = None
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._process_group_backend = process_group_backend
        self._dims: ParallelDims | None = None
        self._mesh: DeviceMesh | None = None
        self._use_distributed_sampler: bool | None = None
        self.num_nodes = 1
        self.peer_failure: PeerFailure | None = None
        # The most parameter bytes this rank held while materialising (and sharding) its part; set in `parallelize`.
        self.setup_peak_parameter_bytes = 0

    @abstractmethod
    def resolve_dims(self, world_size: int) -> ParallelDims:
        """How this strategy splits `world_size` processes; raises ValueError with a fix."""

    def validate(self, module: pl.LightningModule, *, batch: Any = None) -> None:
        """Check the LightningModule before any process is launched (subclasses extend); `batch` is a first
        batch when the data came as a DataLoader."""

    # ---- one set-up order; subclasses fill in how the network is split or sharded -------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """The set-up order of every mesh strategy, read top to bottom; a new feature adds a line here. Per block it
        is torchtitan's: shard -> activation checkpointing -> compile -> replicas. A dimension of size 1 adds nothing.
        A later fit/validate of the same model reuses the first set-up's network."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not self._set_up:
            layers = repeated_kinds(self.network_of(module))  # the whole network's repeated block classes
            self.parallelize(trainer, module)  # split into stages and/or shard over "tp" (subclasses)
            blocks = blocks_of(self.network_of(module))  # this rank's blocks, sharded
            checkpoint_activations([b for b in blocks if type(b) in layers], self.activation_checkpointing)
            self._first_step["compiled_blocks"] = compile_blocks(blocks, self.compile_options)
            self.replicate(trainer, module)  # FSDP2 over "dp", or nothing (subclasses)
            self._set_up = True
        self.precision_plugin = mesh_precision(self.precision_plugin, self)
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        self.on_device(trainer, module)
        self.barrier()
        if trainer.state.fn == "fit":
            fused_steps_on_dtensor()
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                refuse_unsteppable(optimizer)
        self.setup_precision_plugin()

    @abstractmethod
    def parallelize(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Split or shard the network (first set-up of a model only; a later fit/validate reuses it)."""

    @abstractmethod
    def network_of(self, module: pl.LightningModule) -> nn.Module:
        """The LightningModule's network (on a pipeline rank: pruned to its own stages' blocks)."""

    def replicate(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Keep data-parallel replicas in sync by wrapping blocks (FSDP2), after they are sharded and compiled."""

    def check_block_options(self, network: nn.Module) -> None:
        """Before launch: what activation checkpointing cannot repeat exactly is refused (`blocks.py`)."""
        refuse_unrepeatable(network, self.activation_checkpointing)

    def describe_blocks(self) -> dict[str, Any]:
        """For summary.json: the per-block options and, when compiled, the first step's time (which carries the
        compilation: compare it with the later steps' `step_time_s`)."""
        return {
            "activation_checkpointing": self.activation_checkpointing,
            "compile": self.compile_options is not None,
            **self._first_step,
        }

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.compile_options is not None and self._first_step_started is None:
            self._first_step_started = time.perf_counter()
        super().on_train_batch_start(batch, batch_idx)

    def on_device(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """What needs the network converted and on its device (runtimes, gradient hooks, the start line)."""

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # foreach and fused kernels (CUDA's default) take one kind of parameter per call: the update, and only it,
        # runs each param group one kind at a time (`parameter_kinds.py`)
        with ExitStack() as stack:
            result = super().optimizer_step(optimizer, then_by_kind(closure, optimizer, stack), model, **kwargs)
        if self._first_step_started is not None and "first_step_s" not in self._first_step:
            self._first_step["first_step_s"] = time.perf_counter() - self._first_step_started
        return result

    def clip_norm_over_mesh(self, parameters: list[nn.Parameter], max_norm: float) -> None:
        """Clip this rank's `parameters` by one norm over the whole model, as one process would. DTensor
        gradients are summed over their own meshes; `norm_group` adds the ranks holding other plain parts."""
        clip_grad_norm_global(parameters, max_norm, group=self.norm_group(), shared=self.counted_elsewhere())

    def norm_group(self) -> dist.ProcessGroup | None:
        """The ranks whose plain (non-DTensor) gradients are other parts of the same model (pipeline stages)."""
        return None

    def counted_elsewhere(self) -> set[int]:
        """Ids of parameters another rank of `norm_group` also holds and counts (tied weights)."""
        return set()

    def first_batch(self, trainer: pl.Trainer) -> Any:
        """The first batch of the dataloader the running trainer function uses (fit: training)."""
        loops = {
            "fit": trainer.fit_loop,
            "validate": trainer.validate_loop,
            "test": trainer.test_loop,
            "predict": trainer.predict_loop,
        }
        fn = trainer.state.fn
        assert fn is not None  # set by fit/validate/test/predict before set-up
        source = getattr(loops[fn.value], "_data_source", None)
        if not callable(getattr(source, "dataloader", None)):
            raise changed("lightning", "the loops' `_data_source.dataloader()`", "find the first batch")
        loaders = source.dataloader()  # type: ignore[union-attr]
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0]
        elif isinstance(loaders, dict):
            loaders = next(iter(loaders.values()))
        return next(iter(loaders))

    def find_network(self, module: pl.LightningModule, required: type[nn.Module], need: str) -> Any:
        """The network: `module.<network_attr>`, or with no attribute named, the one child module holding
        parameters (`self.model`, `self.net`, ...). Otherwise one clear error naming what this strategy needs."""
        attr: str | None = self.network_attr  # type: ignore[attr-defined]
        where = type(module).__name__
        if attr is None:
            candidates = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
            if len(candidates) != 1:
                found = f"candidates {candidates}" if candidates else "no child module with parameters"
                raise ValueError(
                    f"cannot tell which attribute of {where} is the network ({found}). HINT: keep the network in "
                    f"one attribute (self.model = MyNetwork()), or pass network_attr='<attribute>' to "
                    f"{type(self).__name__}"
                )
            attr = candidates[0]
        network = getattr(module, attr, None)
        if not isinstance(network, required):
            found = type(network).__name__ if network is not None else "nothing"
            raise ValueError(
                f"{need} at `{where}.{attr}`; found {found}. HINT: store it there, or pass "
                f"network_attr='<attribute>' to {type(self).__name__}"
            )
        return network

    def refuse_meta_outside(self, module: pl.LightningModule, network: nn.Module) -> None:
        """The strategy materialises only the network; anything else built under trainer.init_module() (a
        metric's states, a loss's weights) would stay on the meta device and fail after launch."""
        inside = {id(m) for m in network.modules()}
        stray = []
        for name, child in module.named_modules():
            if id(child) in inside:
                continue
            tensors = [*child.parameters(recurse=False), *child.buffers(recurse=False)]
            tensors += [v for v in getattr(child, "_defaults", {}).values() if isinstance(v, torch.Tensor)]  # metrics
            if any(t.is_meta for t in tensors):
                stray.append(f"{name} ({type(child).__name__})")
        if stray:
            raise ValueError(
                f"{', '.join(stray)} of {type(module).__name__} are on the meta device (built under "
                "trainer.init_module()), and the strategy materialises only the network. HINT: build just the "
                "network inside it (with trainer.init_module(): net = Net()) and the LightningModule outside"
            )

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
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, **self._rendezvous())
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

    def _rendezvous(self) -> dict[str, Any]:
        """A store listening on the main address only (loopback for one machine, MASTER_ADDR across nodes),
        unless torchrun's agent hosts the store or the address is a host name (`rendezvous.listen_address`)."""
        environment = self.cluster_environment
        assert environment is not None
        if _distributed_is_initialized():
            return {}  # a later fit in the same processes reuses the group (and its store)
        address = listen_address(environment.main_address)
        if address is None:
            return {}
        store = bound_store(
            address,
            environment.main_port,
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=max(self._timeout, JOIN_TIMEOUT),  # a short `timeout` is for hung collectives, not slow starts
        )
        return {"store": store}

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
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None  # training has started
        finish_restored_epoch(self.lightning_module.trainer)  # a second resume stays exact (seams.py says why)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.peer_failure = stop_peers(
            self.launcher, exception, node_rank=self.node_rank, num_processes=self.num_processes
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
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model must be split and the optimizers built before state can load into them

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        assert self.lightning_module is not None
        return optimizer_state_dict(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank writes its shards into `<path>.partial`; rank 0 then swaps it in for `<path>`."""
        path = Path(self.broadcast(str(filepath)))
        partial = partial_path(path)
        if self.is_global_zero:
            recover(path.parent)  # what a run killed during an earlier save left behind
        self.barrier()
        shards = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
        shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(shards, checkpoint_id=str(partial))
        if self.is_global_zero:
            torch.save(checkpoint, partial / META_FILE)
        self.barrier()
        if self.is_global_zero:
            replace_with(partial, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model and optimizer shards in place and return the rest. Nothing in the files runs as code unless
        `trainer.fit(..., weights_only=False)` says the checkpoint is trusted (None means True, as in torch)."""
        module = self.lightning_module
        assert module is not None
        if weights_only is None:
            weights_only = fit_weights_only()  # Lightning 2.6 does not pass it to strategies that restore after setup
        trusted = weights_only is False
        path = Path(self.broadcast(str(checkpoint_path)))
        meta = read_meta(path, weights_only=not trusted)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(module)}
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"] = optimizer_state_dict(module, optimizer)
        expected = {k: tuple(v.shape) for k, v in state[MODEL_KEY].items()}  # this rank's part, global shapes
        compare_tensors(path, sharded_tensors(path, weights_only=not trusted), expected, whole=False)
        load_shards(state, path, weights_only=not trusted)
        set_model_state_dict(module, state[MODEL_KEY], options=StateDictOptions(strict=module.strict_loading))
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"], options=OPTIMIZER_OPTIONS)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # already loaded, shard by shard, in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # already loaded in load_checkpoint


def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """DCP's flattened state dict of `optimizer`. DCP first steps an optimizer that has no state yet (at lr 0), and
    that step too takes one parameter kind at a time; flattened keys name parameters, so the split never shows."""
    with groups_by_kind(optimizer):
        return get_optimizer_state_dict(module, optimizer, options=OPTIMIZER_OPTIONS)
