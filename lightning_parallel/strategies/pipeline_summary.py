"""What a pipeline run reports in summary.json's `parallel`: its layout, partition, the schedule and micro-batches
requested and those that actually ran per batch shape, with their analytic bubbles. Reads; changes nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_parallel.dims import ParallelDims
from lightning_parallel.pipeline.microbatches import PlanUsed
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.pipeline.schedule_plan import ScheduleSpec, analytic_bubble


def describe_pipeline(
    spec: ScheduleSpec,
    partition: Partition,
    dims: ParallelDims,
    *,
    requested: int,
    used: Sequence[PlanUsed],
    replicas: str,
    tensor_plan: tuple[str, dict[str, str], dict[str, str]] | None,
) -> dict[str, Any]:
    """`ran` lists every (mode, batch size) with its plan; the top-level `schedule`, `microbatches` and
    `bubble_fraction` are the plan of most training batches, absent before any ran."""

    def bubble(name: str, count: int) -> float:
        return analytic_bubble(name, pp=dims.pp, microbatches=count, stages_per_rank=spec.stages_per_rank)

    ran: list[dict[str, Any]] = [
        {
            "mode": "train" if u.training else "eval",
            "batch_size": u.batch_size,
            "schedule": u.schedule,
            "microbatches": u.microbatches,
            "batches": u.batches,
            "bubble_fraction": bubble(u.schedule, u.microbatches) if u.training else None,
        }
        for u in sorted(used, key=lambda u: (not u.training, -u.batch_size))
    ]
    most = max((r for r in ran if r["mode"] == "train"), key=lambda r: r["batches"], default=None)
    return {
        "pipelined": True,
        **({key: most[key] for key in ("schedule", "microbatches", "bubble_fraction")} if most else {}),
        "requested": {
            "schedule": spec.name,
            "microbatches": requested,
            "bubble_fraction": bubble(spec.name, requested),
        },
        "ran": ran,
        "data_parallel_size": dims.dp,
        "pipeline_size": dims.pp,
        "tensor_parallel_size": dims.tp,
        "replicas": replicas,
        **_sharded(tensor_plan),
        "stages_per_rank": spec.stages_per_rank,
        "stages": [list(blocks) for blocks in partition.stages],
        "stage_to_rank": list(partition.stage_to_rank),
        "imbalance": partition.imbalance,
        "cost_unit": partition.cost_unit,
    }


def describe_whole(
    dims: ParallelDims, *, replicas: str, tensor_plan: tuple[str, dict[str, str], dict[str, str]] | None
) -> dict[str, Any]:
    """At pp=1 nothing is split and no schedule runs: the layout, and no schedule, micro-batches or bubble."""
    return {
        "pipelined": False,
        "ran": [],
        "data_parallel_size": dims.dp,
        "pipeline_size": dims.pp,
        "tensor_parallel_size": dims.tp,
        "replicas": replicas,
        **_sharded(tensor_plan),
    }


def _sharded(tensor_plan: tuple[str, dict[str, str], dict[str, str]] | None) -> dict[str, Any]:
    if tensor_plan is None:
        return {}
    source, plan, replicated = tensor_plan
    return {"plan_source": source, "sharded": dict(plan), **({"replicated_why": replicated} if replicated else {})}
