"""PipelineParallelStrategy: the LightningModule's network is cut into stages on different ranks and
micro-batches flow through them (torch.distributed.pipelining), while the user's code stays single-device.

Owns the training step: the user's `training_step` runs unchanged, its network call served by the schedule
(`strategies/user_step.py`).
Splitting math lives in `pipeline/partition.py`, the schedule mechanics in `pipeline/runtime.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_parallel.dims import ParallelDims
from lightning_parallel.pipeline.batchnorm import batchnorm_notice, commit_batchnorm, defer_batchnorm
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.pipeline.profile import measure_block_costs
from lightning_parallel.pipeline.runtime import PipelineRuntime, put_gradients, take_gradients
from lightning_parallel.pipeline.schedule_plan import SCHEDULES, ScheduleSpec, analytic_bubble, resolve_schedule
from lightning_parallel.pipeline.split import NetworkSplit, network_split
from lightning_parallel.pipeline.tied import TiedGroup, broadcast_tied_values, counted_elsewhere, sum_tied_gradients
from lightning_parallel.replicas import average_
from lightning_parallel.strategies.arguments import check_bool, check_choice, check_int, check_name, reject
from lightning_parallel.strategies.base import DEFAULT_TIMEOUT, MeshStrategy
from lightning_parallel.strategies.pipeline_summary import describe_pipeline, describe_whole
from lightning_parallel.strategies.stage_sharding import resolve_stage_plan, shard_over_replicas, shard_stage
from lightning_parallel.strategies.tensor import check_plan_argument
from lightning_parallel.strategies.user_step import (
    MicroSteps,
    StepRefused,
    capture_network_inputs,
    replay_logs,
    swap_attribute,
)
from lightning_parallel.tensor.plans import keep_gradients_sharded
from lightning_parallel.weights import materialize, parameter_bytes

BALANCES = ("flops", "parameters", "time")  # how a split is balanced, besides explicit block names per stage
REPLICAS = ("replicate", "fsdp")  # how data-parallel replicas of the pipeline stay in sync


class PipelineParallelStrategy(MeshStrategy):
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
        # block names per stage are checked against the network before launch (`partition.split_explicit`)
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
        self._gradient_hooks: list[RemovableHandle] = []
        self.balance = balance
        self.deferred_batchnorm = deferred_batchnorm
        self._batchnorms: list[nn.Module] = []
        self.network_attr = network_attr
        self._micro_steps: MicroSteps | None = None
        self._step_rest: tuple[Any, ...] = ()
        self._step_kwargs: dict[str, Any] = {}
        self._spec: ScheduleSpec | None = None
        self._partition: Partition | None = None
        self._split: NetworkSplit | None = None
        self._tied: list[TiedGroup] = []
        self._example: tuple[torch.Tensor, ...] | None = None
        self._runtime: PipelineRuntime | None = None
        self._parallelized = False
        self._fresh_grads: list[torch.Tensor | None] | None = None
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
        if not self.pipelined:
            return
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(module).__name__} uses manual optimization; PipelineParallelStrategy runs forward and "
                "backward together in its schedule inside training_step. HINT: use automatic optimization, or "
                "strategy='ddp' / 'tensor'"
            )
        example = self._example_inputs(module, batch, "training_step")
        if example is None and not isinstance(network, nn.Sequential):
            return  # traced in setup, where the data module's first batch exists
        # Checks the split is possible (it traces, enough blocks, a valid explicit split); a time-balanced
        # split is measured later, in setup, where a sample batch exists.
        self._plan_split(network_split(network, example), None)

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

    def _example_inputs(self, module: pl.LightningModule, batch: Any, step: str) -> tuple[torch.Tensor, ...] | None:
        """What the network receives: from `example_input_array` through forward, else from `batch` through
        the user's own step (stopped at the network call)."""
        network = self.network_of(module)
        example = getattr(module, "example_input_array", None)
        if example is not None:
            args = example if isinstance(example, tuple) else (example,)
            return capture_network_inputs(lambda: module(*args), network, module)
        if batch is None:
            return None
        return capture_network_inputs(lambda: getattr(module, step)(batch, 0), network, module)

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
        self._example = self._example_inputs(module, batch, step.get(fn, "predict_step"))
        self._split = network_split(network, self._example)
        costs = self._measured_costs(network) if self.balance == "time" else None
        self._partition = self._plan_split(self._split, costs)
        if self.dims.tp > 1:
            self._tensor_plan = resolve_stage_plan(network, self.plan, self.dims.tp)  # whole network, before pruning
        self._split.prune(self.partition.blocks_of(self.pp_rank))
        if self._tensor_plan is None:
            materialize(network, self.root_device)
            self.setup_peak_parameter_bytes = parameter_bytes(network)
        else:
            mesh, group = self.device_mesh["tp"], self.group("tp")
            self.setup_peak_parameter_bytes = shard_stage(network, self._tensor_plan[1], mesh, group, self.root_device)
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

    @override
    def on_device(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        network = self.network_of(module)
        if self.dims.tp > 1:  # after Module.to(), which swaps DTensor parameters and drops their hooks
            for handle in self._gradient_hooks:
                handle.remove()
            self._gradient_hooks = keep_gradients_sharded(network)
        if not self.pipelined:
            if self.global_rank == 0:
                rank_zero_info(f"PipelineParallelStrategy: pp=1, the network runs whole; {self.describe_layout()}")
            return
        if self._runtime is not None:
            return
        self._micro_steps = MicroSteps(module, network, self._user_step)
        self._runtime = self._build_runtime(self.pp_rank)
        if self.global_rank == 0:
            rank_zero_info(
                f"PipelineParallelStrategy: {self.spec.name}, {self.describe_layout()}\n{self.partition.table()}"
            )
            notice = batchnorm_notice(
                network,
                microbatches=self.microbatches_for(self.dims.pp),
                bubble_at_one=analytic_bubble("gpipe", pp=self.dims.pp, microbatches=1),
                deferred=self.deferred_batchnorm,
            )
            if notice is not None:
                rank_zero_warn(notice)

    @property
    def pp_rank(self) -> int:
        return self.device_mesh.get_local_rank("pp")

    def _build_runtime(self, pp_rank: int) -> PipelineRuntime:
        partition, split = self.partition, self._split
        assert split is not None
        example = self._example or ()
        micro = tuple(t[: max(1, len(t) // self.microbatches_for(self.dims.pp))].to(self.root_device) for t in example)
        return PipelineRuntime(
            stage_modules=split.stage_modules(partition, pp_rank, micro),
            stage_factory=split.stage_factory(partition, pp_rank),
            num_stages=len(partition.stages),
            schedule=self.spec.name,
            microbatches=self.microbatches_for(self.dims.pp),
            group=self.group("pp"),
            device=self.root_device,
            loss_fn=self._scaled(self.micro_steps.loss),
            warn=rank_zero_warn,
        )

    def describe_layout(self) -> str:
        if not self.pipelined:
            return f"dp={self.dims.dp} x pp=1 x tp={self.dims.tp}, no split, schedule or micro-batches"
        return (
            f"dp={self.dims.dp} x pp={self.dims.pp} x tp={self.dims.tp}, {len(self.partition.stages)} stages, "
            f"{self.microbatches_for(self.dims.pp)} micro-batches requested"
        )

    @property
    def runtime(self) -> PipelineRuntime:
        if self._runtime is None:
            raise RuntimeError("the pipeline runtime exists once the strategy is set up")
        return self._runtime

    # ---- the step ------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's training_step, unchanged: run up to its network call on every rank to learn the network's
        inputs, then per micro-batch on the last stage as the schedule's loss; its logs replayed everywhere."""
        if not self.pipelined:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        assert module is not None
        network = self.network_of(module)
        batch, self._step_rest, self._step_kwargs = args[0], args[1:], kwargs
        inputs = capture_network_inputs(lambda: self._user_step(batch), network, module)
        rows = inputs[0].shape[0] if inputs and isinstance(inputs[0], torch.Tensor) else 0
        micro_steps = self.micro_steps
        micro_steps.begin(batch, rows)
        params = self.local_parameters()
        earlier = take_gradients(params)  # gradients accumulated by earlier micro-steps
        with self.precision_plugin.train_step_context():
            loss = self.runtime.train_step(inputs, torch.arange(rows, device=self.root_device))
        commit_batchnorm(self._batchnorms)
        self._fresh_grads = take_gradients(params)
        put_gradients(params, earlier)
        if loss is not None and self._scaler is not None:
            loss = loss / self._scaler.get_scale()  # report the loss itself, not the scaled one
        # One object from the last stage: the loss, the logs to replay, or why the step was refused.
        report = [(float(loss), micro_steps.report) if loss is not None else None]
        dist.broadcast_object_list(report, src=self._last_stage_rank(), group=self.group("pp"))
        value, step_report = report[0]  # type: ignore[misc]
        if step_report.error is not None:
            raise StepRefused(step_report.error)
        replay_logs(module, step_report.records, holds_metrics=self.runtime.has_last)
        return torch.tensor(value, dtype=torch.float32, device=self.root_device)

    def _user_step(self, batch: Any) -> Any:
        return super().training_step(batch, *self._step_rest, **self._step_kwargs)

    @property
    def micro_steps(self) -> MicroSteps:
        if self._micro_steps is None:
            raise RuntimeError("the micro-steps exist once the strategy is set up")
        return self._micro_steps

    @property
    def _scaler(self) -> torch.amp.GradScaler | None:
        return getattr(self.precision_plugin, "scaler", None)  # fp16 mixed precision only

    def _scaled(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Under fp16 loss scaling the schedule must back-propagate the scaled loss, as
        `precision_plugin.backward` would have; the plugin unscales the gradients afterwards."""

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            value = loss_fn(output, target)
            return self._scaler.scale(value) if self._scaler is not None else value  # type: ignore[return-value]

        return loss

    def _pipelined_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs:
            raise RuntimeError(f"pipelined networks take positional inputs only; got keywords {sorted(kwargs)}")
        output = self.runtime.forward(tuple(args))
        meta = [(output.shape, output.dtype)] if output is not None else [None]
        dist.broadcast_object_list(meta, src=self._last_stage_rank(), group=self.group("pp"))
        shape, dtype = meta[0]
        return self._from_last_stage(output, shape, dtype)

    def _from_last_stage(self, tensor: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Broadcast a tensor from the rank holding the last stage to every rank of the pipeline."""
        buffer = (
            tensor.to(dtype).contiguous()
            if tensor is not None
            else torch.empty(shape, dtype=dtype, device=self.root_device)
        )
        dist.broadcast(buffer, src=self._last_stage_rank(), group=self.group("pp"))
        return buffer

    def _last_stage_rank(self) -> int:
        """Global rank of this replica's process that holds the last stage."""
        last_pp = self.partition.stage_to_rank[-1]
        return dist.get_global_rank(self.group("pp"), last_pp)

    def local_parameters(self) -> list[nn.Parameter]:
        # Cached: walking every parameter twice per step cost about 1 ms on a 389-tensor GPT.
        if self._local_params is None:
            self._local_params = [p for p in self.network_of(self.lightning_module).parameters() if p.requires_grad]
        return self._local_params

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule already ran backward inside training_step; put those gradients where autograd
        # would have, scaled like Lightning's loss / accumulate_grad_batches, and fire the hooks.
        if not self.pipelined:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        scale = 1.0 / module.trainer.accumulate_grad_batches
        fresh = self._fresh_grads or []
        for p, g in zip(self.local_parameters(), fresh, strict=False):
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        self._fresh_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_sync() -> Any:
            result = closure()
            self._average_over_replicas()
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    def _average_over_replicas(self) -> None:
        """Sum tied parameters' gradients over their stages, then all-reduce each stage's gradients across
        data-parallel replicas, once per optimizer step."""
        sum_tied_gradients(self.network_of(self.lightning_module), self._tied, self.group("pp"))
        if self.dims.dp == 1 or self.replicas == "fsdp":  # FSDP2 already reduce-scattered them
            return
        # DTensor gradients (tensor parallelism): each rank averages its own shard
        average_([_local(p.grad) for p in self.local_parameters() if p.grad is not None], self.group("dp"))

    @override
    def norm_group(self) -> dist.ProcessGroup:
        return self.group("pp")  # every stage of this replica; DTensor shards are summed over "tp" on their own

    @override
    def counted_elsewhere(self) -> set[int]:
        return counted_elsewhere(self.network_of(self.lightning_module), self._tied, self.pp_rank)

    # ---- evaluation ----------------------------------------------------------------------------
    def _evaluating(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.pipelined:
            return step(*args, **kwargs)
        with swap_attribute(self.network_of(self.lightning_module), "forward", self._pipelined_forward):
            return step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluating(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluating(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluating(super().predict_step, *args, **kwargs)

    # ---- what it costs -------------------------------------------------------------------------
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
            return {**whole, **self.describe_blocks()}
        return {**self._describe_pipeline(), **self.describe_blocks()}

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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
