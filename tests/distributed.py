"""Start N worker processes the way torchrun would (env vars), so Lightning runs many fits in one launch.

Each worker gets the same JSON payload and writes `rank<r>.pt` into the output directory. The workers are forked
from one server process that imported torch, Lightning and the library once per test session: a fresh interpreter
spends about 9 s of CPU importing them (2026-11-26; about 1.5 s of it is transformers' AutoModel, which torchmetrics
imports whenever transformers is installed, as the dev extra does), which made process start-up most of every
multi-process test here. `run_script` runs a script's command line (train.py's, an example's) the same way: its
first process forked from the server, the ranks it launches fresh interpreters as a user's are.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
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


def _become_script(
    script: str, args: list[str], cwd: str, env: dict[str, str], out: Any, err: Any, fork_ranks: bool = False
) -> None:
    """In a fork of the server: `python <script> <args>` run from `cwd` with `env`, its standard output and error
    going to the pipes `out` and `err` (which the ranks it launches inherit, as from a shell). With `fork_ranks` the
    ranks Lightning's launcher starts are forks of this process (tests/forked_ranks.py)."""
    os.setsid()  # a session of its own, which the ranks it launches join: a timeout ends them all (run_script)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    if fork_ranks:
        from forked_ranks import fork_launched_ranks

        fork_launched_ranks(_run_as_script)
    _run_as_script(script, args, cwd, env)


def _become_logged_script(script: str, args: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """In a fork of the server: `python <script> <args>` in a session of its own, both outputs going to `log`."""
    os.setsid()  # a session of its own, which the processes it starts join: end_session ends them all
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _run_as_script(script, args, cwd, env)


def _run_as_script(script: str, args: list[str], cwd: str, env: dict[str, str]) -> None:
    """`python <script> <args>` from `cwd` with `env`, in this (forked) process, its outputs already redirected."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # what PYTHONUNBUFFERED would give
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    module = script.removeprefix("-m ") if script.startswith("-m ") else None  # `python -m <module>`
    sys.argv = [script if module is None else module, *args]
    # sys.path as `python <script>` has it: the script's folder (the working directory under -m), then PYTHONPATH,
    # then the interpreter's own
    own = [p for p in sys.path if "site-packages" in p or p.startswith(sys.base_prefix) or p.startswith("__editable__")]
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [str(Path(script).parent) if module is None else cwd, *given, *own]
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    # Lightning reads the process's rank from the environment when imported, which the server did with none set: read
    # it again, as a fresh interpreter would (a SLURM-style task or a launched rank comes here with its own)
    from lightning.fabric.utilities.rank_zero import _get_rank
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    rank_zero_only.rank = utils_rank_zero_only.rank = _get_rank() or 0  # type: ignore[attr-defined]
    if module is not None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # warns as -m does if it was imported already
    else:
        runpy.run_path(script, run_name="__main__")


def run_script(
    script: Path | str, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float, fork_ranks: bool = False
) -> subprocess.CompletedProcess[str]:
    """`python <script> <args>` (script "-m <module>": `python -m <module> <args>`) as
    subprocess.run(capture_output=True, text=True) runs it, in a fork of the server that imported torch, Lightning and
    the library once: ~9 s of CPU less than a fresh interpreter (the ranks > 0 a launch starts are fresh interpreters
    running the command line as a user's would, or with `fork_ranks` forks of it running that command line: another
    ~9 s of CPU less each, tests/forked_ranks.py). Its output is read until every process holding the
    pipes (the ranks it started too) has closed them; after `timeout` it is killed with the ranks it started
    (subprocess.run would leave those running) and subprocess.TimeoutExpired raised."""
    (out_r, out_w), (err_r, err_w) = _FORKS.Pipe(duplex=False), _FORKS.Pipe(duplex=False)
    proc = _FORKS.Process(
        target=_become_script, args=(str(script), list(args), str(cwd), env, out_w, err_w, fork_ranks)
    )
    proc.start()
    out_w.close()
    err_w.close()
    read: dict[str, bytes] = {}

    def drain(name: str, conn: Any) -> None:
        with open(conn.fileno(), "rb", closefd=False) as pipe:
            read[name] = pipe.read()
        conn.close()

    readers = [threading.Thread(target=drain, args=pair, daemon=True) for pair in (("out", out_r), ("err", err_r))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    proc.join(timeout)
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    if proc.exitcode is None or any(reader.is_alive() for reader in readers):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the script and every rank it launched: none left spinning
        proc.join()
        raise subprocess.TimeoutExpired([sys.executable, str(script), *args], timeout)
    text = {name: read.get(name, b"").decode(errors="replace") for name in ("out", "err")}
    return subprocess.CompletedProcess([sys.executable, str(script), *args], proc.exitcode, text["out"], text["err"])


def start_script(script: Path, args: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> Any:
    """Start `python <script> <args>` as run_script runs it (a fork of the server, in a session of its own), without
    waiting: its output and its children's go to `log`. The caller joins it, and ends it with `end_session`."""
    proc = _FORKS.Process(target=_become_logged_script, args=(str(script), list(args), str(cwd), env, str(log)))
    proc.start()
    return proc


def end_session(proc: Any) -> None:
    """Kill whatever is left of a process start_script started and of every process it started (its session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.join()


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
