"""What gpu_throughput.py runs, one case per process: the workloads (GPT, ResNet-50 at each size), the table of runs
(raw torch loop, Lightning auto, each strategy at degree 1; compiled, checkpointed, fused-AdamW variants), and the
timed training of one (workload, run).

It times only; summaries, ratios and the report are gpu_throughput.py's.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from harness import quiet
from ranks import bare_trainer, batch_loader
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import lightning_parallel as lp
from lightning_parallel.models import GPT, ResNet
from lightning_parallel.strategies.ddp import DDPStrategy

LR, DISTINCT_BATCHES = 3e-4, 4
# Dense bf16 peak FLOP/s by GPU name, most specific first (vendor datasheets); MFU is left out for other GPUs.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
             ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12)]  # fmt: skip


# ---- workloads -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One model and its synthetic batch: `kind` "gpt" (tokens) or "resnet" (images of `image` pixels square)."""

    kind: str
    sizes: dict[str, int]
    batch: int
    image: int = 0

    def build(self) -> nn.Module:
        return GPT(**self.sizes) if self.kind == "gpt" else ResNet(**self.sizes)

    @property
    def unit(self) -> str:
        return "tokens" if self.kind == "gpt" else "images"

    @property
    def units_per_step(self) -> int:
        return self.batch * (self.sizes["context_length"] if self.kind == "gpt" else 1)

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """DISTINCT_BATCHES batches on CPU, the same in every process (seeded)."""
        generator, out = torch.Generator().manual_seed(1), []
        for _ in range(DISTINCT_BATCHES):
            if self.kind == "gpt":
                shape = (self.batch, self.sizes["context_length"] + 1)
                tokens = torch.randint(0, self.sizes["vocab_size"], shape, generator=generator)
                out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
            else:
                images = torch.randn(self.batch, 3, self.image, self.image, generator=generator)
                out.append((images, torch.randint(0, self.sizes["num_classes"], (self.batch,), generator=generator)))
        return out


GPT2_SMALL = {"vocab_size": 50304, "context_length": 1024, "depth": 12, "width": 768, "heads": 12}
WORKLOADS = {
    "toy": {  # gpu_check.py's rehearsal on CPU: the same runs, seconds each
        "gpt_toy": Workload("gpt", {"vocab_size": 128, "context_length": 32, "depth": 2, "width": 64, "heads": 4}, 4),
        "resnet18_toy": Workload("resnet", {"depth": 18, "num_classes": 10}, batch=2, image=16),
    },
    "cpu": {
        "gpt_tiny": Workload("gpt", {"vocab_size": 256, "context_length": 64, "depth": 2, "width": 128, "heads": 4}, 8),
        "resnet50_32px": Workload("resnet", {"depth": 50, "num_classes": 10}, batch=4, image=32),
    },
    "gpu": {
        "gpt2_small": Workload("gpt", GPT2_SMALL, batch=16),
        "gpt2_medium": Workload("gpt", {**GPT2_SMALL, "depth": 24, "width": 1024, "heads": 16}, batch=16),
        "resnet50": Workload("resnet", {"depth": 50, "num_classes": 1000}, batch=64, image=224),
    },
}


# ---- runs: one row of the report each ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """`strategy` None is the raw torch loop (compiled: over torch.compile(network)); otherwise it builds what
    Trainer(strategy=...) gets, devices=1, given torch.compile(network) when `network_compiled`. `fused`:
    AdamW(fused=True), else torch's default kernel. `cuda_only` rows run on CPU only when asked (their compile)."""

    description: str
    strategy: Callable[[], Any] | None = None
    compiled: bool = False
    checkpointing: bool = False
    cuda_only: bool = False
    degree_one: bool = True  # judged against the 3% target (False for raw loops and auto itself)
    network_compiled: bool = False
    fused: bool = False

    def optimizer(self, parameters: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(parameters, lr=LR, fused=True) if self.fused else torch.optim.AdamW(parameters, lr=LR)


def compiled(description: str, strategy: Callable[[], Any] | None, **options: Any) -> Run:
    """A compiled row: on CPU only when asked, not judged against the 3% target (compiling changes the work)."""
    return Run(description, strategy, compiled=True, cuda_only=True, degree_one=False, **options)


def tensor(**options: Any) -> Callable[[], lp.TensorParallelStrategy]:
    return lambda: lp.TensorParallelStrategy(tensor_parallel_size=1, **options)


def pipeline(**options: Any) -> Callable[[], lp.PipelineParallelStrategy]:
    return lambda: lp.PipelineParallelStrategy(pipeline_parallel_size=1, **options)


RUNS: dict[str, Run] = {
    "raw": Run("torch loop: forward, cross-entropy, backward, AdamW step, zero_grad", degree_one=False),
    "raw_compiled": compiled("the torch loop over torch.compile(model)", None),
    "auto": Run("Lightning Trainer(strategy='auto')", lambda: "auto", degree_one=False),
    "tensor": Run("TensorParallelStrategy(tensor_parallel_size=1)", tensor()),
    "pipeline": Run("PipelineParallelStrategy(pipeline_parallel_size=1)", pipeline()),
    "three_d": Run(
        "PipelineParallelStrategy(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1): 3D at 1",
        pipeline(tensor_parallel_size=1, data_parallel_size=1),
    ),
    "local_sgd": Run("LocalSGDStrategy(period=4)", lambda: lp.LocalSGDStrategy(period=4)),
    "diloco": Run("DiLoCoStrategy(period=10), as conf/strategy/diloco.yaml", lambda: lp.DiLoCoStrategy(period=10)),
    "async_sgd": Run("AsyncSGDStrategy()", lambda: lp.AsyncSGDStrategy()),
    "ddp": Run("DDPStrategy() (this library's, train.py strategy=ddp)", lambda: DDPStrategy()),
    # Lightning's own: its wrapper all-reduces with itself in one process (shown, not judged: not ours to change)
    "ddp_lightning": Run("Lightning's DDPStrategy()", lambda: pl.strategies.DDPStrategy(), degree_one=False),
    # Strategies with compile or activation checkpointing (not judged against the 3% target: they change the work).
    # Checkpointing refuses networks with BatchNorm (the ResNet's row says so).
    "tensor_compiled": compiled("TensorParallelStrategy(tensor_parallel_size=1, compile=True)", tensor(compile=True)),
    "pipeline_compiled": compiled(
        "PipelineParallelStrategy(pipeline_parallel_size=1, compile=True)", pipeline(compile=True)
    ),
    # With fused AdamW: this library's strategy against plain Lightning compiled the same way (gpu_check's mfu part)
    "auto_compiled_fused": compiled(
        "Lightning Trainer(strategy='auto') over torch.compile(model), AdamW(fused=True)",
        lambda: "auto",
        network_compiled=True,
        fused=True,
    ),
    "tensor_compiled_fused": compiled(
        "TensorParallelStrategy(tensor_parallel_size=1, compile=True), AdamW(fused=True)",
        tensor(compile=True),
        fused=True,
    ),
    "tensor_ckpt_full": Run(
        "TensorParallelStrategy(tensor_parallel_size=1, activation_checkpointing='full')",
        tensor(activation_checkpointing="full"),
        checkpointing=True,
        degree_one=False,
    ),
    "tensor_ckpt_selective_compiled": compiled(
        "TensorParallelStrategy(tensor_parallel_size=1, activation_checkpointing='selective', compile=True)",
        tensor(activation_checkpointing="selective", compile=True),
        checkpointing=True,
    ),
}


# ---- timing --------------------------------------------------------------------------------------------------------
class StepClock:
    """Wall and this process's CPU time (all its threads) of each step's window; the GPU drained at both ends."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.wall_s, self.cpu_s, self.loss = cuda, [], [], []

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self, loss: torch.Tensor) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.wall_s.append(time.perf_counter() - self._wall)
        self.cpu_s.append(time.process_time() - self._cpu)
        self.loss.append(float(loss))  # after the window: its sync is not timed


class ClockCallback(pl.Callback):
    """on_train_batch_start to on_train_batch_end: the batch is already on the device, as in the raw loop."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.start()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.clock.stop(outputs["loss"])


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())  # GPT: (B, T, V) vs (B, T); ResNet: (B, C) vs (B,)


class MinimalTask(pl.LightningModule):
    """The network at `model`, cross-entropy, AdamW with torch's defaults (or `optimizer(parameters)`): what the raw
    loop does, nothing more."""

    def __init__(self, network: nn.Module, optimizer: Callable[..., torch.optim.Optimizer] | None = None) -> None:
        super().__init__()
        self.model = network
        self.make_optimizer = optimizer or partial(torch.optim.AdamW, lr=LR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss_of(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(self.parameters())


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """The raw loop's counterpart of Lightning's precision: bf16 autocast for bf16-mixed, nothing for 32-true."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_raw(run: Run, workload: Workload, device: str, precision: str, total: int, clock: StepClock) -> Any:
    network = workload.build().to(device)
    model = torch.compile(network) if run.compiled else network
    optimizer = run.optimizer(network.parameters())
    batches = workload.batches()
    for i in range(total):
        x, y = (t.to(device, non_blocking=device != "cpu") for t in batches[i % len(batches)])  # as Lightning moves
        clock.start()
        with autocast(device, precision):
            loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        clock.stop(loss)
    return optimizer


def train_lightning(run: Run, workload: Workload, device: str, precision: str, total: int, clock: StepClock) -> Any:
    assert run.strategy is not None
    network = workload.build()
    task = MinimalTask(torch.compile(network) if run.network_compiled else network, run.optimizer)
    trainer = bare_trainer(run.strategy(), 1, total, [ClockCallback(clock)], accelerator=device, precision=precision)
    loader = batch_loader(workload.batches(), total)
    trainer.fit(task, train_dataloaders=loader)
    return trainer.optimizers[0]


def peak_memory_mib(device: str) -> float:
    """CUDA: the most bytes torch allocated; CPU: the process's peak RSS (Python, torch and Lightning included)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def device_facts(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {"device_name": "cpu", "peak_flops": None}
    name = torch.cuda.get_device_name()
    peak = next((flops for key, flops in PEAK_BF16 if key in name), None)
    return {"device_name": name, "peak_flops": peak, "cuda": torch.version.cuda}


def count_flops(workload: Workload, device: str, precision: str) -> dict[str, Any]:
    """FLOPs of one training step's forward and backward, counted once on the real model and batch."""
    torch.manual_seed(0)
    network = workload.build().to(device)
    x, y = (t.to(device) for t in workload.batches()[0])
    # torch's CPU attention kernel has no FLOP formula: count the math backend's matmuls instead (same count)
    kernel = sdpa_kernel(SDPBackend.MATH) if device == "cpu" else contextlib.nullcontext()
    with FlopCounterMode(display=False) as counter, kernel, autocast(device, precision):
        loss_of(network(x), y).backward()
    parameters = sum(p.numel() for p in network.parameters())
    return {"flops_per_step": counter.get_total_flops(), "parameters": parameters, **device_facts(device)}


def run_case(name: str, workload: Workload, device: str, precision: str, total: int) -> dict[str, Any]:
    """One timed run in this fresh process: its per-step windows, losses and peak memory."""
    if device == "cpu":
        torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 from the parent: CPU time is work, not spinning threads
    if name == "flops":
        return count_flops(workload, device, precision)
    run = RUNS[name]
    clock = StepClock(cuda=device == "cuda")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)  # the same initial weights in every run
    quiet()
    torch._dynamo.reset()  # a no-op in a fresh process; where runs share one (the suite), each compiles its own
    counters.clear()
    optimizer = (train_raw if run.strategy is None else train_lightning)(run, workload, device, precision, total, clock)
    if len(clock.wall_s) != total:
        raise RuntimeError(f"{name} timed {len(clock.wall_s)} steps, expected {total}")
    return {
        "compiled_graphs": counters["stats"]["unique_graphs"],  # what torch.compile built in this process (0: eager)
        # the AdamW kernel: "fused", "foreach", or "default" (torch's choice: foreach on CUDA tensors, else a for-loop)
        "adamw": next((k for k in ("fused", "foreach") if optimizer.defaults.get(k)), "default"),
        "wall_s": clock.wall_s,
        "cpu_s": clock.cpu_s,
        "loss": clock.loss,
        "peak_memory_mib": peak_memory_mib(device),
    }
