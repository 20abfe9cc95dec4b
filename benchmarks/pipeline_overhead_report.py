"""pipeline_overhead.py's report, in the main process: each run's critical path across its ranks, hand-written against
strategy per (schedule, micro-batches), the verdict on the target, and the markdown table. It runs nothing.
"""

from __future__ import annotations

import statistics
from typing import Any

from overhead import QUIET, TARGET, ms_range, overhead_per_repeat, quiet_runs
from timing import other_cores, stats_ms


def critical_path(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per measured step across the ranks of one run (steps start together at a barrier). step: the
    slowest rank's window; outside_schedule: the part of the step's span in which no rank is inside
    schedule.step; between: barrier-to-barrier period minus step. other_load_cores: others' CPU use."""
    n = len(runs[0]["start"])
    timed = bool(runs[0]["schedule_start"])
    if timed and any(len(run["schedule_start"]) != n for run in runs):
        raise RuntimeError("expected exactly one schedule.step per training step")
    out: dict[str, Any] = {"step_s": [], "outside_schedule_s": [], "between_s": []}
    for i in range(warmup, n):
        starts, ends = [run["start"][i] for run in runs], [run["end"][i] for run in runs]
        out["step_s"].append(max(e - s for s, e in zip(starts, ends, strict=True)))
        if timed:
            span = max(run["schedule_end"][i] for run in runs) - min(run["schedule_start"][i] for run in runs)
            out["outside_schedule_s"].append(max(ends) - min(starts) - span)
        if i + 1 < n:
            period = max(run["start"][i + 1] - run["start"][i] for run in runs)
            out["between_s"].append(period - out["step_s"][-1])
    out["other_load_cores"] = other_cores(runs)
    return out


def compare(hand: list[dict[str, Any]], strat: list[dict[str, Any]]) -> dict[str, Any]:
    """Hand-written against strategy runs of one config: wall-clock steps, and the robust costs (medians of
    what lies outside schedule.step in the window, and of the time between windows)."""

    def median_ms(of: list[dict[str, Any]], series: str) -> float:
        return statistics.median(t for run in of for t in run[series]) * 1e3

    hand_step, strat_step = median_ms(hand, "step_s"), median_ms(strat, "step_s")
    in_window = median_ms(strat, "outside_schedule_s") - median_ms(hand, "outside_schedule_s")
    between = median_ms(strat, "between_s") - median_ms(hand, "between_s")
    return {
        "runs": [len(hand), len(strat)],
        "handwritten_step_ms": stats_ms([t for run in hand for t in run["step_s"]]),
        "strategy_step_ms": stats_ms([t for run in strat for t in run["step_s"]]),
        "overhead": strat_step / hand_step - 1,
        "added_in_window_ms": in_window,
        "added_between_steps_ms": between,
        "added_per_iteration": (in_window + between) / hand_step,
    }


def summarise(runs: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    single = [r for r in runs if r["kind"] == "single"]
    load = [r["other_load_cores"] for r in runs]
    summary: dict[str, Any] = {
        "single_step_ms": stats_ms([t for run in single for t in run["step_s"]]),
        "single_parameter_bytes": single[0]["per_rank"][0]["parameter_bytes"],
        "other_load_cores": {"mean": statistics.mean(load), "max": max(load)},
    }
    for schedule, m in config["configs"]:
        hand, strat = (
            [r for r in runs if r["kind"] == kind and (r["schedule"], r["microbatches"]) == (schedule, m)]
            for kind in ("handwritten", "strategy")
        )
        quiet_hand, quiet_strat = quiet_runs(hand), quiet_runs(strat)
        row = {
            "all": compare(hand, strat),
            "quiet": compare(quiet_hand, quiet_strat) if quiet_hand and quiet_strat else None,
            "overhead_per_repeat": overhead_per_repeat(hand, strat),
            "parameter_bytes_per_rank": [r["parameter_bytes"] for r in strat[0]["per_rank"]],
            "handwritten_parameter_bytes_per_rank": [r["parameter_bytes"] for r in hand[0]["per_rank"]],
            "schedule_used": strat[0]["per_rank"][0]["schedule_used"],
        }
        # others' load is not the strategy's cost: judge on the quiet runs when there are some of each kind
        basis = row["quiet"] or row["all"]
        robust, wall = basis["added_per_iteration"] <= TARGET, basis["overhead"] <= TARGET
        row["verdict"] = "yes" if robust and wall else "NO" if not robust else "unresolved: wall-clock noise"
        summary[f"{schedule} m={m}"] = row
    return summary


def markdown(summary: dict[str, Any], config: dict[str, Any]) -> str:
    full, load, model, fmt = summary["single_parameter_bytes"], summary["other_load_cores"], config["model"], ms_range
    lines = [
        "# PipelineParallelStrategy overhead",
        "",
        f"`benchmarks/pipeline_overhead.py`, {config['date']}, {config['machine']}. {model['blocks']} x (Linear("
        f"{model['width']}, {model['width']}) + GELU), batch {model['batch']}, MSE, SGD, PP={config['pp']}, one thread "
        "per process, gloo; "
        f"{config['repeats']} interleaved repeats (ABBA) x {config['steps']} steps after {config['warmup']} "
        f"warm-up steps. Other processes used {load['mean']:.2f} cores on average during the runs "
        f"(max {load['max']:.2f}); on 2 cores anything above ~0.1 inflates and scatters every number.",
        "",
        "- **step** (all runs; median (p10-p90), ms): barrier, then on_train_batch_start to on_train_batch_end "
        "(strategy) or schedule.step + optimizer.step + zero_grad (hand-written); the slowest rank.",
        f"- **quiet**: runs during which other processes used < {QUIET} core. The columns after it, and the "
        "verdict, use the quiet runs when there are some of each kind, else all runs.",
        "- **added in window**: per step, the time from the first rank leaving the barrier to the last one "
        "finishing in which no rank is inside torch's schedule.step; strategy minus hand-written medians. "
        "**between steps**: barrier-to-barrier period minus the step, the same way (Lightning's loop between "
        "steps). Their sum over the hand-written step is the strategy's cost, free of the schedule's own "
        "run-to-run noise (+-10% here even on an idle machine).",
        "",
        f"| config | hand-written ms | strategy ms | overhead (per-repeat range) | quiet: overhead (runs) "
        f"| added in window | added between steps | added per iteration | <= {TARGET:.0%} | params/rank (bytes) "
        "| vs single |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for schedule, m in config["configs"]:
        row = summary[f"{schedule} m={m}"]
        every, basis = row["all"], row["quiet"] or row["all"]
        spread = f"{min(row['overhead_per_repeat']):+.1%} .. {max(row['overhead_per_repeat']):+.1%}"
        quiet = (
            "-"
            if row["quiet"] is None
            else f"{row['quiet']['overhead']:+.1%} ({' + '.join(map(str, row['quiet']['runs']))})"
        )
        per_rank = row["parameter_bytes_per_rank"]
        lines.append(
            f"| {schedule} m={m} | {fmt(every['handwritten_step_ms'])} | {fmt(every['strategy_step_ms'])} | "
            f"{every['overhead']:+.1%} ({spread}) | {quiet} | {basis['added_in_window_ms']:+.2f} ms | "
            f"{basis['added_between_steps_ms']:+.2f} ms | {basis['added_per_iteration']:+.1%} | {row['verdict']} | "
            f"{' / '.join(f'{b:,}' for b in per_rank)} | {' / '.join(f'{b / full:.2f}' for b in per_rank)} |"
        )
    lines.append(f"| single process, plain loop | {fmt(summary['single_step_ms'])} | | | | | | | | {full:,} | 1.00 |")
    return "\n".join(lines) + "\n"
