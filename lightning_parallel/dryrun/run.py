"""`dry_run(module, strategy, devices=N)`: a mesh strategy's set-up at any world size, in this one process, with no
launch and no real storage: each distinct rank role (a pipeline rank; replicas and tensor ranks hold the same shapes)
set up on torch's fake process group (`role.py`), next to the planner's prediction (`prediction.py`); the report and
its refusal are `report.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_parallel.dryrun.prediction import layout_of, predict, stage_cut, update_of, workload_of
from lightning_parallel.dryrun.report import DryRun, RoleRow, device_limit
from lightning_parallel.dryrun.role import Role, built_by_configure_model, measure_role, stage_boundaries
from lightning_parallel.dryrun.step import optimizer_of
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.pipeline.traced_constants import constants_unread
from lightning_parallel.pipeline.traced_sharing import sharing_traces
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy


def dry_run(
    module: pl.LightningModule,
    strategy: MeshStrategy,
    *,
    devices: int,
    num_nodes: int = 1,
    batch: Any = None,
    precision: str = "32-true",
    device_memory: int | str | None = None,
    hardware: str = "cpu",
    output_dir: str | Path | None = None,
) -> DryRun:
    """Set up `strategy` for `devices x num_nodes` ranks without launching anything, once per distinct rank role.

    Args:
        module: The LightningModule, its network built on the meta device (`with torch.device("meta"):`) so no
            weights are ever made, or in its `configure_model()`, which a pipeline dry run calls on the meta
            device; it is copied, never changed.
        strategy: A `PipelineParallelStrategy` or `TensorParallelStrategy`, as it would be given to the Trainer.
        devices: Devices per node; num_nodes: nodes.
        batch: One training batch (what the loader gives one replica); its shapes drive the step. Required unless
            the module sets `example_input_array` and the strategy is tensor-only.
        precision: Lightning's precision name, for the planner (the network's own dtype is what is measured).
        device_memory: A size ("80GB") or a hardware preset ("h100": its usable memory); a role whose peak exceeds
            it makes `DryRun.refusal` a line (and `train.py` exits non-zero).
        hardware: The planner's hardware preset for the prediction.
        output_dir: Where `dry_run.json` is written; None writes nothing.

    Returns:
        One row per role, measured and predicted; `str()` is the table.
    """
    # one trace of a traced network serves the check, the cut and every role; constants' values are never read
    with sharing_traces(), constants_unread():
        module = built_by_configure_model(module, strategy)
        world = devices * num_nodes
        strategy._dims = strategy.resolve_dims(world)
        strategy._dims.check_tp_fits_nodes(devices)
        strategy.parallel_devices = [torch.device("cpu")] * devices
        strategy.validate(module, batch=batch)
        dims = strategy.dims
        if batch is None:
            example = getattr(module, "example_input_array", None)
            batch = example
        boundaries = partition = None
        if isinstance(strategy, PipelineParallelStrategy) and dims.pp > 1:
            partition, boundaries = stage_boundaries(module, strategy, batch)
        planner, predicted = _prediction(module, strategy, batch, partition, precision=precision, hardware=hardware)
        rows = []
        for pp_rank in range(dims.pp):
            role = Role(pp_rank=pp_rank, rank=pp_rank * dims.tp, ranks=dims.dp * dims.tp)
            measured = measure_role(module, strategy, role, batch, boundaries)
            rows.append(RoleRow.of(role, measured, predicted[pp_rank] if predicted is not None else None))
        result = DryRun(
            layout=layout_of(strategy).label,
            world_size=world,
            strategy=type(strategy).__name__,
            rows=rows,
            limit=device_limit(device_memory),
            planner=planner,
            untried=_untried(strategy),
        )
        if output_dir is not None:
            result.write(Path(output_dir) / "dry_run.json")
        return result


def _untried(strategy: MeshStrategy) -> tuple[str, ...]:
    """The strategy's options that would lower a rank's peak and are not set: FSDP2 replicas (the tensor strategy's
    are already; at one replica they shard nothing), full activation checkpointing."""
    untried = []
    if isinstance(strategy, PipelineParallelStrategy) and strategy.replicas != "fsdp" and strategy.dims.dp > 1:
        untried.append("replicas=fsdp")
    if strategy.activation_checkpointing != "full":
        untried.append("activation_checkpointing=full")
    return tuple(untried)


def _prediction(
    module: pl.LightningModule,
    strategy: MeshStrategy,
    batch: Any,
    partition: Partition | None,
    *,
    precision: str,
    hardware: str,
) -> tuple[str, list[dict[str, float]] | None]:
    """What the planner analysed (or why nothing), and its figures per pipeline rank (`partition`: the roles' cut)."""
    network = strategy.network_of(module)
    args, kwargs = _network_inputs(module, strategy, batch)
    workload = workload_of(network, args, kwargs, strategy, _step_loss(module, network, batch))
    if workload is None:
        return f"none (no analysis of {type(network).__name__} here)", None
    stages = stage_cut(workload, partition) if partition is not None else None
    if partition is not None and stages is None:
        return f"none ({workload.name}'s units do not follow the pipeline's cut)", None
    first = next((t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim()), None)
    rows = int(first.shape[0]) if first is not None else 1
    update = update_of(optimizer_of(module))
    return workload.name, predict(
        workload, strategy, batch=rows, precision=precision, hardware=hardware, stages=stages, update=update
    )


def _step_loss(
    module: pl.LightningModule, network: torch.nn.Module, batch: Any
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The loss the user's step computes from the network's output (the network's call answered with it)."""
    from lightning_parallel.strategies.user_step import _loss_of, swap_attribute

    if batch is None:
        return None

    def loss(output: torch.Tensor) -> torch.Tensor:
        with ExitStack() as stack:
            stack.enter_context(swap_attribute(network, "forward", lambda *a, **k: output))
            for name in ("log", "log_dict"):
                stack.enter_context(swap_attribute(module, name, lambda *a, **k: None))
            return _loss_of(module.training_step(batch, 0))

    return loss


def _network_inputs(
    module: pl.LightningModule, strategy: MeshStrategy, batch: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What the network receives from one batch, positional and keyword (the user's step, stopped at the network)."""
    from lightning_parallel.strategies.user_step import capture_network_inputs

    if batch is None:
        return (), {}
    network = strategy.network_of(module)
    args, kwargs = capture_network_inputs(lambda: module.training_step(batch, 0), network, module)
    return tuple(args), dict(kwargs)
