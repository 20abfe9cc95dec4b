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
        self._step_start = 0.0
        self._step_seconds = 0.0
        self._local_samples = 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()

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
        strategy = trainer.strategy
        local = torch.tensor(
            [
                self._local_samples,
                peak_memory_bytes(strategy.root_device),
                local_parameter_bytes(pl_module),
                round(self._step_seconds * 1e6),  # microseconds: one int64 gather for everything
            ],
            dtype=torch.int64,
        )
        per_rank = strategy.all_gather(local.to(strategy.root_device)).cpu().reshape(-1, 4)
        # Ranks of one data-parallel replica see the same batch; count each sample once.
        replicas = (getattr(strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
        samples = int(per_rank[:, 0].sum()) * replicas // max(trainer.world_size, 1)
        step_seconds = [int(us) / 1e6 for us in per_rank[:, 3]]
        steps = trainer.global_step
        self.summary = {
            "steps": steps,
            "epochs": trainer.current_epoch,
            "wall_time_s": wall,
            "train_time_s": max(step_seconds),
            "samples": samples,
            "throughput_samples_per_s": samples / max(step_seconds) if max(step_seconds) > 0 else None,
            "step_time_s": max(step_seconds) / steps if steps else None,
            "step_time_s_per_rank": [t / steps for t in step_seconds] if steps else None,
            "peak_memory_bytes": [int(b) for b in per_rank[:, 1]],
            "parameter_bytes_per_rank": [int(b) for b in per_rank[:, 2]],
            "metrics": {name: self._describe(name, values) for name, values in self.history.items()},
        }
        measurements = getattr(strategy, "rank_measurements", None)  # e.g. a pipeline's measured idle time
        if callable(measurements):
            self.summary["per_rank"] = gather_objects(measurements())

    def _describe(self, name: str, values: list[float]) -> dict[str, Any]:
        higher = self.higher_is_better.get(name, False)
        return {"final": values[-1], "best": max(values) if higher else min(values), "history": values}
