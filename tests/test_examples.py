"""The README's examples run as written: examples/drop_in.py, unchanged but for
`--strategy`, under the pipeline strategy on 2 CPU processes (its modules under tensor_parallel: test_drop_in)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "devices"), [("pipeline", 2)])  # tensor_parallel: test_drop_in
def test_drop_in_example_runs(strategy: str, devices: int, tmp_path: Path) -> None:
    command = [sys.executable, str(EXAMPLES / "drop_in.py"), "--strategy", strategy, "--devices", str(devices)]
    command += ["--epochs", "1", "--max-steps", "6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "val_acc 0." in done.stdout
