"""Cut an ``nn.Sequential`` of named blocks into pipeline stages and map the stages onto pipeline ranks.

Pure planning: no pruning (`prune.py`), no process groups, no schedules, no weight initialisation here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_parallel.pipeline.balance import split_by_cost, split_explicit


@dataclass(frozen=True, kw_only=True)
class Partition:
    """Which blocks form each stage, which pipeline rank runs it, and what each stage costs.

    Args:
        stages: Block names per stage, in model order. With virtual stages there are more stages than ranks.
        stage_to_rank: Pipeline rank that owns each stage.
        costs: Cost of each stage, in ``cost_unit``.
        cost_unit: What the costs measure, e.g. ``"parameters"`` or ``"seconds"``; shown in ``table()``.
    """

    stages: tuple[tuple[str, ...], ...]
    stage_to_rank: tuple[int, ...]
    costs: tuple[float, ...]
    cost_unit: str

    def __post_init__(self) -> None:
        ranks = self.stage_to_rank
        if not len(self.stages) == len(ranks) == len(self.costs) >= 1 or set(ranks) != set(range(max(ranks) + 1)):
            raise ValueError(
                f"Partition has {len(self.stages)} stages, stage_to_rank {list(ranks)} and {len(self.costs)} costs. "
                "HINT: give one rank and one cost per stage, every rank 0..pp-1 owning a stage (use make_partition)."
            )

    @property
    def num_ranks(self) -> int:
        """Number of pipeline ranks."""
        return max(self.stage_to_rank) + 1

    def stages_of(self, rank: int) -> list[int]:
        """Indices of the stages a pipeline rank owns, ascending."""
        return [stage for stage, owner in enumerate(self.stage_to_rank) if owner == rank]

    def blocks_of(self, rank: int) -> list[str]:
        """Names of every block a pipeline rank owns, in model order."""
        return [name for stage in self.stages_of(rank) for name in self.stages[stage]]

    def rank_costs(self) -> list[float]:
        """Total cost per pipeline rank (the sum over its stages)."""
        totals = [0.0] * self.num_ranks
        for owner, cost in zip(self.stage_to_rank, self.costs, strict=True):
            totals[owner] += cost
        return totals

    @property
    def imbalance(self) -> float:
        """Largest per-rank cost over the mean per-rank cost; 1.0 is a perfect balance."""
        totals = self.rank_costs()
        mean = sum(totals) / len(totals)
        return max(totals) / mean if mean > 0 else 1.0

    def table(self) -> str:
        """A plain-text table, one row per stage, ending with the imbalance line."""
        total = sum(self.costs)
        rows = [("stage", "rank", "blocks", "count", self.cost_unit, "share")]
        for index, (blocks, owner, cost) in enumerate(zip(self.stages, self.stage_to_rank, self.costs, strict=True)):
            span = blocks[0] if len(blocks) == 1 else f"{blocks[0]}..{blocks[-1]}"
            shown = f"{cost:,.0f}" if self.cost_unit == "parameters" else f"{cost:.4g}"
            share = f"{cost / total:.1%}" if total > 0 else "-"
            rows.append((str(index), str(owner), span, str(len(blocks)), shown, share))
        widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines.append(f"imbalance {self.imbalance:.3f} (max / mean {self.cost_unit} per rank, {self.num_ranks} ranks)")
        return "\n".join(lines)


def parameter_costs(model: nn.Sequential) -> list[float]:
    """Number of parameters per block (works on meta-device models).

    A block without parameters (pooling, activation) counts as 1, so ties between such blocks are broken
    by their count rather than left arbitrary.
    """
    return [float(max(sum(p.numel() for p in block.parameters()), 1)) for block in model.children()]


def loop_stage_to_rank(num_stages: int, pp: int) -> list[int]:
    """Stage ``i`` on rank ``i % pp`` (GPipe, 1F1B, interleaved 1F1B, looped BFS)."""
    if pp < 1 or num_stages < 1 or num_stages % pp != 0:
        raise ValueError(
            f"the loop layout needs num_stages a positive multiple of pp, got num_stages {num_stages}, pp {pp}. "
            f"HINT: use num_stages = pp x virtual stages per rank, e.g. {2 * max(pp, 1)}."
        )
    return [stage % pp for stage in range(num_stages)]


def v_stage_to_rank(num_stages: int, pp: int) -> list[int]:
    """The V layout of ZBV / DualPipeV: down the ranks and back, so rank 0 holds the first and last stage."""
    if pp < 1 or num_stages != 2 * pp:
        raise ValueError(
            f"the V layout needs exactly 2 stages per rank, got num_stages {num_stages} for pp {pp}. "
            f"HINT: use num_stages = {2 * max(pp, 1)} (stages_per_rank=2)."
        )
    return [stage if stage < pp else 2 * pp - 1 - stage for stage in range(num_stages)]


# stage layout ("style" of a schedule, `schedules.ScheduleTraits.style`) -> (num_stages, pp) -> rank of each stage
STAGE_TO_RANK: dict[str, Callable[[int, int], list[int]]] = {"loop": loop_stage_to_rank, "v": v_stage_to_rank}


def block_names(model: nn.Module) -> list[str]:
    """The names of an ``nn.Sequential``'s blocks (its direct children); one line with the fix for anything else."""
    names = [name for name, _ in model.named_children()]
    if not isinstance(model, nn.Sequential) or len(names) < 2:
        raise ValueError(
            "pipeline parallelism needs the network as an nn.Sequential of named blocks (stem, blocks..., head); "
            f"got {type(model).__name__} with {len(names)} children. HINT: build the model as an nn.Sequential "
            "subclass whose direct children are the blocks, like lightning_parallel.models.GPT."
        )
    return names


def _block_costs(
    model: nn.Sequential, balance: str | Sequence[Sequence[str]], block_costs: Sequence[float] | None
) -> tuple[list[float], str]:
    """Cost per block and its unit: measured seconds when given, else parameters."""
    num_blocks = len(model)
    if block_costs is not None and len(block_costs) != num_blocks:
        raise ValueError(
            f"block_costs has {len(block_costs)} entries but the model has {num_blocks} blocks. "
            "HINT: measure one cost per direct child of the model."
        )
    if isinstance(balance, str) and balance not in ("parameters", "time"):
        raise ValueError(f"unknown balance {balance!r}. HINT: use 'parameters', 'time' or a list of block-name lists.")
    if balance == "parameters" and block_costs is not None:
        raise ValueError("block_costs were given but balance='parameters' ignores them. HINT: use balance='time'.")
    if balance == "time" and block_costs is None:
        raise ValueError(
            "balance='time' needs block_costs (measured seconds per block) and none were given. "
            "HINT: measure the blocks first, or use balance='parameters'."
        )
    if block_costs is None:
        # An explicit split without measurements is still reported in parameters, so its balance is visible.
        return parameter_costs(model), "parameters"
    return [float(cost) for cost in block_costs], "seconds"


def make_partition(
    model: nn.Sequential,
    *,
    pp: int,
    stages_per_rank: int = 1,
    style: str = "loop",
    balance: str | Sequence[Sequence[str]] = "parameters",
    block_costs: Sequence[float] | None = None,
) -> Partition:
    """Plan the pipeline split of a model: the one entry point to this module.

    Args:
        model: An ``nn.Sequential`` whose children are the blocks (possibly on the meta device).
        pp: Pipeline size (number of pipeline ranks).
        stages_per_rank: Virtual stages per rank; ``pp * stages_per_rank`` stages in total.
        style: ``"loop"`` (stage i on rank i % pp) or ``"v"`` (ZBV / DualPipeV; needs stages_per_rank=2).
        balance: ``"parameters"``, ``"time"`` (needs ``block_costs``), or an explicit list of block-name lists.
        block_costs: Measured seconds per block, for ``balance="time"`` or to report an explicit split's costs.

    Returns:
        The partition, with per-stage costs in parameters or seconds.
    """
    names = block_names(model)
    costs, unit = _block_costs(model, balance, block_costs)
    holds = holds_parameters(model, names)
    return plan_partition(
        names, costs, unit, pp=pp, stages_per_rank=stages_per_rank, style=style, balance=balance, holds_parameters=holds
    )


def holds_parameters(model: nn.Module, names: Sequence[str]) -> list[bool]:
    """Per block: whether it has any parameter (a Flatten or ReLU has none)."""
    return [any(True for _ in model.get_submodule(name).parameters()) for name in names]


def plan_partition(
    names: Sequence[str],
    costs: Sequence[float],
    cost_unit: str,
    *,
    pp: int,
    stages_per_rank: int = 1,
    style: str = "loop",
    balance: str | Sequence[Sequence[str]] = "parameters",
    holds_parameters: Sequence[bool] | None = None,
) -> Partition:
    """The partition of blocks with known costs: balanced by those costs, or the explicit split `balance`.
    With `holds_parameters` (per block), a balanced split never leaves a rank without parameters where it can
    be avoided: that rank's optimizer would get an empty parameter list (a measured cost can make a Flatten
    look expensive)."""
    if pp < 1 or stages_per_rank < 1:
        raise ValueError(
            f"pp({pp}) and stages_per_rank({stages_per_rank}) must both be >= 1. HINT: use pp=1 for no pipeline."
        )
    if style not in STAGE_TO_RANK:
        raise ValueError(f"unknown pipeline style {style!r}. HINT: use one of {list(STAGE_TO_RANK)}.")
    num_stages = pp * stages_per_rank
    stage_to_rank = STAGE_TO_RANK[style](num_stages, pp)
    if isinstance(balance, str):
        split = split_by_cost(names, costs, num_stages)
        if holds_parameters is not None and _rank_without_parameters(split, stage_to_rank, names, holds_parameters):
            split = _split_keeping_parameters(names, costs, holds_parameters, num_stages) or split
    else:
        split = split_explicit(names, balance)
        if len(split) != num_stages:
            raise ValueError(
                f"the explicit split has {len(split)} stages but pp({pp}) x stages_per_rank({stages_per_rank}) = "
                f"{num_stages}. HINT: give exactly {num_stages} stages or change pp / stages_per_rank."
            )
    cost_of = dict(zip(names, costs, strict=True))
    return Partition(
        stages=tuple(tuple(stage) for stage in split),
        stage_to_rank=tuple(stage_to_rank),
        costs=tuple(sum(cost_of[name] for name in stage) for stage in split),
        cost_unit=cost_unit,
    )


def _rank_without_parameters(
    split: Sequence[Sequence[str]], stage_to_rank: Sequence[int], names: Sequence[str], holds: Sequence[bool]
) -> bool:
    holder = dict(zip(names, holds, strict=True))
    ranks_with = {stage_to_rank[i] for i, stage in enumerate(split) if any(holder[name] for name in stage)}
    return len(ranks_with) < len(set(stage_to_rank))


def _split_keeping_parameters(
    names: Sequence[str], costs: Sequence[float], holds: Sequence[bool], num_stages: int
) -> list[list[str]] | None:
    """Split units instead of blocks: each parameter-free block joins the next block with parameters (trailing
    ones the last), so every stage holds parameters; None when there are fewer such units than stages."""
    units: list[list[int]] = []
    pending: list[int] = []
    for index, has in enumerate(holds):
        pending.append(index)
        if has:
            units.append(pending)
            pending = []
    if not units or len(units) < num_stages:
        return None
    units[-1].extend(pending)
    unit_costs = [sum(costs[i] for i in unit) for unit in units]
    split = split_by_cost([str(u) for u in range(len(units))], unit_costs, num_stages)
    return [[names[i] for u in stage for i in units[int(u)]] for stage in split]


def shared_across_ranks(model: nn.Module, partition: Partition) -> dict[str, list[str]]:
    """Parameters used by blocks on different pipeline ranks (e.g. an embedding tied to the head): for each,
    its qualified names. Pruning would leave each rank its own copy, and the copies would drift apart."""
    rank_of = {name: partition.stage_to_rank[i] for i, stage in enumerate(partition.stages) for name in stage}
    holders: dict[int, tuple[set[int], list[str]]] = {}
    for block, child in model.named_children():
        for name, param in child.named_parameters(remove_duplicate=False):
            ranks, names = holders.setdefault(id(param), (set(), []))
            ranks.add(rank_of.get(block, -1))
            names.append(f"{block}.{name}")
    return {names[0]: names for ranks, names in holders.values() if len(ranks) > 1}
