"""PipelineParallelStrategy: the LightningModule's network is cut into stages on different ranks and
micro-batches flow through them (torch.distributed.pipelining), while the user's code stays single-device.

This file holds its arguments, sizes and summary; a chain of classes holds the rest, one concept each: how the
network is cut into this rank's stages (`pipeline_split.py`), the pipelined step (`pipeline_step.py`) and evaluation
(`pipeline_eval.py`). Splitting math lives in `pipeline/partition.py`, the schedule mechanics in `pipeline/runtime.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_parallel.dims import ParallelDims
from lightning_parallel.pipeline.call import NetworkCall
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.pipeline.runtime import PipelineRuntime
from lightning_parallel.pipeline.schedule_plan import SCHEDULES, ScheduleSpec, resolve_schedule
from lightning_parallel.pipeline.split import NetworkSplit
from lightning_parallel.pipeline.tied import TiedGroup
from lightning_parallel.strategies.arguments import check_bool, check_choice, check_int, check_name, reject
from lightning_parallel.strategies.base import DEFAULT_TIMEOUT
from lightning_parallel.strategies.pipeline_eval import PipelinedEvaluation
from lightning_parallel.strategies.pipeline_summary import describe_pipeline, describe_whole
from lightning_parallel.strategies.tensor import check_plan_argument
from lightning_parallel.strategies.user_step import (
    MicroSteps,
)
from lightning_parallel.tensor.sharded_logits import Counts, describe_loss

BALANCES = ("flops", "parameters", "time")  # how a split is balanced, besides explicit block names per stage
REPLICAS = ("replicate", "fsdp")  # how data-parallel replicas of the pipeline stay in sync


class PipelineParallelStrategy(PipelinedEvaluation):
    """Pipeline parallelism (optionally x data parallelism) as a Lightning strategy.

    Contract with the LightningModule: the network is an `nn.Sequential` of named blocks (found by itself, or at
    `network_attr`), and `training_step` calls it once and returns a loss computed from its output.

    Args:
        microbatches: micro-batches per step (default 2 x stages); fewer when a batch needs it.
        schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv, dualpipev.
        stages_per_rank: virtual stages per rank for multi-stage schedules (default 2 for them, else 1).
        pipeline_parallel_size: pipeline ranks; None derives it from the devices (with data_parallel_size 1 when
            that is None too).
        data_parallel_size: replicas; devices = data_parallel_size x pipeline ranks x tensor_parallel_size. None
            derives it from the devices when pipeline_parallel_size is given, else means 1.
        tensor_parallel_size: ranks sharing each stage's layers (tensor parallelism inside every stage, "3D" with
            data parallelism); 1 = none. The stages' layers are sharded by `plan`.
        replicas: how data-parallel replicas stay in sync: "replicate" (each holds its stages whole; gradients
            all-reduced once per optimizer step) or "fsdp" (FSDP2 over "dp" shards each block's parameters, gradients
            and optimizer state across replicas; gradients reduce-scattered in each backward).
        plan: with tensor_parallel_size > 1, {module pattern: style} (see `lightning_parallel.tensor.STYLES`),
            "auto", or None for the network's own `tp_plan` (else "auto"), as in TensorParallelStrategy.
        balance: "flops" (estimated compute; the default for traced networks), "parameters" (the default for an
            nn.Sequential), "time" (measure each block of an nn.Sequential), or explicit block names per stage.
        deferred_batchnorm: update BatchNorm running statistics once per mini-batch from all its
            micro-batches (as one process would); normalisation always uses micro-batch statistics.
        network_attr: the LightningModule's attribute holding the network; None finds the one child with
            parameters (the error lists the candidates when there are several).
        timeout: seconds (or timedelta) a collective may wait before the run fails.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        *,
        microbatches: int | None = None,
        schedule: str = "1f1b",
        stages_per_rank: int | None = None,
        pipeline_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        tensor_parallel_size: int = 1,
        replicas: str = "replicate",
        plan: Mapping[str, str] | str | None = None,
        balance: str | Sequence[Sequence[str]] | None = None,
        deferred_batchnorm: bool = False,
        network_attr: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend, **kwargs)
        check_int(self, "microbatches", microbatches, example=4, optional=True)
        check_choice(self, "schedule", schedule, SCHEDULES, example="1f1b")
        check_int(self, "stages_per_rank", stages_per_rank, example=2, optional=True)
        check_int(self, "pipeline_parallel_size", pipeline_parallel_size, example=2, optional=True)
        check_int(self, "data_parallel_size", data_parallel_size, example=1, optional=True)
        check_int(self, "tensor_parallel_size", tensor_parallel_size, example=2)
        check_plan_argument(self, plan)
        check_choice(self, "replicas", replicas, REPLICAS, example="replicate")
        # block names per stage are checked against the network before launch (`balance.split_explicit`)
        explicit = isinstance(balance, Sequence) and not isinstance(balance, str)
        if not (balance is None or balance in BALANCES or explicit):
            expected = f"None, one of {', '.join(BALANCES)}, or block names per stage"
            reject(self, "balance", balance, expected, "balance='parameters', or [['0', '1'], ['2', '3']]")
        check_bool(self, "deferred_batchnorm", deferred_batchnorm)
        check_name(self, "network_attr", network_attr, example="model")
        self.schedule = schedule
        self._microbatches = microbatches
        self._stages_per_rank = stages_per_rank
        self.pipeline_parallel_size = pipeline_parallel_size
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.replicas = replicas
        self.plan = dict(plan) if isinstance(plan, Mapping) else plan
        self._tensor_plan: tuple[str, dict[str, str], dict[str, str]] | None = None
        self._logit_counts = Counts()  # vocabulary-parallel losses and gathers of the logits (`sharded_logits.py`)
        self._gradient_hooks: list[RemovableHandle] = []
        self.balance = balance
        self.deferred_batchnorm = deferred_batchnorm
        self._batchnorms: list[_BatchNorm] = []
        self.network_attr = network_attr
        self._micro_steps: MicroSteps | None = None
        self._step_rest: tuple[Any, ...] = ()
        self._step_kwargs: dict[str, Any] = {}
        self._spec: ScheduleSpec | None = None
        self._partition: Partition | None = None
        self._split: NetworkSplit | None = None
        self._tied: list[TiedGroup] = []
        self._example: tuple[torch.Tensor, ...] | None = None
        self._call: NetworkCall | None = None
        self._runtime: PipelineRuntime | None = None
        self._parallelized = False
        self._fresh_grads: list[torch.Tensor | None] | None = None
        self._window_done = True  # an optimizer step ended the last window (or none began): see pipeline_step
        self._local_params: list[nn.Parameter] | None = None

    # ---- sizes and validation (main process, before launch) -------------------------------------
    @override
    def resolve_dims(self, world_size: int) -> ParallelDims:
        dp, pp = self.data_parallel_size, self.pipeline_parallel_size
        if dp is None and pp is None:
            dp = 1  # the pipeline takes every device left
        dims = ParallelDims.resolve(world_size, dp=dp, pp=pp, tp=self.tensor_parallel_size)
        self._spec = resolve_schedule(
            self.schedule,
            pp=dims.pp,
            microbatches=self.microbatches_for(dims.pp),
            stages_per_rank=self._stages_per_rank,
        )
        return dims

    def rank_measurements(self) -> dict[str, Any]:
        """This rank's measured idle share and its last training step's compute events (RunSummary
        gathers them from every rank)."""
        if not self.pipelined:
            return {"idle_fraction": None, "events": []}
        timer = self.runtime.timer
        return {"idle_fraction": timer.idle_fraction, "events": timer.last_events}

    def describe(self) -> dict[str, Any]:
        """Partition, and the schedule, micro-batches and analytic bubble requested and actually run, for
        summary.json (see `pipeline_summary.describe_pipeline`)."""
        if not self.pipelined:
            whole = describe_whole(self.dims, replicas=self.replicas, tensor_plan=self._tensor_plan)
            return {**whole, **self._describe_loss(), **self.describe_blocks()}
        return {**self._describe_pipeline(), **self._describe_loss(), **self.describe_blocks()}

    def _describe_loss(self) -> dict[str, Any]:
        return describe_loss(self._logit_counts, self.vocab_heads) if self.dims.tp > 1 else {}

    def _describe_pipeline(self) -> dict[str, Any]:
        return describe_pipeline(
            self.spec,
            self.partition,
            self.dims,
            requested=self.microbatches_for(self.dims.pp),
            used=list(self._runtime.used.plans.values()) if self._runtime is not None else [],
            replicas=self.replicas,
            tensor_plan=self._tensor_plan,
        )
