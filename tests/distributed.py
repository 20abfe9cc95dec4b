"""Start N worker processes the way torchrun would (env vars), so Lightning runs many fits in one launch.

Each worker gets the same JSON payload and writes `rank<r>.pt` into the output directory. The workers are forked
from one server process that imported torch, Lightning and the library once per test session: a fresh interpreter
spends about 9 s of CPU importing them (2026-11-26; about 1.5 s of it is transformers' AutoModel, which torchmetrics
imports whenever transformers is installed, as the dev extra does), which made process start-up most of every
multi-process test here.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

WORKERS = Path(__file__).parent / "workers"
PRELOADED = ["torch", "lightning.pytorch", "torchmetrics", "lightning_parallel"]
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(PRELOADED)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS threads in the server: its forks start clean


def _become(script: str, out: str, env: dict[str, str], log: str) -> None:
    """In a fork of the server: run `python <script> <out>` with `env`, its output going to `log`."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # what PYTHONUNBUFFERED would give
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.argv = [script, out]
    sys.path.insert(0, str(Path(script).parent))  # as `python script.py` does: the workers import their siblings
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    runpy.run_path(script, run_name="__main__")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(worker: str, nprocs: int, payload: Any, out: Path, timeout: float = 300) -> list[Any]:
    """Run `tests/workers/<worker>.py` on `nprocs` ranks; return each rank's saved result."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "payload.json").write_text(json.dumps(payload))
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(nprocs),
            "NODE_RANK": "0",
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        args = (str(WORKERS / f"{worker}.py"), str(out), env, str(out / f"rank{rank}.log"))
        procs.append(_FORKS.Process(target=_become, args=args, daemon=False))
        procs[-1].start()
    try:
        # Like torchrun's agent: once one rank fails, the others (waiting for it in a collective) are stopped.
        deadline = time.monotonic() + timeout
        while any(proc.exitcode is None for proc in procs):
            if any(proc.exitcode not in (None, 0) for proc in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
    failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
    if failed:
        first = next((r for r in failed if procs[r].exitcode != -signal.SIGKILL), failed[0])  # not one we killed
        tail = (out / f"rank{first}.log").read_text()[-4000:]
        raise AssertionError(f"ranks {failed} failed; rank {first} log tail:\n{tail}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


def replica_states(results: list[dict], replicas: int) -> list[dict[str, torch.Tensor]]:
    """Each data-parallel replica's whole state, the union of its ranks' `state` dicts. "dp" is the outermost mesh
    dimension, so replica r is ranks r * size .. (r + 1) * size - 1. Merging all ranks into one dict instead would
    let the last replica's values overwrite the others': a replica that drifted would go unseen."""
    size = len(results) // replicas
    return [
        {name: value for result in results[r * size : (r + 1) * size] for name, value in result["state"].items()}
        for r in range(replicas)
    ]


def start_worker(worker: str, out: Path, env: dict[str, str]) -> multiprocessing.Process:
    """Start `tests/workers/<worker>.py <out>` alone, in a fork of the server, with `env` on top of this process's
    environment (e.g. a world of its own); its output goes to `out/log.txt`. The caller waits for it, or kills it."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    proc = _FORKS.Process(target=_become, args=(str(WORKERS / f"{worker}.py"), str(out), env, str(out / "log.txt")))
    proc.start()
    return proc
