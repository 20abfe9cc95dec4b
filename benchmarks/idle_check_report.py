"""idle_check.py's report, in the main process: each (case, schedule, rank)'s shares as medians over the repeats, and
the markdown table of the profiler's shares against the StageTimer's idle. It runs nothing.
"""

from __future__ import annotations

import statistics
from typing import Any


def aggregate(per_rank: list[list[dict[str, Any]]], cases: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """Per (case, schedule, rank): the median of each share over the repeats, and the StageTimer's idle range; rows in
    the order of `cases` (name, model, schedule)."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for rank, runs in enumerate(per_rank):
        for run in runs:
            groups.setdefault((run["case"], run["schedule"], rank), []).append(run)
    rows = []
    for (case, schedule, rank), runs in groups.items():
        row: dict[str, Any] = {"case": case, "schedule": schedule, "rank": rank, "repeats": len(runs)}
        row.update({key: runs[0][key] for key in ("blocks", "bubble_fraction")})
        row["other_load_cores"] = max(r["other_load_cores"] for r in runs)
        for part in ("profiler", "stage_timer", "stage_timer_unprofiled"):
            row[part] = {
                key: statistics.median(r[part][key] for r in runs) if runs[0][part][key] is not None else None
                for key in runs[0][part]
            }
        row["stage_timer_idle_range"] = [f(r["stage_timer"]["idle"] for r in runs) for f in (min, max)]
        rows.append(row)
    order = {(name, schedule): i for i, (name, _, schedule) in enumerate(cases)}
    return sorted(rows, key=lambda r: (order[(r["case"], r["schedule"])], r["rank"]))


def markdown(result: dict[str, Any], pp: int) -> str:
    cfg = result["config"]
    lines = [
        "# Pipeline idle: the StageTimer against torch's profiler",
        "",
        f"`benchmarks/idle_check.py`, {cfg['date']}, {cfg['machine']}; {cfg['minutes']:.1f} min. "
        f"PipelineParallelStrategy, PP={pp}, 4 micro-batches, AdamW, 2 single-threaded gloo ranks (torchrun); per "
        f"case {cfg['steps']} profiled training steps after {cfg['warmup']} warm-up steps, then {cfg['after']} "
        f"unprofiled; medians of {cfg['repeats']} repeats. The machine may be shared with other jobs (2 cores; "
        "see other load): a busy core stretches the waits, so absolute times and the tiny model's shares vary "
        "from run to run; compare columns within one row.",
        "",
        "- **profiler**: shares of schedule.step on the rank's main thread from torch's profiler trace: the stage's "
        "own forward and backward ops (**compute**), send/recv ops and torch's wait on them (**comm**), other ops "
        "(the loss, micro-batch splitting, copies, gradient scaling) and no op (Python: the schedule, hooks, "
        "autograd's engine). **profiler idle** = 1 - compute. **1 - actions**: 1 - the share inside torch's own "
        "`PP:<stage><F|B|I|W><mb>` ranges around each compute action, less the comm inside them (multi-stage "
        "schedules only): the stage's compute with torch's Python around it.",
        "- **StageTimer idle**: the end-of-run table's column for the same steps (1 - hooked forward/backward "
        "time / schedule.step time; min-max over the repeats in brackets); unprofiled: the steps after, without "
        "the profiler's overhead; forward only: counting only forwards as busy, as the StageTimer did for "
        "split-backward schedules (zbv) before it timed their I and W passes.",
        "- **bubble**: the schedule's analytic idle share under unit costs (the table's caption). **other load**: "
        "cores other processes kept busy during the case, the largest of the repeats (anything above ~0.1 "
        "inflates the waits).",
        "",
        "| case | schedule | rank | blocks | schedule.step ms | compute | comm | other ops | no op | profiler idle "
        "| 1 - actions | StageTimer idle | StageTimer idle, unprofiled | forward only | bubble | other load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        p, t, u = row["profiler"], row["stage_timer"], row["stage_timer_unprofiled"]
        actions = f"{1 - p['actions']:.0%}" if p["actions"] is not None else "-"
        low, high = row["stage_timer_idle_range"]
        lines.append(
            f"| {row['case']} | {row['schedule']} | {row['rank']} | {', '.join(row['blocks'])} | "
            f"{p['schedule_step_ms']:.1f} | {p['compute']:.0%} | {p['comm']:.0%} | {p['other_ops']:.0%} | "
            f"{p['no_op']:.0%} | {1 - p['compute']:.0%} | {actions} | {t['idle']:.0%} ({low:.0%}-{high:.0%}) | "
            f"{u['idle']:.0%} | {t['idle_forward_only']:.0%} | {row['bubble_fraction']:.0%} | "
            f"{row['other_load_cores']:.2f} |"
        )
    return "\n".join(lines) + "\n"
