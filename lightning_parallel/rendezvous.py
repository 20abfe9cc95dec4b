"""The rendezvous store, listening only where it was asked to.

torch's TCPStore on rank 0 listens on every interface (`*:<MASTER_PORT>`, IPv4 and IPv6) for the whole run, so
any host on the network can reach it. Here rank 0 binds the listening socket itself, to the main address, and
hands it to the TCPStore; `listen_address` decides where (or that torch's default stays). Torch only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist


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


def listen_address(main_address: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where rank 0's store listens: exactly the main address it was given (MASTER_ADDR; on one machine a
    loopback address, across nodes an address of node 0 that the other nodes reach), never a loopback address of
    our choosing. None where the store is not ours to place: torchrun's agent already hosts one
    (TORCHELASTIC_USE_AGENT_STORE), or the address is a host name (`binds_exactly`)."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not binds_exactly(main_address):
        return None
    return main_address


def bound_store(address: str, port: int, *, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore whose server (rank 0) listens on `address:port` only; other ranks connect to it."""
    if rank != 0:
        return dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
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
    # The store owns the descriptor from here on (detach: the Python socket must not close it).
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach())
