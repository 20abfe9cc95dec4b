"""planner_accuracy.py's measurements of the machine outside train.py: each block's forward + backward time and the
AdamW step in one single-threaded process, gloo latency and bandwidth between 2 processes, and how much slower
processes compute when all cores are busy at once. Run as a script, it is one of those processes (`measure_contention`).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from planner_accuracy_cases import CORES, MODELS, build

from lightning_parallel.planner import measure_block_seconds


def time_blocks(key: str, model: torch.nn.Sequential, sample: torch.Tensor) -> list[tuple[float, float]]:
    """(fixed, per-sample) forward + backward seconds per block, one thread, at the model's two fit sizes."""
    return measure_block_seconds(
        model, lambda n: sample.unsqueeze(0).expand(n, *sample.shape).contiguous(), sizes=MODELS[key]["sizes"],
        repeats=9, warmup=3, threads=1,
    )  # fmt: skip


def adam_seconds_per_parameter(model: torch.nn.Module) -> float:
    torch.set_num_threads(1)
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    times = []
    for run in range(25):
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if run >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / sum(p.numel() for p in params)


# ---- machine micro-benchmarks (plain torch scripts, started together) ---------------------------------------------
SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 21]  # bytes
COMM_SCRIPT = """
import json, statistics, sys, time, torch, torch.distributed as dist
rank, port, out, sizes = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
result = {"all_reduce": [], "send": []}
for size in sizes:
    tensor = torch.zeros(size // 4)
    for kind in result:
        times = []
        for run in range(33):
            dist.barrier()
            start = time.perf_counter()
            if kind == "all_reduce":
                dist.all_reduce(tensor)
            elif rank == 0:  # a round trip, halved: one message each way
                dist.send(tensor, 1); dist.recv(tensor, 1)
            else:
                dist.recv(tensor, 0); dist.send(tensor, 0)
            if run >= 3:
                times.append((time.perf_counter() - start) / (1 if kind == "all_reduce" else 2))
        result[kind].append(statistics.median(times))
if rank == 0:
    open(out, "w").write(json.dumps(result))
dist.destroy_process_group()
"""


def run_scripts(script: str, argv: list[list[str]], timeout: float = 120) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script, *args], env=env) for args in argv]
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Theil-Sen ``y = a + b x``: median pairwise slope, median intercept; one disturbed size cannot tilt it."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    b = max(statistics.median(slopes), 1e-15)
    return max(0.0, statistics.median(y - b * x for x, y in zip(xs, ys, strict=True))), b


def measure_network() -> dict[str, Any]:
    """gloo latency and bandwidth between 2 local processes, from all-reduce and send/recv times over SIZES."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/comm.json"
        run_scripts(COMM_SCRIPT, [[str(rank), port, out, json.dumps(SIZES)] for rank in range(2)])
        raw = json.loads(Path(out).read_text())
    ar_fixed, ar_per_byte = fit_line(SIZES, raw["all_reduce"])  # n=2: 2 latency + bytes / bandwidth
    p2p_fixed, p2p_per_byte = fit_line(SIZES, raw["send"])  # latency + bytes / bandwidth
    return {"latency": (ar_fixed / 2 + p2p_fixed) / 2, "bandwidth": 2 / (ar_per_byte + p2p_per_byte), "seconds": raw}


# ---- contention: processes computing at once on the shared cores ----------------------------------------------------
def measure_contention() -> dict[str, Any]:
    """How many times slower each of CORES single-threaded processes computes both models' blocks while all of them
    compute at once than one process alone (fresh processes both times, started together once all are built)."""
    totals: dict[int, list[float]] = {}
    for together in (1, CORES):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            procs = [subprocess.Popen([sys.executable, __file__, f"{tmp}/{i}"], env=env)
                     for i in range(together)]  # fmt: skip
            deadline = time.time() + 300
            while not all(Path(f"{tmp}/{i}.ready").exists() for i in range(together)) and time.time() < deadline:
                time.sleep(0.05)
            Path(f"{tmp}/go").touch()
            for proc in procs:
                proc.wait(timeout=300)
            totals[together] = [json.loads(Path(f"{tmp}/{i}.json").read_text())["seconds"] for i in range(together)]
    solo = totals[1][0]
    return {
        "contention": max(1.0, statistics.median(totals[CORES]) / solo),
        "solo_s": solo,
        "together_s": totals[CORES],
    }


def time_blocks_when_told(prefix: str) -> None:
    """Worker of measure_contention: build both models, say so, wait for the go, time their blocks."""
    built = {key: build(key) for key in MODELS}
    Path(f"{prefix}.ready").touch()
    while not (Path(prefix).parent / "go").exists():
        time.sleep(0.01)
    seconds = 0.0
    for key, (_, model, sample, _) in built.items():
        large = MODELS[key]["sizes"][1]
        seconds += sum(fixed + per_sample * large for fixed, per_sample in time_blocks(key, model, sample))
    Path(f"{prefix}.json").write_text(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    time_blocks_when_told(sys.argv[1])
