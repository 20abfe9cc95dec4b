"""Step time of PipelineParallelStrategy inside a Lightning Trainer against a hand-written
torch.distributed.pipelining loop (same model, schedule, micro-batches, batches and optimizer), the
single-process step for scale, and parameter bytes per rank. Writes results/pipeline_overhead.{json,md}.

Launches its ranks with torchrun (harness.py), one thread each; it does not use tests/.
Usage: .venv/bin/python benchmarks/pipeline_overhead.py [--steps 8 --warmup 2 --repeats 10]
Over 300 lines: one measurement, its worker mode and its report in one script, so a result file traces to one
command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Usage, arguments, counts, launch, machine, order, other_cores, stats_ms, worker_setup, write_results
from ranks import bare_trainer, batch_loader
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

from lightning_parallel import PipelineParallelStrategy

WIDTH, BLOCKS, BATCH, PP, LR, DISTINCT_BATCHES = 1024, 8, 256, 2, 1e-3, 4
CONFIGS = [("1f1b", 4), ("1f1b", 8), ("gpipe", 8)]  # (schedule, micro-batches)
TORCH_CLASS = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
TARGET = 0.05  # the strategy may cost at most 5% more per step than the hand-written loop
QUIET = 0.1  # a run is quiet when other processes used less than this many cores during it


# ---- the workload, identical in every run -------------------------------------------------------
def build_network(state: dict[str, torch.Tensor] | None = None) -> nn.Sequential:
    """8 named blocks of Linear(1024, 1024) + GELU; `state` gives every run the same initial weights."""
    blocks: OrderedDict[str, nn.Module] = OrderedDict(
        (f"block{i}", nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())) for i in range(BLOCKS)
    )
    network = nn.Sequential(blocks)
    if state is not None:
        network.load_state_dict(state)
    return network


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))
        for _ in range(DISTINCT_BATCHES)
    ]


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class RegressionTask(pl.LightningModule):
    """The smallest module the strategy accepts: the network at `model`, the loss through `loss_fn`."""

    def __init__(self, network: nn.Sequential) -> None:
        super().__init__()
        self.model = network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


# ---- timed runs (inside each rank) ---------------------------------------------------------------
class Probe:
    """Timestamps of each step of one run on this rank. time.perf_counter is CLOCK_MONOTONIC on Linux, so
    all ranks share one clock and the critical path across them is computed afterwards (critical_path)."""

    def __init__(self) -> None:
        self.marks: dict[str, list[float]] = {}
        self.usage = Usage()

    def reset(self) -> None:
        self.marks = {name: [] for name in ("start", "schedule_start", "schedule_end", "end")}
        self.usage.start()

    def mark(self, name: str) -> None:
        self.marks[name].append(time.perf_counter())

    def result(self, module: nn.Module) -> dict[str, Any]:
        """The marks, plus wall / own CPU / machine-wide busy CPU seconds of the run (others' load shows)."""
        return {**self.marks, **self.usage.totals(), "parameter_bytes": parameter_bytes(module)}


PROBE = Probe()


def probe_schedules() -> None:
    """Timestamp torch's schedule.step with the same wrapper in both runs; what lies outside is loop cost."""
    for cls in TORCH_CLASS.values():
        inherited = cls.step  # both inherit PipelineScheduleSingle.step in torch 2.13; wrap each class once

        def timed(self: Any, *args: Any, _step: Any = inherited, **kwargs: Any) -> Any:
            PROBE.mark("schedule_start")
            try:
                return _step(self, *args, **kwargs)
            finally:
                PROBE.mark("schedule_end")

        cls.step = timed  # type: ignore[method-assign]


class StepTimer(pl.Callback):
    """Barrier, then on_train_batch_start to on_train_batch_end: the window the hand-written loop times."""

    def on_train_batch_start(self, *args: Any) -> None:
        dist.barrier()
        PROBE.mark("start")

    def on_train_batch_end(self, *args: Any) -> None:
        PROBE.mark("end")


def run_handwritten(schedule: str, m: int, state: dict, batches: list, total: int) -> dict[str, Any]:
    """PipelineStage + torch schedule + optimizer.step/zero_grad, nothing else."""
    rank = dist.get_rank()
    per_stage = BLOCKS // PP
    children = list(build_network(state).named_children())
    stage_module = nn.Sequential(OrderedDict(children[rank * per_stage : (rank + 1) * per_stage]))
    pipe = TORCH_CLASS[schedule](
        PipelineStage(stage_module, rank, PP, torch.device("cpu")), n_microbatches=m, loss_fn=F.mse_loss
    )
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=LR)
    PROBE.reset()
    for i in range(total):
        x, y = batches[i % len(batches)]
        dist.barrier()
        PROBE.mark("start")
        if rank == 0:
            pipe.step(x, return_outputs=False)
        else:
            pipe.step(target=y, losses=[], return_outputs=False)
        optimizer.step()
        optimizer.zero_grad()
        PROBE.mark("end")
    return PROBE.result(stage_module)


def run_strategy(schedule: str, m: int, state: dict, batches: list, total: int) -> dict[str, Any]:
    strategy = PipelineParallelStrategy(schedule=schedule, microbatches=m, timeout=300)
    trainer = bare_trainer(strategy, PP, total, [StepTimer()])
    task = RegressionTask(build_network(state))
    loader = batch_loader(batches, total)
    PROBE.reset()
    trainer.fit(task, train_dataloaders=loader)
    used = sorted(set(strategy.runtime.microbatches_used.values()))
    return {**PROBE.result(task.model), "schedule_used": [list(u) for u in used]}


def run_single(state: dict, batches: list, total: int) -> dict[str, Any]:
    """One process, whole model, plain loop: forward, loss, backward, optimizer.step, zero_grad."""
    network = build_network(state)
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    PROBE.reset()
    for i in range(total):
        x, y = batches[i % len(batches)]
        PROBE.mark("start")
        F.mse_loss(network(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        PROBE.mark("end")
    return PROBE.result(network)


def worker(out: Path, args: argparse.Namespace) -> None:
    rank, total = worker_setup(), args.warmup + args.steps  # the strategy reuses its process group
    probe_schedules()
    torch.manual_seed(0)
    state, batches, runs = build_network().state_dict(), make_batches(), []
    for rep in range(args.repeats):
        if rank == 0:  # rank 1 waits in the barrier below (a blocking socket wait, no CPU)
            runs.append({"kind": "single", "schedule": None, "microbatches": None, "repeat": rep})
            runs[-1].update(run_single(state, batches, total))
        dist.barrier()
        for schedule, m in CONFIGS:
            # hand-written first on even repeats, strategy first on odd ones (ABBA): drift cancels in pairs
            for kind in order(rep, ["handwritten", "strategy"]):
                run = run_handwritten if kind == "handwritten" else run_strategy
                runs.append({"kind": kind, "schedule": schedule, "microbatches": m, "repeat": rep})
                runs[-1].update(run(schedule, m, state, batches, total))
                dist.barrier()
        print(f"rank {rank}: repeat {rep + 1}/{args.repeats} done", flush=True)
    (out / f"rank{rank}.json").write_text(json.dumps(runs))
    dist.destroy_process_group()


# ---- report (main process) ----------------------------------------------------------------------
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


def merge_ranks(per_rank: list[list[dict[str, Any]]], warmup: int) -> list[dict[str, Any]]:
    """One entry per run: its critical-path series and every rank's raw numbers."""
    names = ("kind", "schedule", "microbatches", "repeat")
    by_key = [{tuple(run[k] for k in names): run for run in rank_runs} for rank_runs in per_rank]
    merged = []
    for first in per_rank[0]:
        key = tuple(first[k] for k in names)
        runs = [ranks[key] for ranks in by_key if key in ranks]  # single: rank 0 only
        merged.append({**{k: first[k] for k in names}, **critical_path(runs, warmup), "per_rank": runs})
    return merged


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


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    single = [r for r in runs if r["kind"] == "single"]
    load = [r["other_load_cores"] for r in runs]
    summary: dict[str, Any] = {
        "single_step_ms": stats_ms([t for run in single for t in run["step_s"]]),
        "single_parameter_bytes": single[0]["per_rank"][0]["parameter_bytes"],
        "other_load_cores": {"mean": statistics.mean(load), "max": max(load)},
    }
    for schedule, m in CONFIGS:
        hand, strat = (
            [r for r in runs if r["kind"] == kind and (r["schedule"], r["microbatches"]) == (schedule, m)]
            for kind in ("handwritten", "strategy")
        )
        quiet_hand, quiet_strat = ([r for r in of if r["other_load_cores"] < QUIET] for of in (hand, strat))
        row = {
            "all": compare(hand, strat),
            "quiet": compare(quiet_hand, quiet_strat) if quiet_hand and quiet_strat else None,
            "overhead_per_repeat": [
                statistics.median(s["step_s"]) / statistics.median(h["step_s"]) - 1
                for h, s in zip(hand, strat, strict=True)
            ],
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
    full, load = summary["single_parameter_bytes"], summary["other_load_cores"]
    fmt = lambda s: f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f})"  # noqa: E731
    lines = [
        "# PipelineParallelStrategy overhead",
        "",
        f"`benchmarks/pipeline_overhead.py`, {config['date']}, {config['machine']}. {BLOCKS} x (Linear({WIDTH}, "
        f"{WIDTH}) + GELU), batch {BATCH}, MSE, SGD, PP={PP}, one thread per process, gloo; "
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
    for schedule, m in CONFIGS:
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


def main() -> None:
    args = arguments(__doc__.splitlines()[0], steps=8, warmup=2, repeats=10, timeout=900)
    if args.worker is not None:
        worker(args.worker, args)
        return
    started = time.perf_counter()
    runs = merge_ranks(launch(__file__, PP, counts(args), timeout=args.timeout), args.warmup)
    config = {
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{machine()}, lightning {lightning.__version__}",
        "model": {"width": WIDTH, "blocks": BLOCKS, "batch": BATCH, "loss": "mse", "optimizer": "SGD", "lr": LR},
        "pp": PP,
        "configs": CONFIGS,
        "target_overhead": TARGET,
        "wall_s": time.perf_counter() - started,
    }
    summary = summarise(runs)
    report = {"config": config, "summary": summary, "runs": runs}
    write_results("pipeline_overhead", report, markdown(summary, config), config["wall_s"])


if __name__ == "__main__":
    main()
