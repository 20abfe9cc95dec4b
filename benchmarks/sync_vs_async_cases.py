"""What sync_vs_async.py compares: the workloads with their targets and step budgets, the methods with their train.py
overrides and periods, the straggler's slowdown, and when rank 0's weights are snapshotted. Data only; it runs nothing.
"""

from __future__ import annotations

import math
from typing import Any

RUN = [
    "trainer.accelerator=cpu", "trainer.max_epochs=1000", "trainer.limit_val_batches=0", "callbacks=none",
    "~logger", "+trainer.enable_progress_bar=false", "+trainer.enable_checkpointing=false",
]  # fmt: skip
# steps: each worker's optimizer steps (full, --quick); every: steps between snapshots of rank 0's weights
WORKLOADS: dict[str, dict[str, Any]] = {
    "digits": {"overrides": [], "label": "SimpleCNN on digits", "target": ("acc", 0.95), "steps": (400, 100),
               "every": 10, "note": ""},
    "gpt": {"overrides": ["model=transformer", "data=synthetic_tokens"], "label": "GPT (depth 4, width 128) on "
            "synthetic copy tokens", "target": ("loss", 2.0), "steps": (240, 100), "every": 10,
            "note": " (the floor is ln(32) / 2 = 1.73: the first half of each sequence is random)"},
}  # fmt: skip
PERIODS = {"local_sgd": 4, "diloco": 10}  # conf/strategy's defaults, stated here so the table can name them
METHODS: dict[str, list[str]] = {
    "ddp": ["strategy=ddp"],
    "local_sgd": ["strategy=local_sgd", f"strategy.period={PERIODS['local_sgd']}", "strategy.warmup_steps=0"],
    "diloco": ["strategy=diloco", f"strategy.period={PERIODS['diloco']}"],
    "async_sgd": ["strategy=async_sgd"],
}
SLOWDOWN = 2.0


def snapshot_schedule(method: str, every: int) -> tuple[int, int]:
    """(every, offset) putting snapshots right after a synchronisation: torch's PeriodicModelAverager averages
    after optimizer steps 1, 1 + period, ...; DiLoCo syncs after period, 2 x period, ..."""
    if method == "local_sgd":
        return PERIODS[method] * math.ceil(every / PERIODS[method]), 1
    if method == "diloco":
        return PERIODS[method] * math.ceil(every / PERIODS[method]), 0
    return every, 0
