"""The shared mesh strategy: the one set-up order every mesh strategy runs (the network's own order, then precision
-> device -> optimizers), the optimizer step over mixed parameter kinds, clipping over the mesh, and finding the
network. Subclasses run their network's order (`parallelize/order.py`: split, shard, checkpointing, compile,
replicas); the processes, mesh and collectives are `mesh_processes.py`'s, checkpoints `sharded_checkpoints.py`'s.

With those two the one place allowed to touch Lightning/Fabric private helpers. It knows nothing about pipelines or
tensor plans.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_parallel.parallelize import SetUp
from lightning_parallel.parallelize.checkpointing import ACTIVATION_CHECKPOINTING, refuse_unrepeatable
from lightning_parallel.parameter_kinds import refuse_unsteppable, then_by_kind
from lightning_parallel.precision import clip_grad_norm_global
from lightning_parallel.replica_calls import ReplicaCalls
from lightning_parallel.seams import changed, fused_steps_on_dtensor
from lightning_parallel.strategies.arguments import check_choice, reject
from lightning_parallel.strategies.mesh_precision import mesh_precision
from lightning_parallel.strategies.mesh_processes import DEFAULT_TIMEOUT
from lightning_parallel.strategies.module_access import ModuleAccess, find_network
from lightning_parallel.strategies.process_group import replica_calls
from lightning_parallel.strategies.sharded_checkpoints import OPTIMIZER_OPTIONS, ShardedCheckpoints
from lightning_parallel.token_mean import step_over_replicas

__all__ = ["DEFAULT_TIMEOUT", "OPTIMIZER_OPTIONS", "MeshStrategy"]


class MeshStrategy(ModuleAccess, ShardedCheckpoints):
    """A multi-process strategy over one DeviceMesh with named dimensions ("dp", "pp", "tp"), set up in one order.

    Args:
        timeout: how long a collective may wait before the run fails (seconds or a timedelta).
        process_group_backend: None picks gloo on CPU and nccl on GPU.
        activation_checkpointing: per block (`parallelize/checkpointing.ACTIVATION_CHECKPOINTING`): "none", "full"
            (recompute each block's forward in backward) or "selective" (keep matmul, attention and convolution
            outputs).
        compile: `torch.compile` each block after it is sharded and before replicas wrap it: True, or a dict of
            `torch.compile` arguments (e.g. {"mode": "max-autotune"}); False for eager.
    """

    def __init__(
        self,
        *,
        activation_checkpointing: str = "none",
        compile: bool | Mapping[str, Any] = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
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
        # The most parameter bytes this rank held while materialising (and sharding) its part; set in `setup`.
        self.setup_peak_parameter_bytes = 0
        self._warned_inexact = False  # the one line for a loss that cannot be one device's, at its first step
        self._token_calls: ReplicaCalls | Literal[False] | None = None  # every replica makes the step's token mean

    # ---- one set-up order; subclasses fill in how the network is split or sharded -------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """The set-up order of every mesh strategy, read top to bottom; a new feature adds a step to the network's
        order (`parallelize/order.py`, run by the subclass's `parallelize`) or a line here. A later fit/validate of
        the same model reuses the first set-up's network."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not self._set_up:
            # split -> plan -> prune -> materialise and shard -> tie -> checkpointing -> compile -> replicas
            done = self.parallelize(trainer, module)
            self.setup_peak_parameter_bytes = done.peak_parameter_bytes
            self._first_step["compiled_blocks"] = done.compiled_blocks
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
    def parallelize(self, trainer: pl.Trainer, module: pl.LightningModule) -> SetUp:
        """Run the strategy's set-up order on the network (`parallelize/order.py`; first set-up of a model only, a
        later fit/validate reuses it)."""

    @abstractmethod
    def network_of(self, module: pl.LightningModule) -> nn.Module:
        """The LightningModule's network (on a pipeline rank: pruned to its own stages' blocks)."""

    def check_block_options(self, network: nn.Module) -> None:
        """Before launch: what activation checkpointing cannot repeat exactly is refused
        (`parallelize/checkpointing.py`)."""
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
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's step; over data-parallel replicas its mean over valid tokens is the whole batch's
        (`token_mean.py`; a pipeline's own step shares it out per micro-batch instead)."""
        replicas = self.dims.dp
        if replicas == 1:
            return self.lightning_step(*args, **kwargs)
        where = f"{type(self.module).__name__}.training_step"
        step = lambda: self.lightning_step(*args, **kwargs)  # noqa: E731
        if self._token_calls is None:
            self._token_calls = replica_calls(self.group("dp")) or False
        calls = self._token_calls or None
        result, inexact = step_over_replicas(step, group=self.group("dp"), replicas=replicas, where=where, calls=calls)
        if inexact is not None and not self._warned_inexact:
            rank_zero_warn(inexact)
            self._warned_inexact = True
        return result

    def lightning_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's own training step (the user's `training_step`), without this strategy's additions."""
        return super().training_step(*args, **kwargs)

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
        return find_network(module, attr, required=required, need=need, owner=type(self).__name__)

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
