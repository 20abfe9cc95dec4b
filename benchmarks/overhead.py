"""What the overhead benchmarks (pipeline_overhead.py, tensor_overhead.py, overhead_3d.py: a strategy inside a Trainer
against the same layout written by hand) share: the target, quiet runs, one record per run merged from its ranks, and
the command line and results file around a launch of their `--worker` ranks. It knows no model, strategy or table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning
from harness import arguments, counts, launch, machine, write_results

TARGET = 0.05  # the strategy may cost at most 5% more per step than the hand-written loop
QUIET = 0.1  # a run is quiet when other processes used less than this many cores during it
Runs = list[dict[str, Any]]


def ms_range(stats: dict[str, float]) -> str:
    """A `stats_ms` summary as a cell: 'median (p10-p90)'."""
    return f"{stats['median']:.1f} ({stats['p10']:.1f}-{stats['p90']:.1f})"


def quiet_runs(runs: Runs) -> Runs:
    """The runs during which other processes used fewer than QUIET cores."""
    return [run for run in runs if run["other_load_cores"] < QUIET]


def overhead_per_repeat(hand: Runs, strat: Runs) -> list[float]:
    """Strategy / hand-written - 1 on the median step of each repeat's pair of runs."""
    return [
        statistics.median(s["step_s"]) / statistics.median(h["step_s"]) - 1 for h, s in zip(hand, strat, strict=True)
    ]


def merge_ranks(
    per_rank: list[Runs], names: tuple[str, ...], critical_path: Callable[[Runs, int], dict[str, Any]], warmup: int
) -> Runs:
    """One entry per run (named by the values of `names`): its critical-path series and every rank's raw numbers."""
    by_key = [{tuple(run[k] for k in names): run for run in rank_runs} for rank_runs in per_rank]
    merged = []
    for first in per_rank[0]:
        key = tuple(first[k] for k in names)
        runs = [ranks[key] for ranks in by_key if key in ranks]  # single: rank 0 only
        merged.append({**{k: first[k] for k in names}, **critical_path(runs, warmup), "per_rank": runs})
    return merged


def main(
    name: str,
    script: str,
    *,
    description: str,
    ranks: int,
    timeout: float,
    setting: dict[str, Any],
    run_names: tuple[str, ...],
    worker: Callable[[Path, argparse.Namespace], None],
    critical_path: Callable[[Runs, int], dict[str, Any]],
    summarise: Callable[[Runs, dict[str, Any]], dict[str, Any]],
    markdown: Callable[[dict[str, Any], dict[str, Any]], str],
) -> None:
    """`script --steps 8 --warmup 2 --repeats 10`: its `worker` on `ranks` ranks under torchrun, their runs merged,
    summarised and written to results/<name>.{json,md} with the config (the counts, date, machine, `setting`)."""
    args = arguments(description, steps=8, warmup=2, repeats=10, timeout=timeout)
    if args.worker is not None:
        worker(args.worker, args)
        return
    started = time.perf_counter()
    runs = merge_ranks(launch(script, ranks, counts(args), timeout=args.timeout), run_names, critical_path, args.warmup)
    config = {
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{machine()}, lightning {lightning.__version__}",
        **setting,
        "target_overhead": TARGET,
        "wall_s": time.perf_counter() - started,
    }
    summary = summarise(runs, config)
    report = {"config": config, "summary": summary, "runs": runs}
    write_results(name, report, markdown(summary, config), config["wall_s"])
