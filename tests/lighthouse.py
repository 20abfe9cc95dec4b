"""torchft's lighthouse for the replica-group tests, started the way the README says (`torchft_lighthouse`), with quick
death detection for a short test. Skips the test when torchft is not installed; it does not start any group."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from distributed import free_port


@contextmanager
def started_lighthouse(min_replicas: int) -> Iterator[str]:
    """A lighthouse that forms a quorum once `min_replicas` groups have joined; yields its address."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install 'lightning_parallel[ft]'")
    # pip puts it beside this interpreter (a venv's bin/, which need not be on PATH)
    command = shutil.which("torchft_lighthouse", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if command is None:
        pytest.skip("torchft_lighthouse is not installed (it comes with torchft)")
    port = free_port()
    args = ["--bind", f"[::]:{port}", "--min_replicas", str(min_replicas), "--join_timeout_ms", "3000"]
    args += ["--heartbeat_timeout_ms", "2000", "--quorum_tick_ms", "50"]
    server = subprocess.Popen([command, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "torchft_lighthouse did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()
