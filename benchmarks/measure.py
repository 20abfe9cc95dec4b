"""What every benchmark here needs to report a number honestly: how busy other processes kept the machine
while it measured, robust summaries of repeated timings, and one line naming the machine.

Imported by the scripts next to it (`python benchmarks/<name>.py` puts this folder on sys.path).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch


def busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has spent busy since boot (Linux /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


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


def stats_ms(seconds: list[float]) -> dict[str, float]:
    """Median and 10th/90th percentiles in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    if len(ms) < 2:
        return {"median": ms[0], "p10": ms[0], "p90": ms[0], "n": len(ms)}
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return {"median": statistics.median(ms), "p10": q[0], "p90": q[-1], "n": len(ms)}


def machine() -> str:
    """e.g. 'x86_64, 2 CPUs, torch 2.13.0+cpu'."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
