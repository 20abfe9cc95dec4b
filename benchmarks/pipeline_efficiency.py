"""Pipeline efficiency: PipelineParallelStrategy's measured step against the ideal step, for GPipe, 1F1B and
interleaved 1F1B at several micro-batch counts. Writes results/pipeline_efficiency.{json,md}.

Ideal: the schedule's own action order (torch's, as the run executes it) simulated with this machine's measured
forward and backward time of one stage on one micro-batch, plus the optimizer step; communication, Python and
Lightning cost nothing there, so the gap to the measured step is what they add. The workload is
pipeline_overhead.py's (8 x Linear(1024) + GELU, batch 256, SGD), on 2 single-threaded ranks launched by torchrun.
Usage: .venv/bin/python benchmarks/pipeline_efficiency.py [--steps 10 --warmup 3 --repeats 2]  (~4 min)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import arguments, counts, launch, machine, worker_done, worker_setup, write_results
from pipeline_overhead import BATCH, BLOCKS, LR, RegressionTask, build_network, make_batches
from ranks import bare_trainer, batch_loader
from timing import LoadMeter, order, stats_ms
from torch import nn

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.pipeline.schedule_plan import analytic_bubble, rank_actions, resolve_schedule, simulate

PP = 2
CONFIGS = [("gpipe", m) for m in (1, 2, 4, 8, 16)]
CONFIGS += [("1f1b", m) for m in (2, 4, 8, 16)]  # 1F1B needs micro-batches >= stages
CONFIGS += [("interleaved_1f1b", m) for m in (1, 2, 4, 8, 16)]  # 2 stages per rank: 4 stages of 2 blocks


# ---- inside each rank ------------------------------------------------------------------------------------------
class StepWindow(pl.Callback):
    """Barrier, then on_train_batch_start to on_train_batch_end on this rank (forward, backward, optimizer)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        dist.barrier()
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def run_strategy(schedule: str, m: int, state: dict, batches: list, total: int) -> dict[str, Any]:
    strategy = PipelineParallelStrategy(schedule=schedule, microbatches=m, timeout=300)
    window = StepWindow()
    trainer = bare_trainer(strategy, PP, total, [window])
    task = RegressionTask(build_network(state))
    loader = batch_loader(batches, total)
    cpu = time.process_time()
    trainer.fit(task, train_dataloaders=loader)
    timer = strategy.runtime.timer
    return {
        "starts": window.starts,
        "ends": window.ends,
        "own_cpu_s": time.process_time() - cpu,
        "idle_fraction": timer.idle_fraction,  # inside schedule.step, from the strategy's stage hooks
        # per step the timer counted (every step but the first, which also infers shapes)
        "compute_s": timer.busy_s / (total - 1),
        "schedule_s": timer.wall_s / (total - 1),
        "used": sorted({tuple(u) for u in strategy.runtime.microbatches_used.values()}),
    }


def worker(out: Path, args: argparse.Namespace) -> None:
    rank = worker_setup()  # the strategy reuses its process group
    torch.manual_seed(0)
    state, batches, runs = build_network().state_dict(), make_batches(), []
    meter = LoadMeter()
    for rep in range(args.repeats):
        for schedule, m in order(rep, CONFIGS):
            dist.barrier()
            meter.start()
            run = run_strategy(schedule, m, state, batches, args.warmup + args.steps)
            own = [0.0] * PP
            dist.all_gather_object(own, run["own_cpu_s"])
            run["other_load_cores"] = meter.other_cores(sum(own))
            runs.append({"schedule": schedule, "microbatches": m, "repeat": rep, **run})
    worker_done(out, rank, runs)


# ---- in the main process: compute costs, launch, compare --------------------------------------------------------
def median_time(fn: Any, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def stage_costs(blocks: int, rows: int) -> dict[str, float]:
    """Forward and backward seconds of `blocks` blocks on a micro-batch of `rows` rows, one thread. The input
    needs a gradient, as on every stage but the first."""
    torch.manual_seed(0)
    stage = nn.Sequential(OrderedDict(list(build_network().named_children())[:blocks]))
    x = torch.randn(rows, 1024, requires_grad=True)
    grad = torch.randn(rows, 1024)
    forward = median_time(lambda: stage(x))

    def backward() -> None:
        stage(x).backward(grad)

    return {"F": forward, "B": max(median_time(backward) - forward, 0.0)}


def single_step() -> tuple[float, float]:
    """One process, whole model: (step seconds, optimizer seconds for one rank's half of the parameters)."""
    network = build_network()
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    x, y = make_batches()[0]

    def step() -> None:
        F.mse_loss(network(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step_s = median_time(step, 10)
    params = list(network.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    half = torch.optim.SGD(params[: len(params) // PP], lr=LR)  # a rank holds BLOCKS / PP blocks
    return step_s, median_time(half.step, 20)


def ideal(schedule: str, m: int, costs: dict[str, float], optimizer_s: float) -> dict[str, float]:
    spec = resolve_schedule(schedule, pp=PP, microbatches=m)
    timeline = simulate(
        rank_actions(spec, pp=PP, microbatches=m),
        pp=PP,
        num_stages=PP * spec.stages_per_rank,
        stage_to_rank=spec.stage_to_rank(PP),
        cost=costs,
    )
    return {"step_s": timeline.makespan + optimizer_s, "idle_fraction": timeline.bubble_fraction}


def measured(per_rank: list[list[dict[str, Any]]], warmup: int) -> dict[tuple[str, int], dict[str, Any]]:
    """Per config: the pipeline's step (first rank out of the barrier to the last one done) over all repeats."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for runs in zip(*per_rank, strict=True):
        key = (runs[0]["schedule"], runs[0]["microbatches"])
        series = ("step_s", "idle_fraction", "compute_s", "schedule_s", "other_load_cores")
        row = rows.setdefault(key, {**{name: [] for name in series}, "used": runs[0]["used"]})
        for i in range(warmup, len(runs[0]["starts"])):
            row["step_s"].append(max(r["ends"][i] for r in runs) - min(r["starts"][i] for r in runs))
        for name in ("idle_fraction", "compute_s", "schedule_s"):
            row[name].append([r[name] for r in runs])
        row["other_load_cores"].append(runs[0]["other_load_cores"])
    return rows


def summarise(per_rank: list[list[dict[str, Any]]], args: argparse.Namespace, costs: dict, single: tuple) -> dict:
    single_s, optimizer_s = single
    table = []
    for (schedule, m), row in measured(per_rank, args.warmup).items():
        blocks = BLOCKS // (PP * resolve_schedule(schedule, pp=PP, microbatches=m).stages_per_rank)
        cost = costs[(blocks, BATCH // m)]
        best = ideal(schedule, m, cost, optimizer_s)
        step = stats_ms(row["step_s"])
        idle, compute, schedule_s = (
            [statistics.mean(rank) for rank in zip(*row[name], strict=True)]
            for name in ("idle_fraction", "compute_s", "schedule_s")
        )
        table.append(
            {
                "schedule": schedule,
                "microbatches": m,
                "blocks_per_stage": blocks,
                "bubble_unit_costs": analytic_bubble(schedule, pp=PP, microbatches=m),
                "stage_forward_ms": cost["F"] * 1e3,
                "stage_backward_ms": cost["B"] * 1e3,
                "ideal_step_ms": best["step_s"] * 1e3,
                "ideal_idle_fraction": best["idle_fraction"],
                "measured_step_ms": step,
                "efficiency": best["step_s"] * 1e3 / step["median"],
                "measured_idle_fraction_per_rank": idle,
                "ideal_compute_ms_per_rank": m * (cost["F"] + cost["B"]) * (BLOCKS // PP // blocks) * 1e3,
                "measured_compute_ms_per_rank": [c * 1e3 for c in compute],
                "measured_schedule_ms_per_rank": [c * 1e3 for c in schedule_s],
                "speedup_vs_single": single_s * 1e3 / step["median"],
                "other_load_cores": max(row["other_load_cores"]),
                "schedule_used": row["used"],
            }
        )
    return {"single_step_ms": single_s * 1e3, "optimizer_ms_per_rank": optimizer_s * 1e3, "rows": table}


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        "# Pipeline efficiency: measured step vs ideal",
        "",
        f"`benchmarks/pipeline_efficiency.py`, {cfg['date']}, {cfg['machine']}; {cfg['minutes']:.1f} min. "
        f"{BLOCKS} x (Linear(1024, 1024) + GELU), batch {BATCH}, MSE, SGD; PipelineParallelStrategy on {PP} "
        f"single-threaded gloo ranks (torchrun), {cfg['repeats']} repeats x {cfg['steps']} steps after "
        f"{cfg['warmup']} warm-up steps. One process runs the whole step in {result['single_step_ms']:.1f} ms.",
        "",
        "- **ideal**: torch's action order for the schedule, simulated with the stage's forward (F) and backward (B) "
        "time on one micro-batch measured here in one thread, plus the optimizer step of one rank "
        f"({result['optimizer_ms_per_rank']:.2f} ms); communication and framework are free. "
        "**measured**: first rank out of a barrier to the last rank done with the optimizer step, median "
        "(p10-p90). **efficiency** = ideal / measured.",
        "- **idle**: share of schedule.step each rank waits; ideal from the same simulation, measured by the "
        "strategy's stage hooks (as summary.json reports it). **bubble** is the schedule's analytic fraction under "
        "unit costs (F=1, B=2), the figure summary.json and the planner use. **compute per rank**: forward and "
        "backward time per step, ideal (m x (F + B) x stages per rank) against the strategy's hooks' measurement "
        "(per step after the first, warm-up included).",
        "",
        "| schedule | m | blocks/stage | bubble (unit) | F / B per micro-batch ms | ideal ms | measured ms "
        "| efficiency | compute per rank ms: ideal / measured (rank 0, 1) | idle ideal | idle measured (rank 0 / 1) "
        "| speedup vs 1 process | other load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        step = r["measured_step_ms"]
        idle = " / ".join(f"{v:.2f}" for v in r["measured_idle_fraction_per_rank"])
        compute = ", ".join(f"{v:.0f}" for v in r["measured_compute_ms_per_rank"])
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['blocks_per_stage']} | {r['bubble_unit_costs']:.3f} | "
            f"{r['stage_forward_ms']:.2f} / {r['stage_backward_ms']:.2f} | {r['ideal_step_ms']:.1f} | "
            f"{step['median']:.1f} ({step['p10']:.1f}-{step['p90']:.1f}) | {r['efficiency']:.0%} | "
            f"{r['ideal_compute_ms_per_rank']:.0f} / {compute} | {r['ideal_idle_fraction']:.2f} | {idle} | "
            f"{r['speedup_vs_single']:.2f}x | {r['other_load_cores']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = arguments(__doc__.split("\n", 1)[0], steps=10, warmup=3, repeats=2, timeout=1800)
    if args.worker:
        worker(args.worker, args)
        return
    begin = time.perf_counter()
    torch.set_num_threads(1)
    sizes = {
        (BLOCKS // (PP * resolve_schedule(s, pp=PP, microbatches=m).stages_per_rank), BATCH // m) for s, m in CONFIGS
    }
    costs = {size: stage_costs(*size) for size in sorted(sizes)}
    single = single_step()
    per_rank = launch(__file__, PP, counts(args), timeout=args.timeout)
    result = summarise(per_rank, args, costs, single)
    result["config"] = {
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "minutes": (time.perf_counter() - begin) / 60,
        **{k: getattr(args, k) for k in ("steps", "warmup", "repeats")},
    }
    write_results("pipeline_efficiency", result, markdown(result))


if __name__ == "__main__":
    main()
