"""sync_vs_async.py's report: one table per workload (time and steps to the target, final metric, bytes per step,
async staleness), the page around them and a loss-vs-time plot per workload. It runs nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from harness import RESULTS, write_results
from sync_vs_async_cases import METHODS, PERIODS, RUN, SLOWDOWN, WORKLOADS


def plot(result: dict[str, Any], workload: str) -> Path:
    """Validation loss (and accuracy, for a classifier) against rank 0's wall time; one column per condition."""
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)  # mathtext's font fallbacks, one line each
    import matplotlib.pyplot as plt

    rows = [r for r in result["runs"] if r["workload"] == workload and "curve" in r]
    metric, target = WORKLOADS[workload]["target"]
    panels = ["loss", "acc"] if metric == "acc" else ["loss"]
    conditions = [False, True] if any(r["straggler"] for r in rows) else [False]
    figure, axes = plt.subplots(len(panels), len(conditions), figsize=(5.5 * len(conditions), 3.6 * len(panels)),
                                squeeze=False, sharex="col")  # fmt: skip
    for column, straggler in enumerate(conditions):
        for line, method in enumerate(METHODS):
            run = next((r for r in rows if r["method"] == method and r["straggler"] == straggler), None)
            if run is None:
                continue
            for row, name in enumerate(panels):
                ax = axes[row][column]
                times = [p["time_s"] for p in run["curve"]]
                ax.plot(times, [p[name] for p in run["curve"]], label=method, color=f"C{line}", marker=".", ms=3)
                if run["to_target"] and name == metric:
                    ax.plot(run["to_target"]["time_s"], target, "o", color=f"C{line}", mfc="none", ms=9)
        for row, name in enumerate(panels):
            ax = axes[row][column]
            if name == metric:
                ax.axhline(target, color="grey", lw=0.8, ls="--")
            ax.set_ylabel(f"validation {'accuracy' if name == 'acc' else 'loss'}")
            ax.grid(alpha=0.3)
            if name == "loss" and metric == "acc":
                ax.set_yscale("log")
        axes[0][column].set_title(f"{'rank 1 slowed 2x' if straggler else 'no straggler'}")
        axes[-1][column].set_xlabel("wall time since training started (s, rank 0)")
    axes[0][0].legend()
    figure.suptitle(f"{WORKLOADS[workload]['label']}, {result['devices']} CPU processes", fontsize=10)
    figure.tight_layout()
    path = RESULTS / f"{stem(result)}_{workload}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def table(result: dict[str, Any], workload: str) -> list[str]:
    spec = WORKLOADS[workload]
    metric, target = spec["target"]
    name = "accuracy" if metric == "acc" else "loss"
    workload_args = " ".join(spec["overrides"]) or "model=simple_cnn data=digits (train.py's defaults)"
    rows = [r for r in result["runs"] if r["workload"] == workload]
    lines = [
        f"## {spec['label']}",
        "",
        f"Target: validation {name} {'>=' if metric == 'acc' else '<='} {target}{spec['note']}. `{workload_args}`; "
        f"{rows[0]['steps']} optimizer steps per worker; {rows[0].get('parameters', 0):,} parameters (P).",
        "",
        "| method | straggler | time to target s | vs ddp | steps to target | final val accuracy | final val loss | "
        "training s | step ms per rank | bytes / worker / step | formula (n workers, P parameters) | "
        "async: server updates; staleness mean / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        slow = "rank 1 x2" if r["straggler"] else "-"
        if "error" in r:
            lines.append(f"| {r['method']} | {slow} | failed: {r['error']} |" + " |" * 9)
            continue
        ddp = next((d for d in rows if d["method"] == "ddp" and d["straggler"] == r["straggler"]), None)
        hit, base = r["to_target"], (ddp or {}).get("to_target")
        versus = f"{hit['time_s'] / base['time_s']:.2f}x" if hit and base else "-"
        stale = "-"
        if "async" in r:
            seen = [s for s in r["async"]["staleness"] or [] if s.get("mean") is not None]
            stale = f"{r['async']['updates']}; " + ", ".join(f"r{s['rank']} {s['mean']:.2f} / {s['max']}" for s in seen)
        comm, when = r["communication"], f"{hit['time_s']:.1f}" if hit else "not reached"
        accuracy = f"{r['final']['acc']:.4f}" if "acc" in r["final"] else "-"
        step_ms = " / ".join(f"{t * 1e3:.1f}" for t in r["step_time_s_per_rank"])
        lines.append(
            f"| {r['method']} | {slow} | {when} | {versus} | "
            f"{hit['step'] if hit else '-'} | {accuracy} | {r['final']['loss']:.4f} | "
            f"{r['train_s']:.1f} | {step_ms} | {comm['bytes'] / 1e6:.3f} MB | {comm['formula']} | {stale} |"
        )
    return lines


def stem(result: dict[str, Any]) -> str:
    """Result files per process count: `sync_vs_async_2p.md`, `sync_vs_async_4p.md`."""
    return f"sync_vs_async_{result['devices']}p"


def write_report(result: dict[str, Any]) -> None:
    workloads = list(dict.fromkeys(r["workload"] for r in result["runs"]))
    lines = [
        "# Synchronous vs local vs asynchronous SGD",
        "",
        f"`benchmarks/sync_vs_async.py{' --quick' if result['quick'] else ''}`, {result['when']}, {result['machine']}; "
        f"{result['wall_s'] / 60:.1f} min. {result['devices']} CPU processes (gloo, one thread each); one `train.py` "
        f"run per (workload, method, straggler) with `{' '.join(RUN)}`. One run each: timings to a target carry "
        "run-to-run noise (the GPT's loss sits on a plateau near ln(32) and then drops, a sudden step whose timing "
        "varies), and the time resolution is the snapshot spacing.",
        *(
            [
                "",
                f"**{result['devices']} processes on {os.cpu_count()} cores**: processes share cores, so each "
                "worker's step also waits for the CPU, and a straggler's sleep hands its core to the others.",
            ]
            if result["devices"] > (os.cpu_count() or 1)
            else []
        ),
        "",
        "- **time / steps to target**: rank 0's weights are copied right after a synchronisation point (every few "
        "steps: DDP and async any step; local SGD after steps 1, 1 + period, ...; DiLoCo after multiples of the "
        "period) and at the end, with rank 0's seconds since training started, by `benchmarks/race.py`'s `Snapshots`; "
        "this script scores them on the whole validation split. In-run validation is off: under async SGD it is a "
        "meeting of all workers, which would pace the fast worker by the slow one. Steps are rank 0's own optimizer "
        "steps (async: the server applied about n x as many updates, each of one worker's batch).",
        "- **straggler**: `race.Straggler` on rank 1 sleeps after each forward+backward as long as they took "
        f"(x{SLOWDOWN:.0f} the step's compute). The column *step ms* (summary.json's `step_time_s_per_rank`) shows the "
        "slowdown that resulted: where Lightning's per-step overhead is a large share of a step (SimpleCNN on digits) "
        "rank 1 is less than 2x slower.",
        f"- **periods**: local SGD {PERIODS['local_sgd']} (no warm-up), DiLoCo {PERIODS['diloco']} (outer Nesterov SGD "
        "lr 0.7, momentum 0.9); same per-worker batch and AdamW as train.py's defaults for every method.",
        "- **bytes / worker / step**: sent + received per worker per optimizer step, from the method's row in "
        "`lightning_parallel/sync_methods.py` (fp32: 4 bytes per value), not measured; a ring all-reduce of B bytes "
        "sends and receives 2 (n-1)/n x B each. Not counted: DDP's 4-byte training-loss all-reduce "
        "(`sync_dist=True`) and Lightning's per-batch SIGTERM broadcast; local SGD, DiLoCo and async skip both "
        "(`strategies/steps_alone.py`), so between syncs their workers never meet.",
        "",
    ]
    for workload in workloads:
        lines += [*table(result, workload), "", f"![{workload}]({stem(result)}_{workload}.png)", ""]
    write_results(stem(result), result, "\n".join(lines), result["wall_s"], indent=2, show=False)
    for workload in workloads:
        plot(result, workload)
