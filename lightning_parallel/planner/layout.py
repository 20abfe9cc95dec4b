"""The records the planner's cost model speaks in: a ``Layout`` (how ``dp * pp * tp`` devices share the work) and its
``Estimate`` (memory per device, step time, bubble). Data and validation only; ``estimate.py`` computes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_parallel.pipeline.schedule_plan import resolve_schedule


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How ``dp * pp * tp`` devices share the work.

    Args:
        dp: Data-parallel replicas.
        pp: Pipeline ranks per replica.
        tp: Tensor-parallel ranks per pipeline rank.
        dp_shard: Replicas shard parameters, gradients and optimizer state (FSDP / ZeRO-3) instead of copying them.
        schedule: Pipeline schedule (``pipeline.schedule_plan.SCHEDULES``) when ``pp > 1``.
        microbatches: Micro-batches per step (1 without a pipeline).
        stages_per_rank: Pipeline stages per rank (2 for the multi-stage schedules).
    """

    dp: int
    pp: int = 1
    tp: int = 1
    dp_shard: bool = False
    schedule: str | None = None
    microbatches: int = 1
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.pp, self.tp, self.microbatches, self.stages_per_rank) < 1:
            raise ValueError(f"layout sizes must be >= 1, got {self}. HINT: use 1 to switch a dimension off")
        if (self.pp > 1) != (self.schedule is not None):
            raise ValueError(
                f"a pipeline (pp={self.pp}) needs a schedule and only a pipeline has one. HINT: pp=2 schedule=1f1b"
            )

    @property
    def devices(self) -> int:
        """Devices the layout uses: ``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    @property
    def label(self) -> str:
        """``dp4 x pp2 x tp1``."""
        return f"dp{self.dp} x pp{self.pp} x tp{self.tp}"

    def stage_to_rank(self) -> list[int]:
        """The pipeline rank of each stage, as the schedule places them (``[0]`` without a pipeline)."""
        if self.pp == 1:
            return [0]
        spec = resolve_schedule(
            self.schedule or "", pp=self.pp, microbatches=self.microbatches, stages_per_rank=self.stages_per_rank
        )
        return spec.stage_to_rank(self.pp)

    @property
    def kind(self) -> str:
        """The parallelism in words: ``ddp``, ``fsdp``, ``pipeline``, ``tensor``, ``pipeline+ddp``, ..."""
        parts = [name for name, size in (("pipeline", self.pp), ("tensor", self.tp)) if size > 1]
        if self.dp > 1:
            parts.append("fsdp" if self.dp_shard else "ddp")
        return "+".join(parts) or "single"


@dataclass(frozen=True)
class Estimate:
    """What a layout costs. Memory figures are bytes on the fullest device; times are seconds per step.

    ``memory`` has keys params, grads, optimizer, activations, total; ``time`` has keys compute, tp_comm,
    pp_comm, bubble, dp_comm, optimizer, overhead (they sum to ``step_time``).
    """

    layout: Layout
    batch: int  # samples per replica per step
    memory: dict[str, float]
    capacity: float  # usable bytes per device
    time: dict[str, float]
    bubble_fraction: float
    parameters_per_rank: tuple[int, ...]  # per pipeline rank, on one device (tensor shard, data-parallel shard)
    exact_schedule: bool = True  # False: the bubble and in-flight counts were extrapolated (large pipelines)
    memory_per_rank: tuple[dict[str, float], ...] = field(default=())  # ``memory``'s keys, per pipeline rank

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    @property
    def throughput(self) -> float:
        """Samples per second over all replicas."""
        return self.batch * self.layout.dp / self.step_time if self.step_time > 0 else float("inf")

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.capacity

    @property
    def communication(self) -> float:
        """Seconds per step spent in exposed communication."""
        return self.time["tp_comm"] + self.time["pp_comm"] + self.time["dp_comm"]


def check_layout(layout: Layout, *, batch: int, name: str, blocks: int, tp_modulus: int) -> None:
    """Raise ValueError (one line) when ``layout`` cannot run a workload called ``name`` of ``blocks`` blocks whose
    sharded sizes have the gcd ``tp_modulus``, with ``batch`` samples per replica."""
    if tp_modulus % layout.tp:
        raise ValueError(
            f"tp={layout.tp} does not divide the sharded sizes of {name} (their gcd is {tp_modulus}). HINT: use a tp "
            f"that divides {tp_modulus}"
        )
    if layout.pp * layout.stages_per_rank > blocks:
        raise ValueError(
            f"pp={layout.pp} x stages_per_rank={layout.stages_per_rank} stages exceed the {blocks} blocks of {name}. "
            f"HINT: use at most {blocks} stages"
        )
    if batch < 1 or batch % layout.microbatches:
        raise ValueError(
            f"{layout.microbatches} micro-batches do not divide {batch} samples per replica. "
            "HINT: use a micro-batch count that divides the batch"
        )
