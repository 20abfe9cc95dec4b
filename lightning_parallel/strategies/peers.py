"""A run's other processes: refuse a node count nothing can satisfy, or a launcher's processes per node that are not
the devices; when a launched rank dies (or one a collective waited for stops answering), name it first and stop the
others.

Lightning kills the processes it launched only on Ctrl+C; after any other error a peer stuck in a collective
or in user code would be left running. Used by the mesh strategies and by our DDP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_parallel.heartbeat import Hang

# How a peer's death shows up on the survivors (gloo, nccl and the store).
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistNetworkError")


def check_nodes(num_nodes: int, environment: object, environ: Mapping[str, str] = os.environ) -> None:
    """A multi-node run needs something that tells each process its node: torchrun, SLURM (their own cluster
    environments) or NODE_RANK set by hand. Without it, rank 0 waits for nodes that never come until the
    timeout; refuse before launch instead."""
    if num_nodes <= 1 or not isinstance(environment, LightningEnvironment):
        return
    if "NODE_RANK" in environ or "GROUP_RANK" in environ:
        return
    raise ValueError(
        f"num_nodes={num_nodes}, but this process was not started by a multi-node launcher (no torchrun, SLURM or "
        f"NODE_RANK), so it would wait for {num_nodes - 1} more node(s) until the timeout. HINT: on one machine use "
        f"num_nodes=1; across machines run `torchrun --nnodes={num_nodes} ...` (or srun) on each node, or set "
        "NODE_RANK, MASTER_ADDR and MASTER_PORT on each"
    )


def check_launched(devices: int, environment: object, environ: Mapping[str, str] = os.environ) -> None:
    """Under torchrun or srun the launcher starts the processes and Lightning indexes its devices by each one's
    local rank: more processes per node than `devices` fail with an IndexError on the extra ranks, fewer wait for
    ranks that never come. Refuse the mismatch in one line, the same on every rank, before the model is built."""
    if isinstance(environment, TorchElasticEnvironment):
        count, launcher, flag = environ.get("LOCAL_WORLD_SIZE"), "torchrun", "--nproc-per-node"
    elif isinstance(environment, SLURMEnvironment):
        count, launcher, flag = environ.get("SLURM_NTASKS_PER_NODE"), "srun", "--ntasks-per-node"
    else:
        return
    if count is None or not count.isdigit() or int(count) == devices:
        return
    raise ValueError(
        f"{launcher} started {count} processes per node ({flag}={count}), but trainer.devices={devices}: Lightning "
        f"runs one process per device. HINT: trainer.devices={count} (or {launcher} {flag}={devices})"
    )


@dataclass(frozen=True)
class PeerFailure:
    """A launched rank that exited on its own with a failure, before this process stopped it."""

    rank: int
    returncode: int

    @property
    def how(self) -> str:
        if self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            cause = " from outside, e.g. the out-of-memory killer; it printed no error" if name == "SIGKILL" else ""
            return f"was killed by {name}{cause}"
        return f"exited with code {self.returncode}; its own error is printed above"

    def __str__(self) -> str:
        return f"rank {self.rank} died first: it {self.how}"


def lost_a_peer(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}"
    return any(mark in text for mark in LOST_PEER)


def first_dead(procs: list[subprocess.Popen], first_rank: int, wait: float) -> PeerFailure | None:
    """The launched process that exited with a failure, waiting up to `wait` seconds for one to do so."""
    deadline = time.monotonic() + wait
    while True:
        for offset, proc in enumerate(procs):
            if proc.poll() not in (None, 0):
                return PeerFailure(rank=first_rank + offset, returncode=proc.returncode)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def stop_peers(
    launcher: object, error: BaseException, *, node_rank: int, num_processes: int, hang: Hang | None = None
) -> PeerFailure | None:
    """After `error`, print one line naming its cause, when known, and stop every rank this process launched: the
    launched rank that died first (when `error` says a peer was lost, it gets a moment to finish exiting), else the
    rank a timed-out collective waited for (`hang`, from the heartbeats), else that a peer hung. Under torchrun or
    SLURM nothing was launched here: only `hang` is told, and the launcher stops the rest."""
    launched = isinstance(launcher, _SubprocessScriptLauncher) and bool(launcher.procs)
    failure = None
    if launched:
        assert isinstance(launcher, _SubprocessScriptLauncher)
        wait = 5.0 if lost_a_peer(error) else 0.0
        failure = first_dead(launcher.procs, node_rank * num_processes + 1, wait)
        launcher.kill(signal.SIGKILL)
    line = str(failure) if failure is not None else f"{hang.line}. HINT: {hang.hint}" if hang is not None else None
    if line is None and launched and "Timed out" in str(error):
        line = (
            f"a collective timed out on rank {node_rank * num_processes}: another rank is alive but stuck (in its "
            "own code or in a different collective); every rank is stopped. HINT: if a step legitimately takes "
            "that long, raise the strategy's timeout"
        )
    if line is not None:
        print(f"error: {line}", file=sys.stderr, flush=True)
        error.add_note(f"caused by: {line}")
    return failure
