"""What every benchmark here needs to report a number honestly: how busy other processes kept the machine
while it measured, robust summaries of repeated timings, and one line naming the machine.

Imported by the scripts next to it (`python benchmarks/<name>.py` puts this folder on sys.path).
"""

from __future__ import annotations

import argparse
import json
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


# ---- the overhead benchmarks' shared frame (strategy vs the same layout written by hand) -----------------------
def overhead_arguments(description: str, timeout: float) -> argparse.Namespace:
    """Steps, warm-up and interleaved repeats per run; `--worker DIR` marks a launched rank."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run left out of the statistics")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved repeats of every run (even: balanced)")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds before the ranks are killed")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def worker_args(args: argparse.Namespace) -> list[str]:
    """The arguments each launched rank gets back."""
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]


def write_results(results: Path, name: str, report: dict, table: str, wall_s: float) -> None:
    """results/<name>.json (the whole report) and results/<name>.md (the table), and the table on stdout."""
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(report, indent=1))
    (results / f"{name}.md").write_text(table)
    print(table)
    print(f"wrote {results}/{name}.{{json,md}} in {wall_s:.0f} s")
