"""One rank role of a dry run: this process plays one global rank on torch's fake process group, runs the strategy's
own set-up order (`parallelize/order.py`) on a copy of the meta-device module with fake tensors for storage, then one
training step; returns what that rank would hold. It picks no roles and predicts nothing (`run.py`, `prediction.py`).
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_parallel.blocks import blocks_of
from lightning_parallel.dryrun.step import boundaries_of, scheduled_step, tracked_step, whole_step
from lightning_parallel.one_process_ranks import fake_rank, fake_tensors, local_part
from lightning_parallel.parallelize import parallelize_pipeline, parallelize_tensor
from lightning_parallel.parallelize.replicas import modules_split_over
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.strategies.tensor import TensorParallelStrategy
from lightning_parallel.tensor.plans import keep_gradients_sharded
from lightning_parallel.tensor.sharded_logits import logits_session, vocab_heads


@dataclass(frozen=True)
class Role:
    """A rank standing for every rank alike: its pipeline rank, and the global rank played (replica 0, tensor rank 0:
    replicas hold the same shapes, and tensor ranks too, since every plan's sharded sizes divide by tp)."""

    pp_rank: int
    rank: int
    ranks: int  # how many global ranks it stands for (dp x tp)


@dataclass(frozen=True)
class Measured:
    """What one role holds after set-up and during one training step, in bytes; its blocks and tensor plan."""

    parameter_bytes: int
    set_up_peak_bytes: int  # the most parameter bytes held while materialising and sharding
    step: dict[str, int]  # `step.tracked_step`'s figures
    blocks: list[str]
    sharded: dict[str, str]  # module -> tensor-parallel style, as applied
    seconds: float


def measure_role(
    module: pl.LightningModule,
    strategy: MeshStrategy,
    role: Role,
    batch: Any,
    boundaries: list[tuple] | None,
) -> Measured:
    """Set up `role` on a fresh copy of `module` and run one step (`boundaries`: each stage's inputs, at pp > 1)."""
    started = time.perf_counter()
    dims = strategy.dims
    module = copy.deepcopy(module)
    with fake_rank(role.rank, dims.world_size), warnings.catch_warnings():
        # FSDP2's view-output and MemTracker's hook warnings, once per block and role, say nothing about the layout
        warnings.simplefilter("ignore", UserWarning)
        strategy._mesh = dims.build_mesh("cpu")
        return _set_up_and_step(module, strategy, role, batch, boundaries, started)


def _set_up_and_step(
    module: pl.LightningModule,
    strategy: MeshStrategy,
    role: Role,
    batch: Any,
    boundaries: list[tuple] | None,
    started: float,
) -> Measured:
    dims = strategy.dims
    with fake_tensors():
        network = strategy.network_of(module)
        if isinstance(strategy, PipelineParallelStrategy):
            done: Any = parallelize_pipeline(
                network, strategy, lambda: strategy._example_inputs(module, batch, "training_step") or (None, None)
            )
            plan = done.plan[1] if done.plan is not None else {}
        elif isinstance(strategy, TensorParallelStrategy):
            done = parallelize_tensor(module, network, strategy, configured=False)
            plan = done.plan[1] if dims.tp > 1 else {}
        else:
            raise ValueError(f"the dry run sets up the mesh strategies, got {type(strategy).__name__}")
        params = sum(_bytes(p) for p in module.parameters())
        traced = isinstance(strategy, PipelineParallelStrategy) and dims.pp > 1 and done.stages.traced
        if isinstance(strategy, PipelineParallelStrategy) and dims.pp > 1:
            assert done.stages is not None and boundaries is not None
            run = scheduled_step(
                module,
                network,
                batch,
                split=done.stages.split,
                partition=done.stages.partition,
                spec=strategy.spec,
                pp=dims.pp,
                pp_rank=role.pp_rank,
                microbatches=strategy.microbatches_for(dims.pp),
                boundaries=boundaries,
                tp_mesh=strategy.device_mesh["tp"] if traced and done.plan is not None else None,
                heads=vocab_heads(plan),
            )
        else:
            run = whole_step(module, batch)
        # a DTensor parameter's gradient takes the parameter's placements as it is accumulated, as the strategies'
        # on_device() arranges (a traced stage's sharded weights get Partial whole-size gradients otherwise)
        hooks = keep_gradients_sharded(network) if dims.tp > 1 else []
        with _vocab_session(strategy, plan):
            step = tracked_step(module, run)
        for hook in hooks:
            hook.remove()
        split = modules_split_over(network, "tp")
        sharded = {name: plan.get(name, "custom") for name in sorted(split)}
        if isinstance(strategy, PipelineParallelStrategy) and done.stages is not None:
            blocks = list(done.stages.partition.blocks_of(role.pp_rank))  # a traced network's blocks are its cuts
        else:
            blocks = [name for name, _ in _named_blocks(network)]
    return Measured(params, done.peak_parameter_bytes, step, blocks, sharded, time.perf_counter() - started)


def stage_boundaries(
    module: pl.LightningModule, strategy: PipelineParallelStrategy, batch: Any
) -> tuple[Partition, list[tuple]]:
    """The whole network's cut as every role cuts it, and each stage's inputs for one micro-batch (on a meta copy,
    outside any fake process group)."""
    from lightning_parallel.parallelize.split import partition_stages
    from lightning_parallel.pipeline.split import network_split

    module = copy.deepcopy(module)
    network = strategy.network_of(module)
    captured = strategy._example_inputs(module, batch, "training_step")
    call, example = captured if captured is not None else (None, None)
    if example is None:
        raise ValueError(
            f"the dry run of a pipeline needs a batch to cut and run {type(network).__name__} on. HINT: pass batch=, "
            "or set example_input_array on the LightningModule"
        )
    microbatches = strategy.microbatches_for(strategy.dims.pp)
    rows = example[0].shape[0]
    micro = tuple(t[: rows // microbatches] if torch.is_tensor(t) and t.dim() else t for t in example)
    split = network_split(network, example, call)  # as every rank splits it: traced on the whole batch
    partition, _ = partition_stages(
        split, spec=strategy.spec, pp=strategy.dims.pp, balance=strategy.balance, block_costs=None
    )
    return partition, boundaries_of(split, partition, micro, strategy.dims.pp)


def _named_blocks(network: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    held = {id(b) for b in blocks_of(network)}
    return [(name, child) for name, child in network.named_modules() if id(child) in held]


def _bytes(tensor: torch.Tensor) -> int:
    local = local_part(tensor)
    return local.numel() * local.element_size()


def built_by_configure_model(module: pl.LightningModule, strategy: MeshStrategy) -> pl.LightningModule:
    """A module that builds its network in `configure_model()`: a copy with the hook run under the meta device, as
    the pipeline strategy runs it (its `tensor_init_context`, Lightning's `init_module(empty_init=True)`), so every
    role starts from the network a real rank starts from. The tensor strategy runs the hook instead of a plan, to
    shard on the real mesh: refused in one line. Other modules are returned as they are."""
    if not is_overridden("configure_model", module):
        return module
    name = type(module).__name__
    if isinstance(strategy, TensorParallelStrategy):
        raise ValueError(
            f"{name} overrides configure_model(), which the tensor strategy runs instead of a plan to shard the "
            "network on the real mesh; the dry run has no real mesh. HINT: give the strategy a plan instead (plan=... "
            "or the network's tp_plan), or dry-run it under PipelineParallelStrategy, which builds it on meta"
        )
    module = copy.deepcopy(module)
    try:
        with torch.device("meta"):
            module.configure_model()
    except Exception as error:
        raise ValueError(
            f"{name}.configure_model() failed on the meta device in the dry run ({type(error).__name__}: {error}). "
            "HINT: build the network there without reading values or the device mesh, or build it in __init__"
        ) from error
    return module


def _vocab_session(strategy: MeshStrategy, plan: dict[str, str]) -> Any:
    """The step's logits split by vocabulary into the loss where a real step keeps them so (the strategies' rule,
    `sharded_logits.vocab_heads`, traced stages included), so the step's peak counts the 1/tp of
    them a real rank holds."""
    return logits_session(vocab_heads(plan))
