"""The planner's prediction for the layout a dry run sets up: the same sizes, schedule, micro-batches, replicas and
precision as a `planner.Layout`, and its memory per pipeline rank, on the pipeline's own cut. Predicts what the
planner can analyse (an `nn.Sequential` of named blocks, any network from one call); it measures nothing (`role.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_parallel.parallelize.plan import resolve_plan
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.planner import CostModel, Layout, Workload, workload_from_network
from lightning_parallel.planner.loss_block import with_loss
from lightning_parallel.planner.presets import hardware_preset
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.tensor.sharded_logits import vocab_heads


def layout_of(strategy: MeshStrategy) -> Layout:
    """The planner's layout for the strategy's sizes (FSDP2 replicas: the tensor strategy's always, the pipeline's
    with replicas='fsdp')."""
    dims = strategy.dims
    if isinstance(strategy, PipelineParallelStrategy):
        spec = strategy.spec
        piped = dims.pp > 1
        return Layout(
            dp=dims.dp,
            pp=dims.pp,
            tp=dims.tp,
            dp_shard=strategy.replicas == "fsdp" and dims.dp > 1,
            schedule=spec.name if piped else None,
            microbatches=strategy.microbatches_for(dims.pp) if piped else 1,
            stages_per_rank=spec.stages_per_rank if piped else 1,
        )
    return Layout(dp=dims.dp, tp=dims.tp, dp_shard=dims.dp > 1)


def workload_of(
    network: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    strategy: MeshStrategy,
    loss_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Workload | None:
    """The planner's figures for the network, as `strategy=auto` and `plan.py` read them
    (`planner.workload_from_network`: an `nn.Sequential` block by block, with `loss_of(its output)`, the user's
    step's loss outside the network, on its last block (`with_loss`); any other network from one call on its inputs
    with the tensor plan the strategy resolves, at pp > 1 run as its trace runs and its units cut as the traced stages
    are, `stage_cut`); None without a tensor input (any network but an `nn.Sequential`: of 2 rows)."""
    tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
    sequential = isinstance(network, nn.Sequential)
    if sequential and (not args or not torch.is_tensor(args[0]) or args[0].dim() == 0):
        return None
    if not sequential and (not tensors or tensors[0].dim() == 0 or tensors[0].shape[0] < 2):
        return None
    tp = strategy.dims.tp
    parallel = bool(getattr(strategy, "sequence_parallel", False))
    given = getattr(strategy, "plan", None)
    plan: dict[str, str] = {}
    if tp > 1:
        plan = resolve_plan(network, given, tensor_parallel_size=tp, sequence_parallel=parallel)[1]
    workload = workload_from_network(
        network, args, kwargs, styles=None if sequential else plan, traced=strategy.dims.pp > 1
    )
    if not sequential or loss_of is None or args[0].shape[0] < 2:
        return workload
    meta, sample = copy.deepcopy(network).to("meta"), args[0].to("meta")
    with torch.no_grad():
        output = meta(sample)
    last = workload.blocks[-1].name
    split = any(head == last or head.startswith(f"{last}.") for head in vocab_heads(plan))
    return with_loss(workload, loss_of, output, split=split)


def stage_cut(workload: Workload, partition: Partition) -> tuple[tuple[int, ...], ...] | None:
    """The workload's block indices per stage of the pipeline's `partition`: each block in the stage holding the
    module of its name or one around it (a traced network's blocks are the modules its forward calls once, the
    workload's the units `call_analysis` found, e.g. `model.layers.3`); None where a block falls in no stage or the
    stages would not run in the workload's order."""
    owner = {name: index for index, stage in enumerate(partition.stages) for name in stage}
    cut: list[list[int]] = [[] for _ in partition.stages]
    last = 0
    for index, block in enumerate(workload.blocks):
        parts = block.name.split(".")
        held = next(
            (owner[".".join(parts[:n])] for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in owner), None
        )
        if held is None or held < last:
            return None
        cut[held].append(index)
        last = held
    return tuple(tuple(stage) for stage in cut)


def update_of(optimizer: torch.optim.Optimizer) -> str:
    """How the optimizer's step makes temporaries on the dry run's CPU tensors (`planner.memory.UPDATES`): torch's
    Adam and AdamW fused, foreach, or one parameter at a time (their CPU default); others' are not modelled."""
    if not isinstance(optimizer, torch.optim.Adam) or optimizer.defaults.get("fused"):
        return "fused"
    return "foreach" if optimizer.defaults.get("foreach") else "for-loop"


def predict(
    workload: Workload,
    strategy: MeshStrategy,
    *,
    batch: int,
    precision: str,
    hardware: str = "cpu",
    stages: tuple[tuple[int, ...], ...] | None = None,
    update: str = "fused",
) -> list[dict[str, float]]:
    """Bytes of parameters, gradients, optimizer state (AdamW) and activations per pipeline rank, and their total
    (`stages`: the pipeline's cut, as `stage_cut` gives it; `update`: as `update_of` gives it)."""
    model = CostModel(
        workload,
        hardware_preset(hardware),
        precision=precision,
        optimizer_states=2,
        activation_checkpointing=strategy.activation_checkpointing,
        stages=stages,
        update=update,
    )
    per_rank = model.estimate(layout_of(strategy), batch=batch).memory_per_rank
    # the dry run's "activations" are all the peak holds beyond the shards, FSDP2's gathered blocks too
    return [{**{k: v for k, v in m.items() if k != "gathered"}, "activations": m["activations"] + m["gathered"]}
            for m in per_rank]  # fmt: skip
