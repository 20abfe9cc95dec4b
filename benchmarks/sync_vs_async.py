"""Synchronous DDP vs local SGD vs DiLoCo vs asynchronous SGD, each run by train.py on the same step budget: wall time
and steps to a target, final metric and bytes communicated per worker per step, with and without one worker made 2x
slower. Rank 0's weights are recorded during training (benchmarks/race.py) and evaluated here, outside the run, so no
validation meeting paces the workers. Writes results/sync_vs_async_<n>p.{json,md} (n processes) and one loss-vs-time
plot per workload.
The runs compared are sync_vs_async_cases.py's; sync_vs_async_report.py writes the tables and plots.
Usage: .venv/bin/python benchmarks/sync_vs_async.py [--quick] [--workloads digits gpt] [--methods ddp async_sgd]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import ROOT, machine, train_py
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from sync_vs_async_cases import METHODS, PERIODS, RUN, SLOWDOWN, WORKLOADS, snapshot_schedule
from sync_vs_async_report import write_report

from lightning_parallel.sync_methods import SYNC_METHODS

sys.path.insert(0, str(ROOT))

from train import build_model, build_task  # noqa: E402


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
