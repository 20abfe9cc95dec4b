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
from typing_extensions import override


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA allocator's peak on GPU, else the process peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


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
        # Ranks of one data-parallel replica see the same batch; count each sample once.
        replicas = (getattr(strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
        local = torch.tensor([self._local_samples, peak_memory_bytes(strategy.root_device)], dtype=torch.int64)
        gathered = strategy.all_gather(local.to(strategy.root_device)).cpu().reshape(-1, 2)
        samples = int(gathered[:, 0].sum()) * replicas // max(trainer.world_size, 1)
        step_seconds = float(
            strategy.reduce(
                torch.tensor(self._step_seconds, dtype=torch.float64, device=strategy.root_device),
                reduce_op="max",
            )
        )
        self.summary = {
            "steps": trainer.global_step,
            "epochs": trainer.current_epoch,
            "wall_time_s": wall,
            "train_time_s": step_seconds,
            "samples": samples,
            "throughput_samples_per_s": samples / step_seconds if step_seconds > 0 else None,
            "step_time_s": step_seconds / trainer.global_step if trainer.global_step else None,
            "peak_memory_bytes": [int(b) for b in gathered[:, 1]],
            "metrics": {name: self._describe(name, values) for name, values in self.history.items()},
        }

    def _describe(self, name: str, values: list[float]) -> dict[str, Any]:
        higher = self.higher_is_better.get(name, False)
        return {"final": values[-1], "best": max(values) if higher else min(values), "history": values}
