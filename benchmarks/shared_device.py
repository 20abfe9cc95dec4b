"""Several ranks on one device, so a one-GPU machine runs the CUDA code of every multi-rank path: tensor tp2,
pipeline pp2 and pp2 x tp2, each against one process (same seed, weights, batches; fp32, SGD with torch's default
kernels). Lightning refuses devices=2 on a one-GPU machine and duplicate device ids, and NCCL refuses two ranks on
one device, so the ranks share cuda:0 through the package's `SharedCUDAAccelerator` and "gloo_host" backend (gloo,
every CUDA tensor staged through host memory: gloo alone cannot send CUDA tensors). NCCL itself stays untested.

For the GPU check only (`gpu_check.py`), not the library. On CPU the same layouts run on CPU processes, gloo_host
staging CPU tensors too, so the rehearsal runs the copies the GPU check runs.
Worker mode: `python benchmarks/shared_device.py --worker DIR --layout tp2 --device cuda --steps 8` under torchrun.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from harness import RanksFailed, error_line, launch, worker_setup
from ranks import bare_trainer, batch_loader
from throughput_runs import MinimalTask, peak_memory_mib

from lightning_parallel import PipelineParallelStrategy, SharedCUDAAccelerator, TensorParallelStrategy, gloo_host
from lightning_parallel.models import GPT

# Four blocks and four heads: two pipeline stages of three children each, two heads per tensor-parallel rank.
PARITY_GPT = {"vocab_size": 64, "context_length": 16, "depth": 4, "width": 32, "heads": 4}
BATCH, DISTINCT_BATCHES = 8, 4
# SGD, not Adam: Adam turns float noise in an exactly-zero gradient (the attention key bias) into full-size steps
# that differ between any two summation orders (tests/workers/common.py). SGD's default on CUDA is the foreach kernel.
OPTIMIZER = partial(torch.optim.SGD, lr=0.5, momentum=0.9)
TOLERANCE = 1e-5  # fp32, TF32 off, on CPU and CUDA; measured on an H200 (torch 2.11): 9.5e-07 loss, 1.3e-07 parameters
TIMEOUT = timedelta(minutes=2)  # a collective gloo cannot do on CUDA tensors may hang: fail, don't wait 5 minutes
# layout -> (processes, the strategy given its process-group arguments)
LAYOUTS: dict[str, tuple[int, Callable[..., pl.strategies.Strategy]]] = {
    "tp2": (2, lambda **kw: TensorParallelStrategy(tensor_parallel_size=2, **kw)),
    "pp2": (2, lambda **kw: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, **kw)),
    "pp2 x tp2": (
        4,
        lambda **kw: PipelineParallelStrategy(
            pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1, microbatches=2, **kw
        ),
    ),
}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DISTINCT_BATCHES token batches, the same in every process (seeded); every rank of a layout reads each whole."""
    generator, out = torch.Generator().manual_seed(1), []
    for _ in range(DISTINCT_BATCHES):
        shape = (BATCH, PARITY_GPT["context_length"] + 1)
        tokens = torch.randint(0, PARITY_GPT["vocab_size"], shape, generator=generator)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


class Steps(pl.Callback):
    """Each step's training loss as this rank sees it (a pipeline broadcasts it from the last stage) and its wall
    seconds, batch start to batch end, the device drained at both ends; the parameters at the end of training, while
    they are still on the device (teardown moves them to the CPU, under a mesh of the device's type)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.losses, self.seconds = cuda, [], []
        self.state: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = full_state(module.model)


def full_state(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters, DTensors gathered whole (a collective: every rank calls it), on the CPU."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for name, p in network.named_parameters()
    }


def fit(layout: str, device: str, steps: int) -> dict[str, Any]:
    """One fit of the parity GPT: `layout` "one" is Lightning's auto on one device (the reference)."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 as on CPU
        torch.cuda.init()  # before the mesh: DeviceMesh would set the device from LOCAL_RANK (1 does not exist)
    if layout == "one":
        strategy: Any = "auto"
        devices, accelerator = 1, device
    else:
        processes, build = LAYOUTS[layout]
        strategy = build(process_group_backend=gloo_host.BACKEND, timeout=TIMEOUT)
        devices = processes
        accelerator = SharedCUDAAccelerator() if device == "cuda" else "cpu"
    torch.manual_seed(0)
    task = MinimalTask(GPT(**PARITY_GPT), optimizer=OPTIMIZER)
    steps_seen = Steps(cuda=device == "cuda")
    trainer = bare_trainer(strategy, devices, steps, [steps_seen], accelerator=accelerator, precision="32-true")
    trainer.fit(task, train_dataloaders=batch_loader(batches(), steps))
    return {
        "losses": steps_seen.losses,
        "step_s": steps_seen.seconds,
        "peak_memory_mib": peak_memory_mib(device),
        "state": steps_seen.state,
    }


def worker(out: Path, layout: str, device: str, steps: int) -> None:
    """A launched rank: fit, then write rank<r>.json (losses, or the one line it stopped with) and rank<r>.pt."""
    gloo_host.STAGE_CPU_TENSORS = device == "cpu"  # a CPU rehearsal stages as CUDA does
    rank = worker_setup(TIMEOUT, backend=gloo_host.BACKEND)
    try:
        result = fit(layout, device, steps)
    except Exception as error:  # the row says why: gloo may refuse a collective on CUDA tensors
        result = {"error": error_line(error)}
    torch.save(result.pop("state", {}), out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def read_rank(path: Path) -> dict[str, Any]:
    return {**json.loads(path.read_text()), "state": torch.load(path.with_suffix(".pt"), weights_only=True)}


def run_layout(layout: str, device: str, steps: int, timeout: float) -> list[dict[str, Any]] | str:
    """Each rank's result of one layout launched under torchrun, or the one line why the launch failed."""
    processes = 1 if layout == "one" else LAYOUTS[layout][0]
    arguments = ["--layout", layout, "--device", device, "--steps", str(steps)]
    try:
        return launch(__file__, processes, arguments, timeout=timeout, load=read_rank)
    except RanksFailed as failed:
        return failed.line


def parity(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> dict[str, Any]:
    """Largest loss and parameter differences to the one-process run, over every rank and every parameter."""
    merged = {name: value for rank in ranks for name, value in rank["state"].items()}
    missing = sorted(set(reference["state"]) - set(merged))
    loss = max(abs(a - b) for rank in ranks for a, b in zip(rank["losses"], reference["losses"], strict=True))
    params = max((merged[k] - v).abs().max().item() for k, v in reference["state"].items() if k in merged)
    return {"max_loss_diff": loss, "max_param_diff": params, "missing_parameters": missing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, required=True)
    parser.add_argument("--layout", choices=["one", *LAYOUTS], required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    worker(args.worker, args.layout, args.device, args.steps)


if __name__ == "__main__":
    main()
