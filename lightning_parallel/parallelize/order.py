"""The set-up order of each strategy family, read top to bottom: one numbered step per line, as torchtitan's
`parallelize_*` functions read. Each step is a function in its own module that returns at once where its dimension
has size 1 (no split at pp=1, no shard at tp=1, no FSDP2 at dp=1), so a branch lives inside a step, never between
them. What follows set-up (precision, device, runtime, optimizers) is `strategies/base.py`'s `MeshStrategy.setup`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_parallel.blocks import blocks_of, repeated_kinds
from lightning_parallel.dims import ParallelDims
from lightning_parallel.parallelize.checkpointing import checkpoint_activations
from lightning_parallel.parallelize.compilation import compile_blocks
from lightning_parallel.parallelize.materialize import materialize_layers, materialize_stages
from lightning_parallel.parallelize.plan import Plan, plan_layers, plan_stages
from lightning_parallel.parallelize.replicas import shard_layers_over_replicas, shard_stages_over_replicas
from lightning_parallel.parallelize.split import NetworkInputs, Stages, keep_own_stages, split_network
from lightning_parallel.parallelize.tie import tie_across_stages
from lightning_parallel.pipeline.batchnorm import defer_over_microbatches
from lightning_parallel.pipeline.schedule_plan import ScheduleSpec
from lightning_parallel.pipeline.split import Balance


class Settings(Protocol):
    """What every mesh strategy's sizes and arguments say (`strategies/base.py`)."""

    @property
    def dims(self) -> ParallelDims: ...
    @property
    def device_mesh(self) -> DeviceMesh: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def plan(self) -> Mapping[str, str] | str | None: ...
    @property
    def activation_checkpointing(self) -> str: ...
    @property
    def compile_options(self) -> dict[str, Any] | None: ...


class PipelineSettings(Settings, Protocol):
    """The pipeline strategy's (`strategies/pipeline.py`)."""

    @property
    def spec(self) -> ScheduleSpec: ...
    @property
    def balance(self) -> Balance | None: ...
    @property
    def replicas(self) -> str: ...
    @property
    def deferred_batchnorm(self) -> bool: ...
    def microbatches_for(self, pp: int) -> int: ...


class TensorSettings(Settings, Protocol):
    """The tensor strategy's (`strategies/tensor.py`)."""

    @property
    def sequence_parallel(self) -> bool: ...


@dataclass(frozen=True)
class SetUp:
    """What set-up leaves for the strategy: the most parameter bytes this rank held while materialising (and
    sharding) its part, and how many blocks were compiled."""

    peak_parameter_bytes: int
    compiled_blocks: int


@dataclass(frozen=True)
class PipelineSetUp(SetUp):
    """Also the cut (None at pp=1), the tensor plan (None at tp=1), and the BatchNorms whose statistics wait for
    the whole mini-batch."""

    stages: Stages | None
    plan: Plan | None
    batchnorms: list[_BatchNorm]


@dataclass(frozen=True)
class TensorSetUp(SetUp):
    """Also the plan (resolved at tp=1 too, for summary.json)."""

    plan: Plan


def parallelize_pipeline(network: nn.Module, s: PipelineSettings, inputs: Callable[[], NetworkInputs]) -> PipelineSetUp:
    """The pipeline strategy's set-up of its network, any of dp x pp x tp. `inputs`: how the network is called and
    on what, asked for only when it is cut (to trace it, or time its blocks)."""
    dims, mesh, device = s.dims, s.device_mesh, s.root_device
    repeated = repeated_kinds(network)  # the block classes checkpointed: those repeating in the whole network
    # 1. split: where the whole network is cut into stages, and which parameters stages share
    microbatches = s.microbatches_for(dims.pp)
    stages = split_network(network, inputs, dims, s.spec, s.balance, microbatches=microbatches, device=device)
    # 2. plan: the layers sharded over "tp", resolved on the whole network by their original names (a parameter
    #    tied across stages sharded alike by every holder, or kept whole)
    plan, stages = plan_stages(network, s.plan, dims=dims, stages=stages, replicas=s.replicas)
    # 3. prune: this rank keeps its own stages' blocks (on the meta device still, when built there)
    keep_own_stages(stages, mesh)
    # 4. materialise and shard: one process's values, each planned layer sharded over "tp" as it gets them (one
    #    step, not two: no rank ever holds even its own part unsharded)
    peak = materialize_stages(network, plan, stages, mesh, device)
    # 5. tie: a parameter shared by stages on several ranks starts from one value on all of them
    tie_across_stages(network, stages, mesh)
    blocks = blocks_of(network)  # this rank's blocks, sharded
    # 6. activation checkpointing, per block of the repeating kinds
    checkpoint_activations([b for b in blocks if type(b) in repeated], s.activation_checkpointing)
    # 7. compile, per block (the checkpointed forward with it)
    compiled = compile_blocks(blocks, s.compile_options)
    # 8. replicas: FSDP2 over "dp" wraps each block (replicas="fsdp"; "replicate" all-reduces at each step)
    shard_stages_over_replicas(network, stages, mesh, replicas=s.replicas, dp=dims.dp)
    # 9. BatchNorm: running statistics from the whole mini-batch, not each micro-batch (deferred_batchnorm)
    batchnorms = defer_over_microbatches(network, deferred=s.deferred_batchnorm, pp=dims.pp)
    return PipelineSetUp(peak, compiled, stages, plan, batchnorms)


def parallelize_tensor(module: nn.Module, network: nn.Module, s: TensorSettings, *, configured: bool) -> TensorSetUp:
    """The tensor strategy's set-up of `module`'s network, dp x tp, the pipeline's order without steps 1, 3, 5 and
    9 (every rank holds the whole network and runs whole batches). `configured`: the module's `configure_model()`
    sharded the network itself (Lightning called it before set-up); steps 2 and 4 then leave it as it is."""
    dims, mesh, device = s.dims, s.device_mesh, s.root_device
    repeated = repeated_kinds(network)  # the block classes checkpointed: those repeating in the network
    # 2. plan: the layers sharded over "tp" (resolved at tp=1 too, where it is reported and not applied)
    plan = plan_layers(network, s.plan, tp=dims.tp, sequence_parallel=s.sequence_parallel, configured=configured)
    # 4. materialise and shard: one process's values, each planned layer sharded over "tp" as it gets them
    peak = materialize_layers(network, plan, mesh, device, tp=dims.tp, sequence_parallel=s.sequence_parallel)
    blocks = blocks_of(network)  # the network's blocks, sharded
    # 6. activation checkpointing, per block of the repeating kinds
    checkpoint_activations([b for b in blocks if type(b) in repeated], s.activation_checkpointing)
    # 7. compile, per block (the checkpointed forward with it)
    compiled = compile_blocks(blocks, s.compile_options)
    # 8. replicas: FSDP2 over "dp" wraps each block, then the network (unless configure_model() did)
    shard_layers_over_replicas(module, network, mesh, dp=dims.dp)
    return TensorSetUp(peak, compiled, plan)
