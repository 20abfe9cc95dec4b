"""How the pipeline strategy cuts the LightningModule's network into this rank's stages, before launch (a check
that a split exists) and in set-up (split, prune to this rank's blocks, materialise or shard them over "tp", tie
weights across stages; replicas afterwards). At pp=1 nothing is cut: the network is placed whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_parallel.pipeline.batchnorm import defer_batchnorm
from lightning_parallel.pipeline.call import NetworkCall, network_call
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.pipeline.profile import measure_block_costs
from lightning_parallel.pipeline.schedule_plan import ScheduleSpec
from lightning_parallel.pipeline.split import NetworkSplit, TracedSplit, network_split
from lightning_parallel.pipeline.tied import TiedGroup, broadcast_tied_values, refuse_ties_within_a_rank
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.stage_sharding import (
    refuse_traced_sharding,
    resolve_stage_plan,
    shard_over_replicas,
    shard_stage,
)
from lightning_parallel.strategies.user_step import (
    capture_network_inputs,
)
from lightning_parallel.weights import materialize, parameter_bytes


class PipelineSplit(MeshStrategy):
    """The split half of `PipelineParallelStrategy` (its arguments and `__init__` live there)."""

    balance: Any
    plan: Mapping[str, str] | str | None
    replicas: str
    deferred_batchnorm: bool
    network_attr: str | None
    _microbatches: int | None
    _spec: ScheduleSpec | None
    _partition: Partition | None
    _split: NetworkSplit | None
    _tied: list[TiedGroup]
    _example: tuple[torch.Tensor, ...] | None
    _call: NetworkCall | None
    _tensor_plan: tuple[str, dict[str, str], dict[str, str]] | None
    _batchnorms: list[_BatchNorm]
    _parallelized: bool

    def microbatches_for(self, pp: int) -> int:
        return self._microbatches if self._microbatches is not None else 2 * pp

    @property
    def spec(self) -> ScheduleSpec:
        if self._spec is None:
            raise RuntimeError("the schedule is resolved once the Trainer knows the devices")
        return self._spec

    @property
    def pipelined(self) -> bool:
        """Whether a schedule runs. At one stage (pp=1) the network runs whole with the user's step unchanged: no
        split, schedule or micro-batches, as on one device (a dimension of size 1 adds nothing to the step)."""
        return self.dims.pp > 1

    @property
    def partition(self) -> Partition:
        if self._partition is None:
            raise RuntimeError("the partition exists once the strategy is set up")
        return self._partition

    @override
    def validate(self, module: pl.LightningModule, *, batch: Any = None) -> None:
        network = self.network_of(module)
        if self._parallelized:
            return  # already split (e.g. trainer.validate after fit): the pruned network would mislead
        self.check_block_options(network)
        if self.pipelined and not isinstance(network, nn.Sequential):
            self.refuse_block_options_when_traced(network)
        self.refuse_meta_outside(module, network)
        if self.dims.tp > 1:
            _, plan, _ = resolve_stage_plan(network, self.plan, self.dims.tp)
            if self.pipelined and not isinstance(network, nn.Sequential):
                refuse_traced_sharding(network, plan, [], replicas=self.replicas, dp=self.dims.dp)
        if not self.pipelined:
            return
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(module).__name__} uses manual optimization; PipelineParallelStrategy runs forward and "
                "backward together in its schedule inside training_step. HINT: use automatic optimization, or "
                "strategy='ddp' / 'tensor'"
            )
        captured = self._example_inputs(module, batch, "training_step")
        if captured is None and not isinstance(network, nn.Sequential):
            return  # traced in setup, where the data module's first batch exists
        # Checks the split is possible (it traces, enough blocks, a valid explicit split); a time-balanced
        # split is measured later, in setup, where a sample batch exists.
        call, example = captured if captured is not None else (None, None)
        self._plan_split(network_split(network, example, call), None)

    def network_of(self, module: pl.LightningModule) -> nn.Module:
        return self.find_network(module, nn.Module, "pipeline parallelism needs the network as an nn.Module")

    def refuse_block_options_when_traced(self, network: nn.Module) -> None:
        """Stages traced from a custom forward run torch.fx graphs, not the blocks' own forwards, so per-block
        compile and activation checkpointing cannot reach them yet."""
        asked = [
            f"{name}={value!r}"
            for name, value, off in (
                ("activation_checkpointing", self.activation_checkpointing, "none"),
                ("compile", self.compile_options is not None, False),
            )
            if value != off
        ]
        if asked:
            raise ValueError(
                f"{', '.join(asked)} is not supported yet for {type(network).__name__}, which is split into "
                f"{self.dims.pp} stages by tracing (it is not an nn.Sequential). HINT: write the network as an "
                "nn.Sequential of blocks, or use pipeline_parallel_size=1 / strategy='tensor'"
            )

    def _example_inputs(
        self, module: pl.LightningModule, batch: Any, step: str
    ) -> tuple[NetworkCall, tuple[torch.Tensor, ...]] | None:
        """How the network is called and the tensors it receives: from `example_input_array` through forward,
        else from `batch` through the user's own step (stopped at the network call)."""
        network = self.network_of(module)
        example = getattr(module, "example_input_array", None)
        if example is not None:
            given = example if isinstance(example, tuple) else (example,)
            args, kwargs = capture_network_inputs(lambda: module(*given), network, module)
        elif batch is None:
            return None
        else:
            args, kwargs = capture_network_inputs(lambda: getattr(module, step)(batch, 0), network, module)
        return network_call(network, args, kwargs)

    def _plan_split(self, split: NetworkSplit, block_costs: list[float] | None) -> Partition:
        balance = self.balance
        if balance is None:  # FLOPs need a trace; a Sequential's children are split by parameters, as before
            balance = "parameters" if isinstance(split.network, nn.Sequential) else "flops"
        elif balance == "time" and block_costs is None:
            balance = "parameters"  # before launch: only checks that a split exists; setup measures the times
        partition = split.partition(
            pp=self.dims.pp,
            stages_per_rank=self.spec.stages_per_rank,
            style=self.spec.style,
            balance=balance,
            block_costs=block_costs,
        )
        if self.spec.splits_backward:
            refuse_ties_within_a_rank(split.tied_blocks(), partition.stages, partition.stage_to_rank, self.spec.name)
        self._tied = split.tied_across_ranks(partition)
        return partition

    def _measured_costs(self, network: nn.Module) -> list[float]:
        """Rank 0 times every block on one micro-batch of the network's own inputs; every rank uses its
        numbers, so splits agree."""
        costs: list[list[float] | None] = [None]
        if self.global_rank == 0:
            if not self._example:
                raise ValueError(
                    "balance='time' needs a sample input to time the blocks on. HINT: set `example_input_array` "
                    "on the LightningModule, give the Trainer data, or use balance='parameters'"
                )
            sample = self._example[0]
            sample = sample[: max(1, len(sample) // self.microbatches_for(self.dims.pp))]
            costs[0] = measure_block_costs(network, sample, device=self.root_device)  # type: ignore[arg-type]
        dist.broadcast_object_list(costs, src=0)
        assert costs[0] is not None
        return costs[0]

    # ---- set-up in every process ---------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        # Models built under trainer.init_module() start on the meta device; setup() materialises
        # only this rank's stages, so no rank ever holds the whole model.
        device = torch.device("meta") if empty_init is not False else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def parallelize(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._parallelized = True
        network = self.network_of(module)
        if not self.pipelined:
            self._place_whole(network)
            return
        batch = None
        step = {"fit": "training_step", "validate": "validation_step", "test": "test_step"}
        # The network's inputs: to trace it, to time its blocks on (balance='time'), and for a Sequential, when the
        # data offers a batch, to check that its blocks pass one tensor on (`split.check_block_outputs`)
        if not isinstance(network, nn.Sequential) or self.balance == "time":
            batch = self.first_batch(trainer)
        else:
            with suppress(Exception):  # a check only: no batch to check on is no error
                batch = self.first_batch(trainer)
        fn = trainer.state.fn.value if trainer.state.fn is not None else "predict"
        captured = self._example_inputs(module, batch, step.get(fn, "predict_step"))
        self._call, self._example = captured if captured is not None else (None, None)
        self._split = network_split(network, self._example, self._call)
        costs = self._measured_costs(network) if self.balance == "time" else None
        self._partition = self._plan_split(self._split, costs)
        traced = isinstance(self._split, TracedSplit)
        if self.dims.tp > 1:
            self._tensor_plan = resolve_stage_plan(network, self.plan, self.dims.tp)  # whole network, before pruning
            if traced:  # traced stages compute on the planned modules' DTensor shards (`tensor/traced_stages.py`)
                refuse_traced_sharding(
                    network, self._tensor_plan[1], self._tied, replicas=self.replicas, dp=self.dims.dp
                )
        self._split.prune(self.partition.blocks_of(self.pp_rank))
        if self._tensor_plan is None:
            materialize(network, self.root_device)
            self.setup_peak_parameter_bytes = parameter_bytes(network)
        else:
            mesh, group = self.device_mesh["tp"], self.group("tp")
            self.setup_peak_parameter_bytes = shard_stage(
                network, self._tensor_plan[1], mesh, group, self.root_device, traced=traced
            )
        broadcast_tied_values(network, self._tied, self.group("pp"))

    @override
    def replicate(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        network = self.network_of(module)
        if self.replicas == "fsdp" and self.dims.dp > 1:
            shard_over_replicas(network, self.device_mesh["dp"], self._tied)
        if self.deferred_batchnorm and self.pipelined:
            self._batchnorms = defer_batchnorm(network)

    def _place_whole(self, network: nn.Module) -> None:
        """pp=1: the whole network on this rank, sharded over "tp" as a stage would be."""
        if self.dims.tp > 1:
            self._tensor_plan = resolve_stage_plan(network, self.plan, self.dims.tp)
            mesh, group = self.device_mesh["tp"], self.group("tp")
            self.setup_peak_parameter_bytes = shard_stage(network, self._tensor_plan[1], mesh, group, self.root_device)
        else:
            materialize(network, self.root_device)
            self.setup_peak_parameter_bytes = parameter_bytes(network)

    def describe_layout(self) -> str:
        if not self.pipelined:
            return f"dp={self.dims.dp} x pp=1 x tp={self.dims.tp}, no split, schedule or micro-batches"
        return (
            f"dp={self.dims.dp} x pp={self.dims.pp} x tp={self.dims.tp}, {len(self.partition.stages)} stages, "
            f"{self.microbatches_for(self.dims.pp)} micro-batches requested"
        )

    # ---- what it costs -------------------------------------------------------------------------

    @property
    def pp_rank(self) -> int:
        return self.device_mesh.get_local_rank("pp")
