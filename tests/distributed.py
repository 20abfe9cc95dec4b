"""Start N worker processes the way torchrun would (env vars), so Lightning runs many fits in one launch.

Each worker gets the same JSON payload and writes `rank<r>.pt` into the output directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

WORKERS = Path(__file__).parent / "workers"


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
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process below
        cmd = [sys.executable, str(WORKERS / f"{worker}.py"), str(out)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        # Like torchrun's agent: once one rank fails, the others (waiting for it in a collective) are stopped.
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc, _ in procs):
            if any(proc.poll() not in (None, 0) for proc, _ in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for _, log in procs:
            log.close()
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [r for r, (proc, _) in enumerate(procs) if proc.returncode != 0]
    if failed:
        first = next((r for r in failed if procs[r][0].returncode != -signal.SIGKILL), failed[0])  # not one we killed
        tail = (out / f"rank{first}.log").read_text()[-4000:]
        raise AssertionError(f"ranks {failed} failed; rank {first} log tail:\n{tail}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
