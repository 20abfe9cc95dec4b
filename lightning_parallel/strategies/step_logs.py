"""What the user's step logs inside a pipelined step: `self.log` calls recorded per micro-batch on the last stage
(`LogRecord`), replayed once per name on every rank after the schedule (so `sync_dist` collectives line up), each the
mean over the equal micro-batches, and the one line naming logged values whose mean over micro-batches is not one
device's. It does not run the step (`user_step.py`) or move the records between ranks (`pipeline_step.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torchmetrics import Metric


@dataclass
class LogRecord:
    """One `self.log` call made during a micro-batch: a plain value, or the path of a torchmetrics Metric
    and the micro-batch value it computed."""

    name: str
    value: float | torch.Tensor | None
    kwargs: dict[str, Any]
    metric: str | None = None
    is_loss: bool = False  # the value the step returned as its loss (a share of the batch's: exact when averaged)


def replay_logs(module: pl.LightningModule, records: list[list[LogRecord]], *, holds_metrics: bool) -> None:
    """Log, on this rank, what the user's step logged: each name once, its mean over the micro-batches.

    Micro-batches are equal in size and a mean over valid tokens is each one's share of the batch's (`token_shares`),
    so the mean over the micro-batches is the batch's value. A torchmetrics
    Metric was updated only on the last stage (`holds_metrics`); elsewhere it is marked as updated with
    nothing added, so the epoch-end `compute()` joins the same all-gather and sums the last stages' states.
    """
    by_name: dict[str, list[LogRecord]] = {}
    for micro in records:
        for record in micro:
            by_name.setdefault(record.name, []).append(record)
    for name, seen in by_name.items():
        kwargs = dict(seen[0].kwargs)
        if kwargs.get("batch_size") is not None:
            kwargs["batch_size"] = sum(int(r.kwargs["batch_size"]) for r in seen)
        value = _mean([r.value for r in seen])
        if seen[0].metric is None:
            module.log(name, value, **kwargs)
            continue
        metric = cast(Metric, module.get_submodule(seen[0].metric))
        if not holds_metrics:
            metric._update_count += 1  # torchmetrics: compute() warns and skips its sync without an update
            metric._computed = None  # a cached value would skip the all-gather the other ranks join
        metric._forward_cache = value  # what on_step logging shows: the batch's value
        module.log(name, metric, **kwargs)


def averaged_logs_line(where: str, records: list[list[LogRecord]]) -> str | None:
    """The one line for values logged inside a pipelined step other than its loss: each is logged as the mean of the
    equal micro-batches' values, one device's for a mean over rows but not for a ratio over valid tokens; None when
    there are none (or one micro-batch)."""
    names = sorted({r.name for micro in records for r in micro if not r.is_loss and r.metric is None})
    if len(records) < 2 or not names:
        return None
    return (
        f"{where} logs {', '.join(names)} per micro-batch: each is logged as the mean of its {len(records)} "
        "micro-batches' values (equal rows each), one device's value for a mean over rows but not for a ratio over "
        "valid tokens (a token accuracy on padded text). HINT: log a torchmetrics Metric (its epoch value adds up "
        "every micro-batch's state), or compute the value from the whole batch in on_train_batch_end"
    )


def plain(value: Any) -> float | torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu()
        return float(value) if value.numel() == 1 else value
    return None if value is None else float(value)


def _mean(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, float) for v in present):
        return torch.tensor(sum(present) / len(present))
    return torch.stack([torch.as_tensor(v) for v in present]).mean(0)
