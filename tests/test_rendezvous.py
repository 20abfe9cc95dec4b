"""The rendezvous store listens only on the main address: with MASTER_ADDR=127.0.0.1 nothing on the network can
reach it (torch's own TCPStore listens on every interface, IPv4 and IPv6). Under torchrun each attempt finds its own
store, never the previous attempt's."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from distributed import free_port, run_workers

from lightning_parallel.rendezvous import ATTEMPT_KEY, attempt_store, binds_exactly

LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


@pytest.mark.slow
def test_two_process_run_listens_on_loopback_only(tmp_path: Path) -> None:
    ranks = run_workers("listening", 2, {}, tmp_path)
    assert ranks[0]["listening"] == [LOOPBACK_HEX], ranks[0]  # one listener, on 127.0.0.1, none on * or ::


def test_host_names_keep_torchs_default_and_addresses_bind_exactly() -> None:
    assert binds_exactly("127.0.0.1") and binds_exactly("::1") and binds_exactly("10.1.2.3")
    assert binds_exactly("localhost") and not binds_exactly("node-0.cluster")


def test_a_restarted_attempt_passes_over_the_previous_attempts_store() -> None:
    """torchrun's store keeps the previous attempt's entry: a port nothing listens on any more, or a store that does
    not hold the published token, is passed over until this attempt's rank 0 publishes its own."""
    timeout = timedelta(seconds=20)
    agent = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timeout)  # torchrun's
    key = f"{ATTEMPT_KEY}/job/1"
    agent.set(key, f"{free_port()} {'0' * 16}")  # the previous attempt's rank 0 is gone
    found: list[dist.TCPStore] = []
    joiner = threading.Thread(
        target=lambda: found.append(
            attempt_store("127.0.0.1", agent.port, rank=1, world_size=2, timeout=timeout, run="job/1")
        )
    )
    joiner.start()
    time.sleep(0.5)
    foreign = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timeout)
    agent.set(key, f"{foreign.port} {'1' * 16}")  # a live store, but not with this token
    time.sleep(0.5)
    assert not found  # still waiting
    own = attempt_store("127.0.0.1", agent.port, rank=0, world_size=2, timeout=timeout, run="job/1")
    joiner.join(timeout=10)
    assert found and found[0].port == own.port != foreign.port
    found[0].set("hello", "from rank 1")
    assert own.get("hello") == b"from rank 1"
