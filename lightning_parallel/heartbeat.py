"""Heartbeats through the rendezvous store, so that a hang names the rank behind it.

Each rank's daemon thread writes, every `interval` seconds, the time, its pid and host, and where its main thread is
(`where`: the torch.distributed call it waits in and the code that made it). When a collective times out,
`read_hang` reads every rank's and names the one that stopped answering (no heartbeat for `stale_after` seconds:
SIGSTOP, a frozen host) or, when all are alive, one that is not waiting in torch.distributed while this rank is.
It decides nothing about when to fail (the process group's timeout does) and stops no process. Torch only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType

import torch.distributed as dist

PREFIX = "lightning_parallel/heartbeat"
# Frames of Python's standard library and of these packages are machinery: `where` names the code that called them.
PACKAGES = ("torch", "lightning", "lightning_utilities", "hydra", "omegaconf")
MACHINERY = (sysconfig.get_paths()["stdlib"] + os.sep, *(f"{os.sep}{name}{os.sep}" for name in PACKAGES))
WAITING = ("a collective", "a pipeline send/recv", "torch.distributed")  # how `where` starts for a rank that waits


def interval_for(timeout: timedelta) -> float:
    """Seconds between heartbeats: a tenth of the collective timeout, between 0.2 s and 30 s."""
    return min(max(timeout.total_seconds() / 10, 0.2), 30.0)


def where(frame: FrameType | None) -> str:
    """What a thread is doing, from its innermost frame: the torch.distributed call it is in (a collective, a
    pipeline send/recv, ...) and the innermost code outside torch, Lightning and Hydra, which made it."""
    if frame is None:
        return "nothing (its main thread has ended)"
    # innermost first
    frames = [(f.f_code.co_filename, line, f.f_code.co_name) for f, line in traceback.walk_stack(frame)]
    code = next((f for f in frames if not any(part in f[0] for part in MACHINERY)), None)
    at = f"{short(code[0])}:{code[1]} ({code[2]})" if code is not None else "library code"
    distributed = next((f for f in frames if f"{os.sep}torch{os.sep}distributed{os.sep}" in f[0]), None)
    if distributed is None:
        return f"its own code at {at}"
    pipelining = next((f for f in frames if f"{os.sep}pipelining{os.sep}" in f[0]), None)
    if pipelining is not None:
        waits = any(word in distributed[2] for word in ("wait", "send", "recv", "p2p"))
        kind = "a pipeline send/recv" if waits else "the pipeline schedule"
        return f"{kind} (torch.distributed.pipelining {pipelining[2]}) called from {at}"
    path, _, name = distributed
    if path.endswith("distributed_c10d.py"):
        return f"a collective ({name}) called from {at}"
    module = path.rsplit(f"{os.sep}torch{os.sep}", 1)[-1].removesuffix(".py").replace(os.sep, ".")
    return f"torch.distributed (torch.{module}.{name}) called from {at}"


def short(path: str) -> str:
    """A path relative to the working directory when it lies below it, else its last two parts."""
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else os.sep.join(path.split(os.sep)[-2:])


def connection(store: dist.Store) -> dist.Store:
    """A new connection to the same store (`Store.clone`, which torch's stubs do not declare)."""
    return store.clone()  # type: ignore[attr-defined]


class Heartbeat:
    """This rank's heartbeat: a daemon thread writing to its own connection to `store` every `interval` seconds
    while the default process group it was started with lives."""

    def __init__(self, store: dist.Store, *, rank: int, interval: float) -> None:
        self.rank, self.interval = rank, interval
        self._store = dist.PrefixStore(PREFIX, connection(store))  # the main thread may block on its own one
        self._main = threading.get_ident()  # the thread that trains
        self._group = dist.group.WORLD
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}", daemon=True)
        # where this rank last waited on its peers: by the time a timed-out wait is handled, the main thread (and so
        # its newest beat) may be in other code (a progress bar's teardown)
        self.last_wait: str | None = None

    def start(self) -> Heartbeat:
        self._beat("its set-up, right after its process group started")  # a rank that stops early is named too
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and dist.group.WORLD is self._group

    def _beat(self, doing: str | None = None) -> None:
        beat = {"time": time.time(), "pid": os.getpid(), "host": socket.gethostname()}
        beat["doing"] = doing = doing or where(sys._current_frames().get(self._main))
        if doing.startswith((*WAITING, "the pipeline schedule")):
            self.last_wait = doing
        self._store.set(str(self.rank), json.dumps(beat))

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and dist.group.WORLD is self._group:
            try:
                self._beat()
            except Exception:  # the store is gone (rank 0 exited): nothing left to tell
                return


@dataclass(frozen=True)
class Hang:
    """Who a timed-out collective waited for, and whether it is stopped (no heartbeat) or busy elsewhere."""

    rank: int
    stopped: bool
    pid: int
    host: str
    line: str

    @property
    def hint(self) -> str:
        if self.stopped:
            return "restarted (torchrun --max-restarts, SLURM --requeue) with ckpt_path=last, the run resumes"
        return "if a step legitimately takes longer than the strategy's timeout, raise it (strategy.timeout=<seconds>)"


def read_beats(store: dist.Store, world_size: int, *, timeout: float = 3.0) -> dict[int, dict] | None:
    """Every rank's last heartbeat (ranks that never sent one are missing); None when the store does not answer
    within `timeout` seconds (its host, rank 0, may be the stopped one)."""
    reader = dist.PrefixStore(PREFIX, connection(store))
    reader.set_timeout(timedelta(seconds=timeout))
    try:
        present = [rank for rank in range(world_size) if reader.check([str(rank)])]
        values = reader.multi_get([str(rank) for rank in present]) if present else []
    except dist.DistError:
        return None
    return {rank: json.loads(value) for rank, value in zip(present, values, strict=True)}


def read_hang(
    store: dist.Store, *, me: int, world_size: int, stale_after: float, waited: str | None = None
) -> Hang | None:
    """The rank this one waited for when its collective timed out (in `waited`, else where its own heartbeat says),
    from every rank's heartbeat; None when the heartbeats name no one (or cannot be read)."""
    beats = read_beats(store, world_size)
    if beats is None:
        return None
    waited = waited or beats.get(me, {}).get("doing", "a collective")
    now = time.time()
    for rank in range(world_size):
        beat = beats.get(rank)
        if rank == me or (beat is not None and now - beat["time"] <= stale_after):
            continue
        if beat is None:
            return Hang(rank, True, -1, "", f"rank {rank} never sent a heartbeat; rank {me} waited for it in {waited}")
        line = (
            f"rank {rank} stopped answering: no heartbeat for {now - beat['time']:.1f} s (pid {beat['pid']} on "
            f"{beat['host']}: SIGSTOP, a frozen host or a debugger); it was in {beat['doing']}; rank {me} waited for "
            f"it in {waited}"
        )
        return Hang(rank, True, beat["pid"], beat["host"], line)
    for rank, beat in sorted(beats.items()):
        if rank != me and not beat["doing"].startswith(WAITING):
            doing = beat["doing"]
            line = f"rank {rank} is alive but not in a collective: it is in {doing}; rank {me} waited in {waited}"
            return Hang(rank, False, beat["pid"], beat["host"], line)
    return None
