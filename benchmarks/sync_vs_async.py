"""Synchronous DDP vs local SGD vs DiLoCo vs asynchronous SGD, each run by train.py on the same step budget: wall time
and steps to a target, final metric and bytes communicated per worker per step, with and without one worker made 2x
slower. Rank 0's weights are recorded during training (benchmarks/race.py) and evaluated here, outside the run, so no
validation meeting paces the workers. Writes results/sync_vs_async_<n>p.{json,md} (n processes) and one loss-vs-time
plot per workload.
Usage: .venv/bin/python benchmarks/sync_vs_async.py [--quick] [--workloads digits gpt] [--methods ddp async_sgd]
Over 300 lines: one measurement, its worker mode and its report in one script, so a result file traces to one
command.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import RESULTS, ROOT, train_py, write_results
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from timing import machine

from lightning_parallel.sync_methods import SYNC_METHODS

sys.path.insert(0, str(ROOT))

from train import build_model, build_task  # noqa: E402

RUN = [
    "trainer.accelerator=cpu", "trainer.max_epochs=1000", "trainer.limit_val_batches=0", "callbacks=none",
    "~logger", "+trainer.enable_progress_bar=false", "+trainer.enable_checkpointing=false",
]  # fmt: skip
# steps: each worker's optimizer steps (full, --quick); every: steps between snapshots of rank 0's weights
WORKLOADS: dict[str, dict[str, Any]] = {
    "digits": {"overrides": [], "label": "SimpleCNN on digits", "target": ("acc", 0.95), "steps": (400, 100),
               "every": 10, "note": ""},
    "gpt": {"overrides": ["model=transformer", "data=synthetic_tokens"], "label": "GPT (depth 4, width 128) on "
            "synthetic copy tokens", "target": ("loss", 2.0), "steps": (240, 100), "every": 10,
            "note": " (the floor is ln(32) / 2 = 1.73: the first half of each sequence is random)"},
}  # fmt: skip
PERIODS = {"local_sgd": 4, "diloco": 10}  # conf/strategy's defaults, stated here so the table can name them
METHODS: dict[str, list[str]] = {
    "ddp": ["strategy=ddp"],
    "local_sgd": ["strategy=local_sgd", f"strategy.period={PERIODS['local_sgd']}", "strategy.warmup_steps=0"],
    "diloco": ["strategy=diloco", f"strategy.period={PERIODS['diloco']}"],
    "async_sgd": ["strategy=async_sgd"],
}
SLOWDOWN = 2.0


def snapshot_schedule(method: str, every: int) -> tuple[int, int]:
    """(every, offset) putting snapshots right after a synchronisation: torch's PeriodicModelAverager averages
    after optimizer steps 1, 1 + period, ...; DiLoCo syncs after period, 2 x period, ..."""
    if method == "local_sgd":
        return PERIODS[method] * math.ceil(every / PERIODS[method]), 1
    if method == "diloco":
        return PERIODS[method] * math.ceil(every / PERIODS[method]), 0
    return every, 0


# ---- evaluation outside the run ------------------------------------------------------------------------------------
class Evaluator:
    """The workload's validation split and network, built from train.py's own config; scores saved weights."""

    def __init__(self, overrides: list[str]) -> None:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, "paths.output_dir=/tmp/unused"])
        data = instantiate(cfg.data)
        self.task = build_task(cfg, build_model(cfg, data.model_hints), data)
        self.task.eval()
        xs, ys = zip(*[data.splits()[1][i] for i in range(len(data.splits()[1]))], strict=True)
        self.x, self.y = torch.stack(xs), torch.stack([torch.as_tensor(y) for y in ys])
        self.parameters = sum(p.numel() for p in self.task.model.parameters())
        self.buffers = sum(b.numel() for b in self.task.model.buffers() if b.is_floating_point())

    @torch.no_grad()
    def score(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        self.task.model.load_state_dict(state)
        output = self.task.model(self.x)
        scores = {"loss": float(self.task.loss_fn(output, self.y))}
        if output.dim() == 2:  # (N, classes): classification
            scores["acc"] = float((output.argmax(1) == self.y).float().mean())
        return scores


def reached(curve: list[dict[str, Any]], metric: str, target: float) -> dict[str, Any] | None:
    """The first snapshot at or past the target (accuracy up, loss down)."""
    for point in curve:
        if (point[metric] >= target) if metric == "acc" else (point[metric] <= target):
            return point
    return None


# ---- communication -------------------------------------------------------------------------------------------------
def bytes_per_step(method: str, parameters: int, buffers: int, workers: int, steps: int) -> dict[str, Any]:
    """Bytes a worker sends plus receives per optimizer step over this run, from what the method exchanges
    (`lightning_parallel.sync_methods`, which the planner and the sweep report read too)."""
    row, period = SYNC_METHODS[method], PERIODS.get(method, 1)
    sent = row.bytes_per_step(parameters, workers, period=period, buffers=buffers, steps=steps)
    return {"bytes": sent, "formula": row.formula(period)}


def measure(workload: str, method: str, straggler: bool, steps: int, devices: int, ev: Evaluator) -> dict[str, Any]:
    spec = WORKLOADS[workload]
    every, offset = snapshot_schedule(method, spec["every"])
    row: dict[str, Any] = {"workload": workload, "method": method, "straggler": straggler, "steps": steps,
                           "snapshot_every": every, "snapshot_offset": offset}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        snapshots = Path(tmp) / "snapshots.pt"
        callbacks = ["+callbacks.snapshots._target_=race.Snapshots", f"+callbacks.snapshots.path={snapshots}",
                     f"+callbacks.snapshots.every={every}", f"+callbacks.snapshots.offset={offset}"]  # fmt: skip
        if straggler:
            callbacks += ["+callbacks.straggler._target_=race.Straggler", "+callbacks.straggler.rank=1",
                          f"+callbacks.straggler.slowdown={SLOWDOWN}"]  # fmt: skip
        overrides = [*spec["overrides"], *METHODS[method], *RUN, f"trainer.devices={devices}",
                     f"trainer.max_steps={steps}", *callbacks]  # fmt: skip
        row["overrides"] = [o for o in overrides if "snapshots.path" not in o]
        summary = train_py(overrides)  # race.py's callbacks: every rank imports them from this folder
        if "error" in summary:
            print(f"  {method} straggler={straggler}: FAILED: {summary['error']}", flush=True)
            return row | {"error": summary["error"]}
        taken = torch.load(snapshots, weights_only=True)
    row["curve"] = [{"step": s["step"], "time_s": s["time_s"], "final": s["final"], **ev.score(s["state"])}
                    for s in taken]  # fmt: skip
    metric, target = spec["target"]
    hit = reached(row["curve"], metric, target)
    row["to_target"] = None if hit is None else {"time_s": hit["time_s"], "step": hit["step"]}
    row["final"] = row["curve"][-1]
    row |= {key: summary[key] for key in ("parameters", "wall_time_s", "step_time_s_per_rank", "run_s")}
    row["train_s"] = row["final"]["time_s"]
    row["communication"] = bytes_per_step(method, summary["parameters"], ev.buffers, devices, steps)
    if method == "async_sgd":
        row["async"] = {key: summary["parallel"].get(key) for key in ("updates", "staleness")}
    shown = f"{hit['time_s']:.1f} s / step {hit['step']}" if hit else "not reached"
    print(f"  {method:9s} straggler={straggler!s:5s} target {shown}; final {metric} {row['final'][metric]:.4f}, "
          f"{row['train_s']:.1f} s training, {row['run_s']:.0f} s run", flush=True)  # fmt: skip
    return row


# ---- report --------------------------------------------------------------------------------------------------------
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short step budget (a smoke run)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--devices", type=int, default=2, help="worker processes (2 on a 2-core machine)")
    parser.add_argument("--no-straggler", action="store_true", help="skip the runs with a slowed rank 1")
    args = parser.parse_args()
    started = time.perf_counter()
    runs = []
    for workload in args.workloads:
        spec = WORKLOADS[workload]
        steps = spec["steps"][1 if args.quick else 0]
        evaluator = Evaluator(spec["overrides"])
        print(f"{workload}: {steps} steps per worker, {evaluator.parameters:,} parameters", flush=True)
        for straggler in [False] if args.no_straggler else [False, True]:
            for method in args.methods:
                runs.append(measure(workload, method, straggler, steps, args.devices, evaluator))
    result = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "quick": args.quick,
              "devices": args.devices, "slowdown": SLOWDOWN, "periods": PERIODS, "run": RUN,
              "wall_s": time.perf_counter() - started, "runs": runs}  # fmt: skip
    write_report(result)


if __name__ == "__main__":
    main()
