"""Step time of TensorParallelStrategy inside a Lightning Trainer against a hand-written DTensor loop (torch's
`parallelize_module` with the same Megatron split as GPT's `tp_plan`; same weights, batches and optimizer), the
single-process step for scale, parameter bytes and peak RSS per rank. Writes results/tensor_overhead.{json,md}.

The workload is overhead_gpt.py's; launches its ranks with torchrun (overhead.py), one thread each;
tensor_overhead_report.py summarises them. It does not use tests/.
Usage: .venv/bin/python benchmarks/tensor_overhead.py [--steps 8 --warmup 2 --repeats 10]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import overhead
import torch
import torch.distributed as dist
from harness import worker_done, worker_setup
from overhead_gpt import LR, MODEL, MinimalTask, build_network, lm_loss, make_batches, megatron_plan, parameter_bytes
from ranks import bare_trainer, batch_loader
from tensor_overhead_report import WINDOWS, critical_path, markdown, summarise
from timing import Usage, order
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from lightning_parallel import TensorParallelStrategy
from lightning_parallel.tasks.language_model import LanguageModelTask

TP = 2
# kind -> what its table row says; "single" (rank 0 alone, plain loop) runs first in every repeat
KINDS = {
    "handwritten": "hand-written: parallelize_module + forward, cross-entropy, backward, step, zero_grad",
    "strategy": "TensorParallelStrategy, minimal LightningModule (no logging)",
    "strategy_lm_task": "TensorParallelStrategy, the library's LanguageModelTask (logs train/loss, sync_dist)",
}


# ---- timed runs (inside each rank) ---------------------------------------------------------------
def rss_kib(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def reset_peak_rss() -> int | None:
    """Free what earlier runs left, reset this process's peak RSS (VmHWM) to its current RSS; return that."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return rss_kib("VmRSS")


class Probe:
    """Per step on this rank: wall and own-CPU time at the window's ends, wall time around the network's forward
    and around backward, the loss. perf_counter is CLOCK_MONOTONIC on Linux, so all ranks share one clock and the
    slowest rank of each step is found afterwards (critical_path)."""

    def __init__(self) -> None:
        self.usage = Usage()
        self.reset()

    def reset(self) -> None:
        names = ("start", "end", "cpu_start", "cpu_end", "loss", *WINDOWS)
        self.marks: dict[str, list[float]] = {name: [] for name in names}
        self._rss = reset_peak_rss()
        self.usage.start()

    def mark(self, name: str) -> None:
        self.marks[name].append(time.perf_counter())
        if name in ("start", "end"):
            self.marks[f"cpu_{name}"].append(time.process_time())

    def watch(self, network: nn.Module) -> nn.Module:
        """Time the network's forward (root hooks, the same in every run); backward is timed by time_backward."""
        network.register_forward_pre_hook(lambda *_: self.mark("forward_start"))
        network.register_forward_hook(lambda *_: self.mark("forward_end"))
        return network

    def result(self, module: nn.Module) -> dict[str, Any]:
        """The marks, wall / own CPU / machine-wide busy CPU seconds of the run (others' load shows), memory."""
        return {
            **self.marks,
            **self.usage.totals(),
            "parameter_bytes": parameter_bytes(module),
            "rss_start_kib": self._rss,
            "peak_rss_kib": rss_kib("VmHWM") if self._rss is not None else None,
        }


PROBE = Probe()


def time_backward() -> None:
    """Wrap torch.autograd.backward, which Tensor.backward looks up at each call (Lightning's path included)."""
    inner = torch.autograd.backward

    def timed(*args: Any, **kwargs: Any) -> Any:
        PROBE.mark("backward_start")
        try:
            return inner(*args, **kwargs)
        finally:
            PROBE.mark("backward_end")

    torch.autograd.backward = timed  # type: ignore[assignment]


class StepTimer(pl.Callback):
    """Barrier, then on_train_batch_start to on_train_batch_end: the window the hand-written loop times."""

    def on_train_batch_start(self, *args: Any) -> None:
        dist.barrier()
        PROBE.mark("start")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        PROBE.mark("end")
        PROBE.marks["loss"].append(float(outputs["loss"]))


def plain_loop(network: nn.Module, batches: list, total: int, *, barrier: bool) -> dict[str, Any]:
    """Each step: forward, cross-entropy, backward, step, zero_grad; a barrier first when ranks run together."""
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    PROBE.reset()
    for i in range(total):
        x, y = batches[i % len(batches)]
        if barrier:
            dist.barrier()
        PROBE.mark("start")
        loss = lm_loss(network(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        PROBE.mark("end")
        PROBE.marks["loss"].append(loss.item())
    return PROBE.result(network)


def run_handwritten(state: dict, batches: list, total: int, mesh: DeviceMesh) -> dict[str, Any]:
    network = PROBE.watch(build_network(state))
    parallelize_module(network, mesh, megatron_plan(), src_data_rank=None)  # same weights on every rank already
    return plain_loop(network, batches, total, barrier=True)


def run_strategy(kind: str, state: dict, batches: list, total: int) -> dict[str, Any]:
    strategy = TensorParallelStrategy(tensor_parallel_size=TP, timeout=300)
    trainer = bare_trainer(strategy, TP, total, [StepTimer()])
    network = PROBE.watch(build_network(state))
    if kind == "strategy":
        task: pl.LightningModule = MinimalTask(network)
    else:
        task = LanguageModelTask(network, optimizer=functools.partial(torch.optim.SGD, lr=LR))
    loader = batch_loader(batches, total)
    PROBE.reset()
    trainer.fit(task, train_dataloaders=loader)
    described = strategy.describe()
    return {**PROBE.result(network), "described_bytes_per_rank": described["parameter_bytes_per_rank"],
            "sharded_modules": len(described["sharded"])}  # fmt: skip


def run_single(state: dict, batches: list, total: int) -> dict[str, Any]:
    """One process, whole model, plain loop: forward, loss, backward, optimizer.step, zero_grad."""
    return plain_loop(PROBE.watch(build_network(state)), batches, total, barrier=False)


def worker(out: Path, args: argparse.Namespace) -> None:
    rank, total = worker_setup(), args.warmup + args.steps  # the strategy reuses its process group
    time_backward()
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    state, batches, runs = build_network().state_dict(), make_batches(), []
    for rep in range(args.repeats):
        if rank == 0:  # rank 1 waits in the barrier below (a blocking socket wait, no CPU)
            runs.append({"kind": "single", "repeat": rep, **run_single(state, batches, total)})
        dist.barrier()
        # forward order on even repeats, reversed on odd ones: linear drift cancels in pairs of repeats
        for kind in order(rep, list(KINDS)):
            if kind == "handwritten":
                result = run_handwritten(state, batches, total, mesh)
            else:
                result = run_strategy(kind, state, batches, total)
            runs.append({"kind": kind, "repeat": rep, **result})
            dist.barrier()
        print(f"rank {rank}: repeat {rep + 1}/{args.repeats} done", flush=True)
    worker_done(out, rank, runs)


if __name__ == "__main__":
    overhead.main(
        "tensor_overhead",
        __file__,
        description=__doc__.splitlines()[0],
        ranks=TP,
        timeout=900,
        setting={"model": MODEL, "tp": TP, "kinds": KINDS},
        run_names=("kind", "repeat"),
        worker=worker,
        critical_path=critical_path,
        summarise=summarise,
        markdown=markdown,
    )
