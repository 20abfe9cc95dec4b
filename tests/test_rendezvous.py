"""The rendezvous store listens only on the main address: with MASTER_ADDR=127.0.0.1 nothing on the network can
reach it (torch's own TCPStore listens on every interface, IPv4 and IPv6)."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_workers

from lightning_parallel.rendezvous import binds_exactly

LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


@pytest.mark.slow
def test_two_process_run_listens_on_loopback_only(tmp_path: Path) -> None:
    ranks = run_workers("listening", 2, {}, tmp_path)
    assert ranks[0]["listening"] == [LOOPBACK_HEX], ranks[0]  # one listener, on 127.0.0.1, none on * or ::


def test_host_names_keep_torchs_default_and_addresses_bind_exactly() -> None:
    assert binds_exactly("127.0.0.1") and binds_exactly("::1") and binds_exactly("10.1.2.3")
    assert binds_exactly("localhost") and not binds_exactly("node-0.cluster")
