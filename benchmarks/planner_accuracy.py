"""Planner prediction vs measurement: the steady step time of train.py runs on this machine against the layout
planner's estimate, for 15 layouts (single, DDP, pipelines with 3 schedules, tensor, data x pipeline, data x tensor, 3D)
of a tiny GPT and a CIFAR-sized CNN. Writes results/planner_accuracy.{json,md}.

Each of --repeats rounds measures everything once, so calibration and comparison see the same (shared, noisy)
machine: gloo latency/bandwidth (2-process micro-benchmark), block forward+backward times (in this process, one
thread: a device here is one single-threaded process), the AdamW step, ten calibration runs of train.py that are
not compared, then every layout. Medians over the rounds are used; the overheads (and the bandwidth collectives
reach inside training) are solved from the calibration runs' residuals. Usage: .venv/bin/python
benchmarks/planner_accuracy.py [--steps 20 --repeats 3]: about 11 min per round on 2 quiet cores, longer when other
processes disturb runs (each such run is repeated once). --repeats other than 3 writes planner_accuracy_repeats<N>.
The parts: planner_accuracy_cases.py (what is compared), _machine.py (measurements outside train.py), this file
(train.py runs, rounds, main), _solve.py (constants solved, layouts predicted), _report.py (the page).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from harness import machine, train_py
from planner_accuracy_cases import CALIBRATION, LAYOUTS, MODELS, QUIET, WARMUP_STEPS, build, group_name
from planner_accuracy_machine import adam_seconds_per_parameter, measure_contention, measure_network, time_blocks
from planner_accuracy_report import write_report
from planner_accuracy_solve import analyse
from timing import other_cores, steady

from lightning_parallel.planner import Layout
from lightning_parallel.strategies.layouts import train_overrides


# ---- train.py runs -------------------------------------------------------------------------------------------------
def run_train(key: str, layout: Layout, steps: int, batch: int | None = None) -> dict[str, Any]:
    """The quieter of up to two train.py runs: a run during which other processes kept more than QUIET cores busy
    is repeated once. The steady step is the slowest rank's median step after the first WARMUP_STEPS."""
    first = run_once(key, layout, steps, batch)
    if first["others_cores"] <= QUIET:
        return first
    second = run_once(key, layout, steps, batch)
    return min(first, second, key=lambda run: run["others_cores"]) | {"attempts": 2}


def run_once(key: str, layout: Layout, steps: int, batch: int | None) -> dict[str, Any]:
    overrides = train_overrides(layout, cuda=False)
    assert overrides is not None, layout
    batch_size = [f"data.batch_size={batch}"] if batch else []
    run = train_py([*MODELS[key]["overrides"], *overrides, *batch_size, "trainer.accelerator=cpu",
                    f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "callbacks=none", "~logger",
                    "+trainer.enable_progress_bar=false"], timeout=300, step_times=True)  # fmt: skip
    if "error" in run:
        raise RuntimeError(f"{key} {layout.label}: train.py failed:\n{run['output_tail']}")
    ranks = run["step_times"]
    slowest = max(steady(rank["seconds"], WARMUP_STEPS) for rank in ranks)
    return {"steady_s": slowest, "step_time_s": run["step_time_s"], "others_cores": other_cores(ranks), "attempts": 1,
            "parameter_bytes_per_rank": run["parameter_bytes_per_rank"]}  # fmt: skip


def measure_round(built: dict[str, tuple], steps: int) -> dict[str, Any]:
    """Everything measured once: machine figures, block timings, calibration runs, then every layout."""
    started = time.perf_counter()
    found: dict[str, Any] = {"network": measure_network(), "contention": measure_contention()}
    found["blocks"] = {key: time_blocks(key, model, sample) for key, (_, model, sample, _) in built.items()}
    found["adam"] = adam_seconds_per_parameter(built["gpt"][1])
    found["calibration"] = {
        group_name(constants): [run_train(key, layout, steps, batch)["steady_s"] for key, layout, batch in runs]
        for constants, runs in CALIBRATION.items()
    }
    found["layouts"] = [run_train(key, layout, steps) for key, layout in LAYOUTS]
    print(f"round in {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    return found


def median_of(values: list[Any]) -> Any:
    """Element-wise median of equally shaped nests of lists / tuples / dicts of numbers."""
    first = values[0]
    if isinstance(first, dict):
        return {k: median_of([v[k] for v in values]) for k in first}
    if isinstance(first, list | tuple):
        return [median_of([v[i] for v in values]) for i in range(len(first))]
    return statistics.median(values)


def recorded(path: str) -> tuple[dict[str, Any], list[list[dict[str, Any]]], dict[str, Any]]:
    """The figures, per-layout runs and facts of an earlier result file, to solve and report again without running."""
    old = json.loads(Path(path).read_text())
    rounds = old["calibration"]["rounds"]
    steady: dict[str, list[float]] = {}
    runs = iter(old["calibration"]["runs"])  # in CALIBRATION order
    for constants, group in CALIBRATION.items():
        steady[group_name(constants)] = [next(runs)["steady_s"] for _ in group]
    figures = {"network": old["loopback"], "blocks": old["calibration"]["block_seconds"],
               "adam": median_of([r["adam"] for r in rounds]),
               "contention": median_of([r["contention"] for r in rounds]), "calibration": steady}  # fmt: skip
    layout_runs = [
        [{"steady_s": s, "step_time_s": t, "others_cores": o, "attempts": a,
          "parameter_bytes_per_rank": row["parameter_bytes_measured"]}
         for s, t, o, a in zip(row["measured_runs_s"], row["summary_runs_s"], row["others_cores"], row["attempts"],
                               strict=True)]
        for row in old["layouts"]
    ]  # fmt: skip
    facts = {k: old[k] for k in ("when", "machine", "steps", "repeats", "wall_s")} | {"rounds": rounds}
    return figures, layout_runs, facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--from-results", help="solve and report again from this result file's measurements")
    args = parser.parse_args()
    started = time.perf_counter()
    built = {key: build(key) for key in MODELS}
    if args.from_results:
        figures, layout_runs, facts = recorded(args.from_results)
        facts["solved"] = time.strftime("%Y-%m-%d %H:%M")
    else:
        rounds = [measure_round(built, args.steps) for _ in range(args.repeats)]
        figures = median_of([{k: r[k] for k in ("network", "contention", "blocks", "adam", "calibration")}
                             for r in rounds])  # fmt: skip
        layout_runs = [[r["layouts"][index] for r in rounds] for index in range(len(LAYOUTS))]
        kept = ("network", "contention", "blocks", "adam")
        facts = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "steps": args.steps,
                 "repeats": args.repeats, "wall_s": time.perf_counter() - started,
                 "rounds": [{k: r[k] for k in kept} for r in rounds]}  # fmt: skip
    write_report(analyse(built, figures, layout_runs, facts))


if __name__ == "__main__":
    main()
