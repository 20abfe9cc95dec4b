"""The rendezvous store of one run attempt, listening only where it was asked to.

torch's TCPStore on rank 0 listens on every interface (`*:<MASTER_PORT>`, IPv4 and IPv6) for the whole run, so
any host on the network can reach it. Here rank 0 binds the listening socket itself, to the main address, and
hands it to the TCPStore; `listen_address` decides where (or that torch's default stays).

Under torchrun (since torch 2.5) the workers are told to share the agent's store, which outlives every restart: a
restarted worker reads the previous attempt's addresses and fails (`Gloo connectFullMesh failed ... Connection
refused`; NCCL's unique id the same way: pytorch/pytorch#135712, #167288). `attempt_store` gives each attempt a store
of its own instead, found through the agent's. Torch only; which strategy uses it is not decided here.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

ATTEMPT_KEY = "lightning_parallel/attempt_store"  # in torchrun's store: "<port> <token>" of this attempt's own store
TOKEN_KEY = "lightning_parallel/token"  # in the attempt's store: the token published with its port
JOINED_KEY = "lightning_parallel/joined"  # in a store: how many ranks have reached it (`join`)
_groups_started = 0  # process groups this process has rendezvoused for: every worker counts the same


def binds_exactly(address: str) -> bool:
    """Whether the store can listen on `address` alone: a loopback name or a literal IP address. A host name
    may resolve differently on other nodes (e.g. to 127.0.1.1 locally), so it keeps torch's default."""
    if address == "localhost":
        return True
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def listen_address(main_address: str) -> str | None:
    """Where rank 0's store listens: exactly the main address it was given (MASTER_ADDR; on one machine a
    loopback address, across nodes an address of node 0 that the other nodes reach), never a loopback address of
    our choosing. None (torch's default: every interface) for a host name (`binds_exactly`)."""
    return main_address if binds_exactly(main_address) else None


def torchrun_shares_its_store(environ: Mapping[str, str] = os.environ) -> bool:
    """torchrun (c10d or static rendezvous, torch >= 2.5) hands its workers the agent's own store, unless it was
    started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (then MASTER_PORT is a fresh port per attempt)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def store_for(
    main_address: str,
    main_port: int,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta,
    environ: Mapping[str, str] = os.environ,
) -> dist.Store:
    """The store this attempt's process group rendezvouses on, once every rank has reached it (`join`): a store of the
    attempt's own under torchrun's shared one (`attempt_store`), otherwise rank 0's at MASTER_ADDR:MASTER_PORT
    (`bound_store`)."""
    global _groups_started
    _groups_started += 1
    if torchrun_shares_its_store(environ):
        # one entry per process group of the attempt (a sweep starts several, and an earlier one's store may live on)
        run = f"{environ.get('TORCHELASTIC_RUN_ID', '')}/{_groups_started}"
        store = attempt_store(main_address, main_port, rank=rank, world_size=world_size, timeout=timeout, run=run)
    else:
        store = bound_store(main_address, main_port, rank=rank, world_size=world_size, timeout=timeout)
    join(store, world_size)
    return store


def store_beside(
    store: dist.Store, address: str, *, key: str, rank: int, world_size: int, timeout: timedelta
) -> tuple[str, int]:
    """A new store at `address` (rank 0 hosts it on a free port), for a library that takes an address and a port
    and keeps keys of its own there (torchft's Manager): its port goes through `store` (this attempt's) under `key`,
    which each use names afresh, so no rank reads a previous attempt's or use's keys. Returns (address, port); the
    store lives as long as this process (rank 0 keeps serving it)."""
    if rank == 0:
        own = bound_store(address, 0, rank=0, world_size=world_size, timeout=timeout)
        _kept.append(own)
        store.set(key, str(own.port))
        return address, own.port
    return address, int(store.get(key).decode())


_kept: list[dist.TCPStore] = []  # stores served by this process for others (`store_beside`)


def join(store: dist.Store, world_size: int) -> None:
    """Wait, up to the store's timeout, until all `world_size` ranks have reached `store`: a process group's own
    rendezvous then waits only its (possibly short) collective timeout, and a rank still importing torch on a loaded
    machine does not make it fail."""
    if store.add(JOINED_KEY, 1) == world_size:
        store.set(f"{JOINED_KEY}/all", "1")
    store.wait([f"{JOINED_KEY}/all"])


def bound_store(address: str, port: int, *, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore whose server (rank 0) listens on `listen_address(address):port` only (port 0: a free one, then
    `store.port`); other ranks connect to it. The server does not wait for them: the process group does."""
    if rank != 0:
        return dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    if listen_address(address) is None:
        return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen(max(128, world_size))
    except OSError as error:
        listener.close()
        raise RuntimeError(
            f"cannot listen on {address}:{port} for the rendezvous ({error.strerror}). HINT: choose a free port "
            "with MASTER_PORT=<port>, or set MASTER_ADDR to an address of this machine"
        ) from None
    port = listener.getsockname()[1]
    # The store owns the descriptor from here on (detach: the Python socket must not close it).
    return dist.TCPStore(
        address,
        port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def attempt_store(
    address: str, agent_port: int, *, rank: int, world_size: int, timeout: timedelta, run: str = ""
) -> dist.TCPStore:
    """A store of this attempt's own: rank 0 hosts it on a free port of the main address and publishes the port and
    a fresh token in torchrun's store; the other ranks take it once that port answers with that token.

    The agent's store keeps the previous attempt's entry, and a restart count cannot tell attempts apart (each
    node's agent counts its own restarts). What can: all of an attempt's workers are gone before the next attempt
    starts, so a port that still answers with the token it was published with is this attempt's."""
    agent = dist.TCPStore(address, agent_port, world_size, is_master=False, timeout=timeout)
    key = f"{ATTEMPT_KEY}/{run}"
    if rank == 0:
        own = bound_store(address, 0, rank=0, world_size=world_size, timeout=timeout)
        token = secrets.token_hex(8)
        own.set(TOKEN_KEY, token)
        agent.set(key, f"{own.port} {token}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        port, token = agent.get(key).decode().split()
        found = current_store(address, int(port), token, world_size=world_size, timeout=timeout)
        if found is not None:
            return found
        time.sleep(0.2)  # the previous attempt's entry: rank 0 of this one has not published yet
    raise TimeoutError(
        f"rank {rank} found no rendezvous store of this attempt within {timeout.total_seconds():.0f} s (rank 0 never "
        "published one in torchrun's store). HINT: look for rank 0's own error; every rank must run the same command"
    )


def current_store(address: str, port: int, token: str, *, world_size: int, timeout: timedelta) -> dist.TCPStore | None:
    """A client of the store at `address:port` if it is up and holds `token`; None for a stale entry (nothing
    listens there any more, or another store does)."""
    try:  # a closed port refuses at once; a TCPStore client would retry it until its timeout
        socket.create_connection((address, port), timeout=5).close()
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        if store.check([TOKEN_KEY]) and store.get(TOKEN_KEY).decode() == token:
            return store
    except (OSError, dist.DistError):
        pass
    return None
