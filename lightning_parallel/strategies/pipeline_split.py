"""How the pipeline strategy cuts the LightningModule's network into this rank's stages: before launch, a check that
a split exists; in set-up, the network's inputs found for the split and the set-up order run
(`parallelize.parallelize_pipeline`: split, plan, prune, materialise and shard, tie, checkpointing, compile,
replicas). At pp=1 nothing is cut: the network is placed whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_parallel.parallelize import SetUp, parallelize_pipeline
from lightning_parallel.parallelize.plan import refuse_traced_sharding, resolve_stage_plan
from lightning_parallel.parallelize.split import NetworkInputs, partition_stages
from lightning_parallel.pipeline.call import NetworkCall, network_call
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.pipeline.schedule_plan import ScheduleSpec
from lightning_parallel.pipeline.split import NetworkSplit, network_split
from lightning_parallel.pipeline.tied import TiedGroup
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.user_step import (
    capture_network_inputs,
)


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
            resolve_stage_plan(network, self.plan, self.dims.tp)
            if self.pipelined and not isinstance(network, nn.Sequential):
                refuse_traced_sharding(network, replicas=self.replicas, dp=self.dims.dp)
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
        split = network_split(network, example, call)
        partition_stages(split, spec=self.spec, pp=self.dims.pp, balance=self.balance, block_costs=None)

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
    def parallelize(self, trainer: pl.Trainer, module: pl.LightningModule) -> SetUp:
        """The pipeline's set-up order (`parallelize/order.py`): split -> plan -> prune -> materialise and shard ->
        tie -> activation checkpointing -> compile -> replicas -> deferred BatchNorm; at pp=1 the network placed
        whole (sharded over "tp" as a stage would be)."""
        self._parallelized = True
        done = parallelize_pipeline(self.network_of(module), self, lambda: self._split_inputs(trainer, module))
        if done.stages is not None:  # pp=1 cuts nothing: no split, partition, ties or traced inputs
            stages = done.stages
            self._split, self._partition, self._tied = stages.split, stages.partition, stages.tied
            self._call, self._example = stages.call, stages.example
        self._tensor_plan, self._batchnorms = done.plan, done.batchnorms
        return done

    def _split_inputs(self, trainer: pl.Trainer, module: pl.LightningModule) -> NetworkInputs:
        """The network's inputs, taken from the first batch of the running trainer function: to trace it, to time its
        blocks on (balance='time'), and for a Sequential, when the data offers a batch, to check that its blocks pass
        one tensor on (`split.check_block_outputs`)."""
        network = self.network_of(module)
        batch = None
        step = {"fit": "training_step", "validate": "validation_step", "test": "test_step"}
        if not isinstance(network, nn.Sequential) or self.balance == "time":
            batch = self.first_batch(trainer)
        else:
            with suppress(Exception):  # a check only: no batch to check on is no error
                batch = self.first_batch(trainer)
        fn = trainer.state.fn.value if trainer.state.fn is not None else "predict"
        captured = self._example_inputs(module, batch, step.get(fn, "predict_step"))
        return captured if captured is not None else (None, None)

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
