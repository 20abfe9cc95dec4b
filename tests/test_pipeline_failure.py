"""A rank that raises or hangs brings every rank down within seconds: the original error is shown
once, the run exits non-zero, and no process is left behind. The raising rank is one of 8 in a dp2 x pp2 x tp2 run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cli
from distributed import WORKERS

RUN = [
    "strategy=pipeline",
    "trainer.devices=2",
    "trainer.accelerator=cpu",
    "trainer.max_epochs=1",
    "callbacks=none",
    "logger=csv",
]


# 8 processes: 2 replicas x 2 stages x 2 tensor ranks; rank 5 is replica 1, stage 0, tensor rank 1
THREE_D = ["trainer.devices=8", "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=2"]


def fail(
    tmp_path: Path, mode: str, *extra: str, rank: int = 1, fresh_ranks: bool = True
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run with one rank failing at step 2; the result, and the seconds from that failure to the CLI's exit. The
    ranks are fresh interpreters as in a user's run, or with `fresh_ranks=False` forks running the same command line
    (tests/forked_ranks.py: ~9 s of CPU less each)."""
    inject = f"+callbacks.fail={{_target_:failing.FailAt,rank:{rank},step:2,mode:{mode}}}"
    result = run_cli(
        *RUN,
        inject,
        *extra,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        # a guard against a run that never ends, not a bound on speed (the seconds after the failure are): the 8-rank
        # test took 119 s in all beside a CPU hog (load 21, the fork server's start included) when this was 120 s;
        # below the default collective timeout (300 s), so a run whose peers wait that long still fails here
        timeout=240,
        env={"PYTHONPATH": str(WORKERS)},
        fresh_ranks=fresh_ranks,
    )
    seconds = time.time() - float((tmp_path / "failed_at").read_text())  # start-up time left out
    print(f"{mode}: the run ended {seconds:.1f} s after the failure")
    return result, seconds


def leftovers(tmp_path: Path, wait: float = 30) -> str:
    """Processes left of the run: by their command line (a fresh rank's names the run directory) or their working
    directory (every rank's, forked ones included, is the test's). Looked for until none is found or `wait` seconds
    have passed: a killed rank may take a moment to be gone on a loaded machine, one left running stays."""
    deadline = time.monotonic() + wait
    while True:
        found = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if proc.name.isdigit() and Path(os.readlink(proc / "cwd")).is_relative_to(tmp_path):
                    found += f"{proc.name} (working directory {tmp_path})\n"
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.slow
def test_one_of_eight_ranks_that_raises_stops_the_run(tmp_path: Path) -> None:
    result, seconds = fail(tmp_path, "raise", *THREE_D, rank=5, fresh_ranks=False)
    assert result.returncode != 0
    assert result.stderr.count("RuntimeError: injected failure on rank 5") == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: rank 5 failed: RuntimeError: injected failure on rank 5"), errors
    assert "Traceback" not in result.stderr  # the traces are in the run directory, one file per rank
    assert "injected failure" in (tmp_path / "run" / "rank5.log").read_text()
    assert seconds < 20, f"took {seconds:.0f} s after the failure"
    assert not leftovers(tmp_path)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_a_rank_that_hangs_times_out(tmp_path: Path) -> None:
    result, seconds = fail(tmp_path, "hang", "strategy.timeout=5")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: rank 1 is alive but not in a collective: it is in its own code at "), errors
    assert "failing.py" in errors[0] and "rank 0 waited in a pipeline send/recv" in errors[0]  # from the heartbeats
    assert seconds < 40, f"took {seconds:.0f} s after the hang began (timeout 5 s)"
    assert not leftovers(tmp_path)


@pytest.mark.slow
def test_a_rank_killed_from_outside_is_named_first(tmp_path: Path) -> None:
    result, seconds = fail(tmp_path, "kill")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0] == (
        "error: rank 1 died first: it was killed by SIGKILL from outside, e.g. the out-of-memory killer; "
        "it printed no error"
    ), result.stderr[-3000:]
    assert errors[1].startswith("error: rank 0 stopped after the failure above (traceback: ")
    assert len(result.stderr.splitlines()) < 40 and seconds < 40
    assert not leftovers(tmp_path)
