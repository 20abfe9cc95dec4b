"""The process group of one run attempt, started the same way by every strategy of this package: a rendezvous store
made for this attempt (`rendezvous.store_for`: bound to the main address; under torchrun one of the attempt's own,
since torchrun's outlives a restart), the group over it with the strategy's timeout, and this rank's heartbeat. After
a collective times out, `name_the_hang` names the rank it waited for. It does not launch or stop processes.

With mesh_processes.py, sharded_checkpoints.py and base.py, a place allowed to touch Lightning's private helpers.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection

from lightning_parallel.heartbeat import Hang, Heartbeat, interval_for, read_hang
from lightning_parallel.rendezvous import store_for
from lightning_parallel.replica_calls import ReplicaCalls

# How long the store waits for the other processes to start (importing torch and Lightning can take 10 s on a loaded
# machine, a restarted torchrun attempt longer); a short collective `timeout` is for hung collectives, not slow starts.
JOIN_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class RunningGroup:
    """The default process group this process started, its store and heartbeat."""

    store: dist.Store
    heartbeat: Heartbeat
    world_size: int
    timeout: timedelta


_running: RunningGroup | None = None  # one per process: the default group is process-wide
_store: dist.Store | None = None  # the default group's rendezvous store (every world size)


def start_process_group(
    environment: Any, backend: str, *, rank: int, world_size: int, timeout: timedelta, **kwargs: Any
) -> None:
    """Rendezvous and start the default process group with `timeout` for collectives, unless one exists (a later
    fit in the same processes reuses it, its store and heartbeat)."""
    global _running, _store
    if _distributed_is_initialized():
        return
    address, port = environment.main_address, environment.main_port
    store = store_for(address, port, rank=rank, world_size=world_size, timeout=max(timeout, JOIN_TIMEOUT))
    _init_dist_connection(environment, backend, timeout=timeout, store=store, **kwargs)
    _store = store
    if world_size > 1:
        heartbeat = Heartbeat(store, rank=rank, interval=interval_for(timeout)).start()
        _running = RunningGroup(store, heartbeat, world_size, timeout)


def group_store() -> dist.Store | None:
    """The store this attempt's default group rendezvoused on (new with each attempt), or None when the group was
    not started by `start_process_group`."""
    return _store


def replica_calls(group: dist.ProcessGroup | None) -> ReplicaCalls | None:
    """The agreement on each step's token-mean call over `group` (`replica_calls.py`), through this attempt's store
    and with its timeout; None when this package did not start the process group (or it is one process)."""
    running = _running
    if running is None:
        return None
    poll = min(running.heartbeat.interval, 1.0)
    return ReplicaCalls(group, store=running.store, timeout=running.timeout.total_seconds(), poll=poll)


def timed_out(error: BaseException) -> bool:
    """Whether `error` is a collective or store operation that gave up waiting (gloo, the store)."""
    text = str(error)
    return "Timed out" in text or "timed out" in text or "wait timeout" in text


def name_the_hang(error: BaseException) -> Hang | None:
    """After `error` timed out a collective: the rank it waited for, from the heartbeats. A rank that stopped answering
    on this host is killed (SIGKILL: a stopped process cannot act on the SIGTERM torchrun sends first, and torchrun
    would wait 30 s for it), so the launcher can restart the job at once."""
    running = _running
    if running is None or not running.heartbeat.alive or not timed_out(error):
        return None
    stale_after = max(5 * running.heartbeat.interval, running.timeout.total_seconds() / 2)
    beating = running.heartbeat
    hang = read_hang(
        running.store, me=beating.rank, world_size=running.world_size, stale_after=stale_after, waited=beating.last_wait
    )
    if hang is not None and hang.stopped and hang.host == socket.gethostname() and hang.pid not in (-1, os.getpid()):
        try:
            os.kill(hang.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        hang = Hang(hang.rank, hang.stopped, hang.pid, hang.host, f"{hang.line}; rank {hang.rank} was killed")
    return hang
