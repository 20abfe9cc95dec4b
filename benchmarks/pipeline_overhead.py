"""Step time of PipelineParallelStrategy inside a Lightning Trainer against a hand-written
torch.distributed.pipelining loop (same model, schedule, micro-batches, batches and optimizer), the
single-process step for scale, and parameter bytes per rank. Writes results/pipeline_overhead.{json,md}.

Launches its ranks with torchrun (overhead.py), one thread each; pipeline_overhead_report.py summarises them. It does
not use tests/. Usage: .venv/bin/python benchmarks/pipeline_overhead.py [--steps 8 --warmup 2 --repeats 10]
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import overhead
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import worker_done, worker_setup
from pipeline_overhead_report import critical_path, markdown, summarise
from ranks import bare_trainer, batch_loader
from timing import Usage, order
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

from lightning_parallel import PipelineParallelStrategy

WIDTH, BLOCKS, BATCH, PP, LR, DISTINCT_BATCHES = 1024, 8, 256, 2, 1e-3, 4
CONFIGS = [("1f1b", 4), ("1f1b", 8), ("gpipe", 8)]  # (schedule, micro-batches)
TORCH_CLASS = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


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
    worker_done(out, rank, runs)


if __name__ == "__main__":
    overhead.main(
        "pipeline_overhead",
        __file__,
        description=__doc__.splitlines()[0],
        ranks=PP,
        timeout=900,
        setting={
            "model": {"width": WIDTH, "blocks": BLOCKS, "batch": BATCH, "loss": "mse", "optimizer": "SGD", "lr": LR},
            "pp": PP,
            "configs": CONFIGS,
        },
        run_names=("kind", "schedule", "microbatches", "repeat"),
        worker=worker,
        critical_path=critical_path,
        summarise=summarise,
        markdown=markdown,
    )
