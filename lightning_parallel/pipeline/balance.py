"""Where to cut an ordered list of blocks into pipeline stages: the most even contiguous split by cost (exact, by
dynamic programming over prefix sums), or the user's explicit block names per stage, checked. Pure arithmetic on
names and numbers: no modules, no ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def split_by_cost(names: Sequence[str], costs: Sequence[float], num_stages: int) -> list[list[str]]:
    """Split blocks into exactly ``num_stages`` contiguous, non-empty stages minimising the largest stage cost.

    Among the splits with the smallest maximum, the one with the smallest sum of squared stage costs (the
    most even) is returned.

    Args:
        names: Block names in model order.
        costs: Non-negative cost per block.
        num_stages: Number of stages to produce.

    Returns:
        Block names per stage.
    """
    if len(names) != len(costs):
        raise ValueError(f"got {len(names)} block names but {len(costs)} costs. HINT: give exactly one cost per block.")
    if num_stages < 1:
        raise ValueError(f"num_stages {num_stages} must be >= 1. HINT: use pipeline size x virtual stages per rank.")
    if num_stages > len(names):
        raise ValueError(
            f"cannot split {len(names)} blocks into {num_stages} stages: each stage needs at least one block. "
            f"HINT: use at most {len(names)} stages (pipeline size x virtual stages per rank) or a model with "
            "more blocks"
        )
    bad = [(name, cost) for name, cost in zip(names, costs, strict=True) if not (math.isfinite(cost) and cost >= 0)]
    if bad:
        raise ValueError(f"block costs must be finite and >= 0, got {bad}. HINT: check the measured block costs.")
    # Every stage cost is taken as a prefix-sum difference, so the search and the final split compare the
    # very same floats and the optimum is exact.
    prefix = [0.0, *itertools.accumulate(float(cost) for cost in costs)]
    cap = _min_max_cost(prefix, num_stages)
    bounds = _most_even_split(prefix, num_stages, cap)
    return [list(names[start:end]) for start, end in itertools.pairwise(bounds)]


def _greedy_stage_count(prefix: list[float], cap: float) -> int:
    """Fewest contiguous stages with every stage cost <= cap; filling each stage greedily is optimal."""
    count, start = 1, 0
    for end in range(1, len(prefix)):
        if prefix[end] - prefix[start] > cap:
            count, start = count + 1, end - 1
            if prefix[end] - prefix[start] > cap:
                return len(prefix)  # one block alone exceeds the cap: no number of stages fits
    return count


def _min_max_cost(prefix: list[float], num_stages: int) -> float:
    """Smallest achievable maximum stage cost: the optimum is one of the O(n^2) contiguous segment costs."""
    n = len(prefix) - 1
    candidates = sorted({prefix[end] - prefix[start] for start in range(n) for end in range(start + 1, n + 1)})
    low, high = 0, len(candidates) - 1  # the largest candidate (all blocks in one stage) is always feasible
    while low < high:
        mid = (low + high) // 2
        if _greedy_stage_count(prefix, candidates[mid]) <= num_stages:
            high = mid
        else:
            low = mid + 1
    return candidates[low]


def _most_even_split(prefix: list[float], num_stages: int, cap: float) -> list[int]:
    """Stage boundaries of the split with stage costs <= cap that minimises the sum of squared stage costs."""
    n = len(prefix) - 1
    # best[k][j]: smallest sum of squares covering the first j blocks with k stages; parent[k][j]: last start.
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    parent = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for end in range(k, n - (num_stages - k) + 1):
            for start in range(end - 1, k - 2, -1):
                cost = prefix[end] - prefix[start]
                if cost > cap:
                    break  # earlier starts only add cost
                value = best[k - 1][start] + cost * cost
                if value < best[k][end]:
                    best[k][end], parent[k][end] = value, start
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(parent[k][bounds[-1]])
    return bounds[::-1]


def split_explicit(names: Sequence[str], stages: Sequence[Sequence[str]]) -> list[list[str]]:
    """Validate a user's split: every block exactly once, contiguous, in model order, no empty stage.

    Args:
        names: Block names of the model, in order.
        stages: Block names per stage, as the user wrote them.

    Returns:
        The same split as lists.
    """
    split = [list(stage) for stage in stages if not isinstance(stages, str) and not isinstance(stage, str)]
    empty = [index for index, stage in enumerate(split) if not stage]
    if len(split) != len(stages) or not split or empty:
        raise ValueError(
            f"an explicit split must be a non-empty list of non-empty lists of block names, got {stages!r}. "
            "HINT: write e.g. [[stem, layer1_0], [layer1_1, head]]."
        )
    flat = [name for stage in split for name in stage]
    unknown = sorted(set(flat) - set(names), key=flat.index)
    if unknown:
        raise ValueError(f"unknown blocks {unknown} in the explicit split. HINT: valid block names are {list(names)}.")
    duplicated = sorted({name for name in flat if flat.count(name) > 1}, key=flat.index)
    missing = [name for name in names if name not in flat]
    if duplicated or missing:
        raise ValueError(
            f"every block must appear in exactly one stage: duplicated {duplicated}, missing {missing}. "
            "HINT: list each block of the model once."
        )
    if flat != list(names):
        position = next(index for index, (got, want) in enumerate(zip(flat, names, strict=True)) if got != want)
        stage = next(index for index, bound in enumerate(itertools.accumulate(map(len, split))) if position < bound)
        raise ValueError(
            f"the explicit split is out of model order: stage {stage} has {flat[position]!r} where "
            f"{names[position]!r} comes next. HINT: stages must be contiguous runs of blocks in model order."
        )
    return split
