"""Collects what a run did (metrics, steps, time, throughput, memory per process) for `summary.json`.

Usable in any Lightning project. It measures and gathers across ranks; it does not write files
(the caller decides where, and writes only after a successful run).
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from typing_extensions import override


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA allocator's peak on GPU, else the process peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def local_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds (its shard of a DTensor, its stages of a pipeline)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def gradient_and_optimizer_bytes(module: torch.nn.Module, optimizers: list[Any]) -> tuple[int, int]:
    """Bytes of this process's gradients and optimizer state (after a step, before the next zero_grad)."""
    grads = sum(_local_bytes(p.grad) for p in module.parameters() if p.grad is not None)
    state = sum(
        _local_bytes(value)
        for optimizer in optimizers
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )
    return grads, state


# Under the table when a pipeline measured idle time: it is far above the bubble for small models, so say why
# (benchmarks/idle_check.py checks it against torch's profiler).
IDLE_NOTE = (
    "idle: time in the pipeline's forward/backward (schedule.step) when this rank's stages are not computing: "
    "the bubble, plus waiting on a slower stage, send/recv and per-step Python, which dominate for small models"
)


def print_rank_table(summary: dict[str, Any], parallel: dict[str, Any]) -> None:
    """The end-of-run table on rank 0: one row per rank."""
    from rich.console import Console
    from rich.table import Table

    from lightning_parallel.insight.sweep_report import format_bytes

    table = Table(title="per rank", title_justify="left", caption_justify="left")
    for column in ("rank", "peak memory", "parameters", "gradients", "optimizer", "step time", "idle"):
        table.add_column(column, justify="right")
    per_rank = summary.get("per_rank") or [{}] * len(summary["peak_memory_bytes"])
    step_times = summary["step_time_s_per_rank"] or [None] * len(per_rank)
    for r, measured in enumerate(per_rank):
        idle = measured.get("idle_fraction")
        table.add_row(
            str(r),
            *(
                format_bytes(summary[key][r])
                for key in (
                    "peak_memory_bytes",
                    "parameter_bytes_per_rank",
                    "gradient_bytes_per_rank",
                    "optimizer_state_bytes_per_rank",
                )
            ),
            f"{step_times[r] * 1e3:.1f} ms" if step_times[r] is not None else "-",
            f"{idle:.0%}" if idle is not None else "-",
        )
    measured_idle = any(rank.get("idle_fraction") is not None for rank in per_rank)
    table.caption = "\n".join(filter(None, [bubble_caption(parallel), IDLE_NOTE if measured_idle else None])) or None
    Console(stderr=True).print(table)


def bubble_caption(parallel: dict[str, Any]) -> str | None:
    """The analytic bubble of what ran (a pipeline's `describe()`): per training batch size when they
    differ, and what was requested when it is not what ran; None without a bubble."""
    if "bubble_fraction" not in parallel:
        return None
    plans = [r for r in parallel.get("ran", []) if r["mode"] == "train"] or [parallel]
    parts = []
    for r in plans:
        batch = f" (batch {r['batch_size']})" if len(plans) > 1 else ""
        parts.append(f"{r['schedule']} x{r['microbatches']}{batch}: {r['bubble_fraction']:.0%}")
    asked = parallel.get("requested")
    if asked is not None and any(
        (r["schedule"], r["microbatches"]) != (asked["schedule"], asked["microbatches"]) for r in plans
    ):
        parts.append(f"requested {asked['schedule']} x{asked['microbatches']}")
    return "analytic bubble of " + ", ".join(parts)


def gather_objects(mine: Any) -> list[Any]:
    """Every rank's picklable `mine`, in rank order (just `[mine]` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


class RunSummary(pl.Callback):
    """Records metric histories and step timing; `summary` holds the gathered result after `fit`."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.higher_is_better: dict[str, bool] = {}
        self.summary: dict[str, Any] = {}
        self._fit_start = 0.0
        self._fit_cpu_start = 0.0
        self._step_start = 0.0
        self._step_seconds = 0.0
        self._local_samples = 0
        self._tensor_bytes = (0, 0)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self._fit_cpu_start = time.process_time()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step_seconds += time.perf_counter() - self._step_start
        self._local_samples += len(batch[0])
        self._tensor_bytes = gradient_and_optimizer_bytes(pl_module, trainer.optimizers)
        self._record(trainer, "train/loss")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        for name in trainer.callback_metrics:
            if name.startswith("val/"):
                self._record(trainer, name)
        metrics = getattr(pl_module, "val_metrics", None)
        for name, metric in metrics.items() if metrics is not None else []:
            self.higher_is_better[name] = bool(metric.higher_is_better)  # names carry the "val/" prefix

    def _record(self, trainer: pl.Trainer, name: str) -> None:
        value = trainer.callback_metrics.get(name)
        if value is not None:
            self.history.setdefault(name, []).append(float(value))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wall = time.perf_counter() - self._fit_start
        cpu = time.process_time() - self._fit_cpu_start  # other work on a shared machine stretches wall, not this
        strategy = trainer.strategy
        grads, optimizer_state = self._tensor_bytes
        local = torch.tensor(
            [
                self._local_samples,
                peak_memory_bytes(strategy.root_device),
                local_parameter_bytes(pl_module),
                # mesh strategies: the most held while materialising (sharding) the model; else what is held now
                max(getattr(strategy, "setup_peak_parameter_bytes", 0), local_parameter_bytes(pl_module)),
                grads,
                optimizer_state,
                round(self._step_seconds * 1e6),  # microseconds: one int64 gather for everything
            ],
            dtype=torch.int64,
        )
        per_rank = strategy.all_gather(local.to(strategy.root_device)).cpu().reshape(-1, 7).tolist()
        samples, peak, params, setup_params, grad_bytes, optim_bytes, step_us = (
            list(column) for column in zip(*per_rank, strict=True)
        )
        # Ranks of one data-parallel replica see the same batch; count each sample once.
        replicas = (getattr(strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
        total_samples = sum(samples) * replicas // max(trainer.world_size, 1)
        step_seconds = [us / 1e6 for us in step_us]
        steps = trainer.global_step
        self.summary = {
            "steps": steps,
            "epochs": trainer.current_epoch,
            "wall_time_s": wall,
            "cpu_time_s": cpu,
            "train_time_s": max(step_seconds),
            "samples": total_samples,
            "throughput_samples_per_s": total_samples / max(step_seconds) if max(step_seconds) > 0 else None,
            "step_time_s": max(step_seconds) / steps if steps else None,
            "step_time_s_per_rank": [t / steps for t in step_seconds] if steps else None,
            "peak_memory_bytes": peak,
            "parameter_bytes_per_rank": params,
            "parameter_bytes_peak_setup_per_rank": setup_params,
            "gradient_bytes_per_rank": grad_bytes,
            "optimizer_state_bytes_per_rank": optim_bytes,
            "metrics": {name: self._describe(name, values) for name, values in self.history.items()},
        }
        measurements = getattr(strategy, "rank_measurements", None)  # e.g. a pipeline's measured idle time
        if callable(measurements):
            self.summary["per_rank"] = gather_objects(measurements())
        if trainer.is_global_zero:
            self._log_per_rank(trainer)
            print_rank_table(self.summary, getattr(strategy, "describe", lambda: {})())

    def _log_per_rank(self, trainer: pl.Trainer) -> None:
        """Per-rank figures to the Lightning logger(s), e.g. `stats/peak_memory_mb/rank1`."""
        figures = {
            "peak_memory_mb": self.summary["peak_memory_bytes"],
            "parameter_mb": self.summary["parameter_bytes_per_rank"],
            "gradient_mb": self.summary["gradient_bytes_per_rank"],
            "optimizer_state_mb": self.summary["optimizer_state_bytes_per_rank"],
        }
        metrics = {f"stats/{name}/rank{r}": v / 2**20 for name, values in figures.items() for r, v in enumerate(values)}
        for r, seconds in enumerate(self.summary["step_time_s_per_rank"] or []):
            metrics[f"stats/step_time_ms/rank{r}"] = seconds * 1e3
        for r, rank in enumerate(self.summary.get("per_rank", [])):
            if rank.get("idle_fraction") is not None:
                metrics[f"stats/idle_fraction/rank{r}"] = rank["idle_fraction"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _describe(self, name: str, values: list[float]) -> dict[str, Any]:
        higher = self.higher_is_better.get(name, False)
        return {"final": values[-1], "best": max(values) if higher else min(values), "history": values}
