"""What a timing needs beside the run itself: the cores other processes kept busy (`LoadMeter`, `Usage`,
`other_cores`), steady steps and robust summaries (`steady`, `stats_ms`, the `StepTimes` callback a train.py run gets),
and repeats interleaved against drift (`order`). It starts no process (harness.py does) and names no machine.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl

T = TypeVar("T")


# ---- the machine: other processes' load -------------------------------------------------------------------
def busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has spent busy since boot (Linux /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def children_cpu_s() -> float:
    """CPU seconds this process's finished children have used (all of them, since it started)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class LoadMeter:
    """Cores kept busy by processes other than ours between `start()` and `other_cores(own_cpu_s)`.

    On a 2-core machine anything above ~0.1 core inflates and scatters every timing, so each result says it.
    """

    def start(self) -> None:
        self._wall, self._busy = time.perf_counter(), busy_cpu_seconds()

    def other_cores(self, own_cpu_s: float) -> float:
        """`own_cpu_s`: CPU seconds our own processes used in the interval (all ranks together)."""
        wall = time.perf_counter() - self._wall
        return max(0.0, busy_cpu_seconds() - self._busy - own_cpu_s) / wall if wall > 0 else 0.0


class Usage:
    """Wall seconds, this process's CPU seconds and the whole machine's busy CPU seconds since `start()`: one rank's
    record of a run; `other_cores` turns every rank's record into the cores other processes kept busy meanwhile."""

    @staticmethod
    def now() -> tuple[float, float, float]:
        return time.perf_counter(), time.process_time(), busy_cpu_seconds()

    def start(self) -> None:
        self._then = self.now()

    def totals(self) -> dict[str, float]:
        wall, own, busy = (now - then for now, then in zip(self.now(), self._then, strict=True))
        return {"run_wall_s": wall, "run_own_cpu_s": own, "run_machine_busy_s": busy}


def other_cores(ranks: list[dict[str, Any]]) -> float:
    """Cores other processes kept busy during a run, from each rank's `Usage.totals()` (all ranks started together)."""
    own = sum(rank["run_own_cpu_s"] for rank in ranks)
    return max(0.0, ranks[0]["run_machine_busy_s"] - own) / ranks[0]["run_wall_s"]


# ---- timings ---------------------------------------------------------------------------------------------------
def stats_ms(seconds: list[float]) -> dict[str, float]:
    """Median and 10th/90th percentiles in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    if len(ms) < 2:
        return {"median": ms[0], "p10": ms[0], "p90": ms[0], "n": len(ms)}
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return {"median": statistics.median(ms), "p10": q[0], "p90": q[-1], "n": len(ms)}


def steady(seconds: list[float], warmup: int) -> float:
    """The steady step: the median after the first `warmup` steps (all of them when there are no more)."""
    return statistics.median(seconds[warmup:] or seconds)


class StepTimes(pl.Callback):
    """Added to a train.py run (`train_py(..., step_times=True)`): per-step seconds, and the rank's `Usage` over fit,
    written to `step_times_rank<r>.json` in the run directory, so the warm-up steps can be left out and runs disturbed
    by other processes recognised (`other_cores`)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0
        self._fit = Usage()

    def on_fit_start(self, *args: Any) -> None:
        self._fit.start()

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)

    def on_fit_end(self, trainer: pl.Trainer, *args: Any) -> None:
        path = Path(trainer.default_root_dir) / f"step_times_rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"seconds": self.seconds, **self._fit.totals()}))


def order(repeat: int, items: list[T]) -> list[T]:
    """`items` in repeat `repeat`'s order: reversed every other repeat, so linear drift cancels in pairs of repeats."""
    return items[:: 1 if repeat % 2 == 0 else -1]


def interleaved(repeats: int, items: list[T]) -> Iterator[tuple[int, T]]:
    """(repeat, item) for every repeat of every item, each repeat in `order`."""
    for rep in range(repeats):
        for item in order(rep, items):
            yield rep, item
