"""Step time of PipelineParallelStrategy at pp2 x tp2 ("3D" with dp=1) inside a Lightning Trainer against the same
layout written by hand with torch alone: a ("pp", "tp") DeviceMesh, GPT's Megatron plan by `parallelize_module` in
each stage, `PipelineStage` + `Schedule1F1B` (same split, weights, batches, micro-batches and SGD). Also the losses
step by step and parameter bytes per rank. Writes results/overhead_3d.{json,md}.

Reuses the workload of tensor_overhead.py (overhead_gpt.py) and the step probe and critical path of
pipeline_overhead.py; launches its 4 ranks with torchrun (overhead.py), one thread each; overhead_3d_report.py
summarises them. It does not use tests/.
Usage: .venv/bin/python benchmarks/overhead_3d.py [--steps 8 --warmup 2 --repeats 10]
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
from harness import worker_done, worker_setup
from overhead_3d_report import markdown, summarise
from overhead_gpt import LR, MODEL, MinimalTask, build_network, lm_loss, make_batches, megatron_plan, parameter_bytes
from pipeline_overhead import PROBE, probe_schedules
from pipeline_overhead_report import critical_path
from ranks import bare_trainer, batch_loader
from timing import order
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B
from torch.distributed.tensor.parallel import parallelize_module

from lightning_parallel import PipelineParallelStrategy

PP, TP, SCHEDULE, MICROBATCHES = 2, 2, "1f1b", 4
# The strategy's split of GPT's children by parameters (50.2% / 49.8%); every strategy run checks it is still this.
STAGES = (("embed", "block_0", "block_1"), ("block_2", "block_3", "head"))
SEQUENCE_ONLY = ("sequence_parallel", "shard_sequence")  # GPT.tp_plan styles that act only with sequence parallelism
KINDS = {
    "handwritten": "hand-written: DeviceMesh + parallelize_module + PipelineStage + Schedule1F1B, SGD step, zero_grad",
    "strategy": "PipelineParallelStrategy(pp=2, tp=2, dp=1), minimal LightningModule (no logging)",
}


# ---- timed runs (inside each rank) ---------------------------------------------------------------
def begin_run() -> None:
    PROBE.reset()
    PROBE.marks["loss"] = []  # the step's mean loss (hand-written: on the ranks holding the last stage)
    PROBE.marks["cpu_start"], PROBE.marks["cpu_end"] = [], []


def mark(name: str) -> None:
    """The step window's wall time, and this process's CPU time: the work, without waiting for a core."""
    PROBE.mark(name)
    PROBE.marks[f"cpu_{name}"].append(time.process_time())


def end_run(module: nn.Module) -> dict[str, Any]:
    return {**PROBE.result(module), "parameter_bytes": parameter_bytes(module)}  # DTensors: local shards


class LossTimer(pl.Callback):
    """Barrier, then batch start to batch end (as pipeline_overhead's StepTimer), with CPU time and the loss."""

    def on_train_batch_start(self, *args: Any) -> None:
        dist.barrier()
        mark("start")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        mark("end")
        PROBE.marks["loss"].append(float(outputs["loss"]))  # broadcast from the last stage by the strategy


def build_stage(state: dict[str, torch.Tensor], mesh: DeviceMesh) -> nn.Sequential:
    """This rank's blocks of GPT (names kept), sharded over "tp" with the Megatron plan's entries for them."""
    blocks = STAGES[mesh.get_local_rank("pp")]
    children = dict(build_network(state).named_children())
    stage = nn.Sequential(OrderedDict((name, children[name]) for name in blocks))
    plan = {name: style for name, style in megatron_plan().items() if name.split(".")[0] in blocks}
    return parallelize_module(stage, mesh["tp"], plan, src_data_rank=None)  # same weights on every rank already


def run_handwritten(state: dict, batches: list, total: int, mesh: DeviceMesh) -> dict[str, Any]:
    """PipelineStage + torch's 1F1B on the "pp" group, optimizer.step + zero_grad, nothing else."""
    pp_rank = mesh.get_local_rank("pp")
    module = build_stage(state, mesh)
    stage = PipelineStage(module, pp_rank, PP, torch.device("cpu"), group=mesh.get_group("pp"))
    pipe = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=lm_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    begin_run()
    for i in range(total):
        x, y = batches[i % len(batches)]
        losses: list[torch.Tensor] = []
        dist.barrier()
        mark("start")
        if pp_rank == 0:
            pipe.step(x, return_outputs=False)
        else:
            pipe.step(target=y, losses=losses, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad()
        mark("end")
        if losses:
            PROBE.marks["loss"].append(torch.stack(losses).mean().item())
    return end_run(module)


def run_strategy(state: dict, batches: list, total: int) -> dict[str, Any]:
    strategy = PipelineParallelStrategy(
        pipeline_parallel_size=PP,
        tensor_parallel_size=TP,
        data_parallel_size=1,
        schedule=SCHEDULE,
        microbatches=MICROBATCHES,
        timeout=300,
    )
    trainer = bare_trainer(strategy, PP * TP, total, [LossTimer()])
    task = MinimalTask(build_network(state))
    loader = batch_loader(batches, total)
    begin_run()
    trainer.fit(task, train_dataloaders=loader)
    described = strategy.describe()
    if described["stages"] != [list(blocks) for blocks in STAGES]:
        raise RuntimeError(f"the strategy now splits GPT as {described['stages']}; update STAGES to match")
    acting = {name for name, style in described["sharded"].items() if style not in SEQUENCE_ONLY}
    if acting != set(megatron_plan()):
        raise RuntimeError(f"the strategy's plan no longer matches megatron_plan(): {sorted(acting)}")
    ran = [(r["schedule"], r["microbatches"]) for r in described["ran"]]
    return {**end_run(task.model), "ran": ran, "plan_entries": len(acting)}


def worker(out: Path, args: argparse.Namespace) -> None:
    rank, total = worker_setup(), args.warmup + args.steps  # the strategy reuses its process group
    probe_schedules()  # the same schedule.step wrapper in both runs
    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))  # tp innermost, as the strategy's mesh
    torch.manual_seed(0)
    state, batches, runs = build_network().state_dict(), make_batches(), []
    for rep in range(args.repeats):
        # hand-written first on even repeats, strategy first on odd ones (ABBA): drift cancels in pairs
        for kind in order(rep, list(KINDS)):
            if kind == "handwritten":
                result = run_handwritten(state, batches, total, mesh)
            else:
                result = run_strategy(state, batches, total)
            runs.append({"kind": kind, "schedule": SCHEDULE, "microbatches": MICROBATCHES, "repeat": rep, **result})
            dist.barrier()
        print(f"rank {rank}: repeat {rep + 1}/{args.repeats} done", flush=True)
    worker_done(out, rank, runs)


if __name__ == "__main__":
    overhead.main(
        "overhead_3d",
        __file__,
        description=__doc__.splitlines()[0],
        ranks=PP * TP,
        timeout=1800,
        setting={
            "model": MODEL,
            "layout": {
                "pp": PP,
                "tp": TP,
                "dp": 1,
                "schedule": SCHEDULE,
                "microbatches": MICROBATCHES,
                "stages": STAGES,
            },
            "kinds": KINDS,
        },
        run_names=("kind", "schedule", "microbatches", "repeat"),
        worker=worker,
        critical_path=critical_path,
        summarise=summarise,
        markdown=markdown,
    )
