"""Heartbeats name the rank behind a hang: the one with no recent heartbeat (stopped), else one alive outside
torch.distributed while the others wait. No processes: a store in this process, beats written by hand."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_parallel.heartbeat import PREFIX, Heartbeat, read_beats, read_hang, where

WAIT = "a pipeline send/recv (torch.distributed.pipelining _wait_batch_p2p) called from pipeline/runtime.py:233"


def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def beat(server: dist.TCPStore, rank: int, age: float, doing: str) -> None:
    payload = {"time": time.time() - age, "pid": 1000 + rank, "host": "node-a", "doing": doing}
    dist.PrefixStore(PREFIX, server).set(str(rank), json.dumps(payload))


def test_the_rank_without_a_recent_heartbeat_is_named_with_what_it_and_the_waiting_rank_were_doing() -> None:
    server = store()
    beat(server, 0, 0.1, WAIT)
    beat(server, 1, 9.0, "its own code at train.py:12 (step)")
    beat(server, 2, 0.2, WAIT)
    hang = read_hang(server, me=0, world_size=3, stale_after=4.0)
    assert hang is not None and (hang.rank, hang.stopped, hang.pid, hang.host) == (1, True, 1001, "node-a")
    assert re.match(r"rank 1 stopped answering: no heartbeat for 9\.\d s \(pid 1001 on node-a: SIGSTOP", hang.line)
    assert hang.line.endswith(f"it was in its own code at train.py:12 (step); rank 0 waited for it in {WAIT}")


def test_the_waiting_rank_names_where_it_last_waited_though_its_newest_beat_is_elsewhere() -> None:
    """By the time a timed-out wait is handled, the waiting rank's main thread (and its newest beat) may be in a
    progress bar's teardown: the hang names where it last waited."""
    server = store()
    heartbeat = Heartbeat(server, rank=0, interval=60.0)
    heartbeat._beat(WAIT)
    heartbeat._beat("its own code at rich/console.py:971 (__exit__)")
    assert heartbeat.last_wait == WAIT
    beat(server, 1, 9.0, "its own code at train.py:12 (step)")
    hang = read_hang(server, me=0, world_size=2, stale_after=4.0, waited=heartbeat.last_wait)
    assert hang is not None and hang.line.endswith(f"rank 0 waited for it in {WAIT}"), hang


def test_a_live_rank_outside_torch_distributed_is_named_and_all_waiting_names_no_one() -> None:
    server = store()
    beat(server, 0, 0.1, WAIT)
    beat(server, 1, 0.1, "its own code at callbacks.py:7 (on_train_batch_start)")
    hang = read_hang(server, me=0, world_size=2, stale_after=4.0)
    assert hang is not None and (hang.rank, hang.stopped) == (1, False)
    assert hang.line == (
        f"rank 1 is alive but not in a collective: it is in its own code at callbacks.py:7 (on_train_batch_start); "
        f"rank 0 waited in {WAIT}"
    )
    beat(server, 1, 0.1, "a collective (all_reduce) called from base.py:80 (reduce)")
    assert read_hang(server, me=0, world_size=2, stale_after=4.0) is None
    assert read_hang(server, me=0, world_size=3, stale_after=4.0).line.startswith("rank 2 never sent a heartbeat")


def test_a_heartbeat_says_where_the_main_thread_is() -> None:
    server = store()
    began = time.time()
    heartbeat = Heartbeat(server, rank=0, interval=0.05).start()
    beats: dict = {}
    done = threading.Event()

    def read() -> None:
        """Until a beat written after this thread started (this test's thread is waiting below by then): on a loaded
        machine a fixed sleep could read start()'s own beat, or one taken while the test's thread was still in
        start()."""
        since = time.time()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            beats.update(read_beats(server, 1) or {})
            if beats and beats[0]["time"] > since:
                break
            time.sleep(0.05)
        done.set()

    reader = threading.Thread(target=read)
    try:
        reader.start()
        done.wait(120)  # this thread waits here while its beats are read
        reader.join()
    finally:
        heartbeat.stop()
    (mine,) = beats.values()
    assert mine["pid"] > 0 and mine["host"] == socket.gethostname() and began < mine["time"] < time.time()
    assert (
        mine["doing"].startswith("its own code at ")
        and "(test_a_heartbeat_says_where_the_main_thread_is)" in mine["doing"]
    )
    assert "test_heartbeat.py:" in mine["doing"]


def test_where_names_the_innermost_code_outside_the_libraries() -> None:
    started, release = threading.Event(), threading.Event()

    def sleeper() -> None:
        started.set()
        release.wait(5)

    thread = threading.Thread(target=sleeper)
    thread.start()
    started.wait(5)
    try:
        doing = where(sys._current_frames()[thread.ident])  # type: ignore[index]
    finally:
        release.set()
        thread.join()
    assert doing.startswith("its own code at ") and doing.endswith("(sleeper)"), doing
