"""TensorParallelStrategy: the layers a plan names are split across the ranks of a tensor-parallel group (DTensor
`parallelize_module`), optionally times data-parallel replicas that FSDP2 keeps in sync.

The plan is the `plan` argument, else the network's own (ours, or a transformers model's), else one found from its
structure, else from an fx trace (`parallelize/plan.resolve_plan`, which 3D shares); a LightningModule that overrides
`configure_model()` parallelises itself instead. Set-up runs `parallelize.parallelize_tensor`, one step a line; plan
mechanics live in `tensor/`. This file holds the arguments, the report (`describe()`) and the buffers' averaging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_parallel.dims import ParallelDims
from lightning_parallel.parallelize import SetUp, parallelize_tensor
from lightning_parallel.parallelize.plan import resolve_plan
from lightning_parallel.parallelize.replicas import modules_split_over
from lightning_parallel.replicas import average_
from lightning_parallel.strategies.arguments import check_bool, check_choice, check_int, check_name, reject
from lightning_parallel.strategies.base import DEFAULT_TIMEOUT
from lightning_parallel.strategies.evaluation_steps import EvaluationThrough
from lightning_parallel.tensor.plans import STYLES, keep_gradients_sharded
from lightning_parallel.tensor.sharded_logits import Counts, describe_loss, gather_logits, logits_session, vocab_heads
from lightning_parallel.weights import materialize


class TensorParallelStrategy(EvaluationThrough):
    """Tensor parallelism (optionally x data parallelism) as a Lightning strategy; devices = dp x tp.

    Contract with the LightningModule: the network is one `nn.Module` attribute (`network_attr`). Its plan is a dict of
    module-name patterns to style names (see `lightning_parallel.tensor.STYLES`). If the LightningModule overrides
    `configure_model()`, that hook runs instead of a plan, with the mesh at `self.device_mesh` (dims "dp", "pp",
    "tp"). With data_parallel_size > 1 the network is wrapped with FSDP2 `fully_shard` over "dp" unless the hook
    already did, so replicas never drift.

    Args:
        tensor_parallel_size: ranks that share one copy of the model; None derives it from the devices.
        data_parallel_size: model replicas; None derives it from the devices.
        plan: {pattern: style} overriding the network's own plan; "auto" to find one from the structure
            (attention and MLP layers, `tensor.structure`) or else an fx trace (Linear and Conv2d pairs,
            `tensor.pairing`); None: the network's own plan (its `tp_plan`, a transformers model's in transformers'
            style names), else "auto".
        sequence_parallel: also split norms and the residual stream along the sequence (plans that have
            "sequence_parallel" entries, e.g. GPT's).
        network_attr: the LightningModule attribute holding the network; None finds the one child with parameters.
        timeout: seconds (or timedelta) a collective may wait before the run fails.
        process_group_backend: None picks gloo on CPU and nccl on GPU.
    """

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        *,
        tensor_parallel_size: int | None = None,
        data_parallel_size: int | None = 1,
        plan: Mapping[str, str] | str | None = None,
        sequence_parallel: bool = False,
        network_attr: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend, **kwargs)
        check_int(self, "tensor_parallel_size", tensor_parallel_size, example=2, optional=True)
        check_int(self, "data_parallel_size", data_parallel_size, example=1, optional=True)
        check_plan_argument(self, plan)
        check_bool(self, "sequence_parallel", sequence_parallel)
        check_name(self, "network_attr", network_attr, example="model")
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.plan = dict(plan) if isinstance(plan, Mapping) else plan
        self.sequence_parallel = sequence_parallel
        self.network_attr = network_attr
        self._description: dict[str, Any] | None = None
        self._gradient_hooks: list[RemovableHandle] = []
        self._vocab_heads: list[str] = []  # planned `vocab_head`s: a step's cross-entropy reads their logits sharded
        self._logit_counts = Counts()

    # ---- sizes and validation (main process, before launch) -------------------------------------
    @override
    def resolve_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims.resolve(world_size, dp=self.data_parallel_size, pp=1, tp=self.tensor_parallel_size)

    @override
    def validate(self, module: pl.LightningModule, *, batch: Any = None) -> None:
        network = self.network_of(module)
        if self._description is None:
            self.check_block_options(network)
        if self._description is None and not is_overridden("configure_model", module):
            self.refuse_meta_outside(module, network)
            self.resolve_plan(network)

    def network_of(self, module: pl.LightningModule) -> nn.Module:
        return self.find_network(module, nn.Module, "tensor parallelism needs the network as an nn.Module")

    def resolve_plan(self, network: nn.Module) -> tuple[str, dict[str, str], dict[str, str]]:
        """(source, exact-name plan, why each unplanned module stays whole), checked against this run's sizes."""
        return resolve_plan(
            network, self.plan, tensor_parallel_size=self.dims.tp, sequence_parallel=self.sequence_parallel
        )

    # ---- set-up in every process ---------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        # trainer.init_module(empty_init=True) builds on the meta device: setup() then materialises one planned layer
        # at a time and shards it at once, with the values one process builds when the network initialises by name
        # (`weights.init_by_name`). Without it the network is built whole on every rank, as on one device.
        device = torch.device("meta") if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        if module is not None:  # the Lightning way: configure_model() finds the mesh on the module
            module._device_mesh = self.device_mesh
            if is_overridden("configure_model", module):
                # Built on the meta device before launch: configure_model() shards real tensors, as it expects.
                for child in module.children():
                    if any(t.is_meta for t in [*child.parameters(), *child.buffers()]):
                        materialize(child, self.root_device)

    @override
    def parallelize(self, trainer: pl.Trainer, module: pl.LightningModule) -> SetUp:
        """The tensor strategy's set-up order (`parallelize/order.py`): plan -> materialise and shard -> activation
        checkpointing -> compile -> replicas; then what it did, reported."""
        network = self.network_of(module)
        done = parallelize_tensor(module, network, self, configured=is_overridden("configure_model", module))
        plan = done.plan[1] if self.dims.tp > 1 else {}
        self._vocab_heads = vocab_heads(plan)
        self._description = self._describe(*done.plan, network)
        if self.global_rank == 0:
            d = self._description
            rank_zero_info(
                f"TensorParallelStrategy: tp={d['tensor_parallel_size']} x dp={d['data_parallel_size']}, plan from "
                f"{d['plan_source']}{'' if d['plan_applied'] else ' (not applied at tp=1: the network stays plain)'}: "
                f"{len(d['sharded'])} modules sharded, {len(d['replicated'])} replicated; "
                f"parameter bytes per rank {d['parameter_bytes_per_rank']}\n"
                f"  sharded: {_names(d['sharded'])}\n  replicated: {_names(d['replicated'])}"
            )
        return done

    @override
    def on_device(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for handle in self._gradient_hooks:  # a later fit/validate sets up again
            handle.remove()
        self._gradient_hooks = keep_gradients_sharded(self.network_of(module))

    def _describe(
        self, source: str, plan: dict[str, str], replicated_why: dict[str, str], network: nn.Module
    ) -> dict[str, Any]:
        sharded: dict[str, str] = {}
        replicated: list[str] = []
        split = modules_split_over(network, "tp")
        for name, mod in network.named_modules():
            if name in split:
                sharded[name] = plan.get(name, "custom")
            elif any(True for _ in mod.parameters(recurse=False)):
                replicated.append(name)
        local = sum(_local(p).numel() * p.element_size() for p in network.parameters())
        per_rank: list[int] = [0] * self.world_size
        dist.all_gather_object(per_rank, local)
        description: dict[str, Any] = {
            "tensor_parallel_size": self.dims.tp,
            "data_parallel_size": self.dims.dp,
            "sequence_parallel": self.sequence_parallel,
            "plan_source": source,
            "plan_applied": source == "configure_model" or self.dims.tp > 1,
            "sharded": sharded,
            "replicated": replicated,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in network.parameters()),
            "parameter_bytes_per_rank": per_rank,
        }
        if replicated_why:
            description["replicated_why"] = replicated_why
        return description

    def describe(self) -> dict[str, Any]:
        """Plan applied (modules sharded / replicated) and parameter bytes per rank, for summary.json."""
        if self._description is None:
            raise RuntimeError("TensorParallelStrategy.describe() has something to say once the strategy is set up")
        return {
            **self._description,
            **describe_loss(self._logit_counts, self._vocab_heads),
            **self.describe_blocks(),
        }

    # ---- the step ------------------------------------------------------------------------------
    def _in_session(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A step with the `vocab_head`s' logits sharded for its cross-entropy (`tensor/sharded_logits.py`), entered
        before the token mean over replicas (`MeshStrategy.training_step`), which then calls it again; what the step
        returns leaves with them gathered."""
        with logits_session(self._vocab_heads, self._logit_counts):
            return gather_logits(step(*args, **kwargs))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_session(super().training_step, *args, **kwargs)

    @override
    def _evaluating(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._in_session(step, *args, **kwargs)  # validation, test and predict steps

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._average_buffers_over_replicas()
        return result

    def _average_buffers_over_replicas(self) -> None:
        """FSDP2 syncs gradients, not buffers: average running statistics (BatchNorm) so replicas stay identical."""
        if self.dims.dp == 1:
            return
        assert self.lightning_module is not None
        buffers = [_local(b) for b in self.network_of(self.lightning_module).buffers()]
        average_([b for b in buffers if b.is_floating_point()], self.group("dp"))


def check_plan_argument(owner: object, plan: object) -> None:
    """A `plan` argument is None, "auto", or {module pattern: style name}; checked in the constructor."""
    if isinstance(plan, Mapping):
        for pattern, style in plan.items():
            check_choice(owner, f"plan[{pattern!r}]", style, STYLES, example="colwise")
    elif plan not in (None, "auto"):
        expected = "None (the model's own tp_plan), 'auto', or a dict {module pattern: style}"
        reject(owner, "plan", plan, expected, "plan='auto', or plan={'block_*.attn.q': 'colwise'}")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _names(items: Any, shown: int = 8) -> str:
    """The first names of a describe() list; all of them are in summary.json's `parallel` (train.py)."""
    names = [f"{k} ({v})" for k, v in items.items()] if isinstance(items, Mapping) else [str(i) for i in items]
    more = f" ... and {len(names) - shown} more (all in summary.json's 'parallel')" if len(names) > shown else ""
    return (", ".join(names[:shown]) or "none") + more
