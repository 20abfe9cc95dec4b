"""Shared test fixtures: compose the project's Hydra config the way train.py does, without a CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_script
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_parallel import seams

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Tests spawn several processes on a 2-core machine: one thread each keeps them from thrashing.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _environment_as_found() -> Iterator[None]:
    """Each test leaves os.environ as it found it: an in-process fit leaves PL_GLOBAL_SEED (which Lightning's DDP
    set-up reseeds from in every later fork) or a launched rank's LOCAL_RANK behind, making later tests order-bound."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def compose_cfg(tmp_path: Path) -> Callable[..., DictConfig]:
    """Compose `conf/train.yaml` with overrides; outputs go to the test's tmp_path."""

    def _compose(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=[f"paths.output_dir={tmp_path}", *overrides])

    return _compose


def run_cli(
    *args: str,
    cwd: Path,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    fresh: bool = False,
    fresh_ranks: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run train.py as a user would, in a scratch working directory. Its first process is forked from the tests'
    server, which imported torch, Lightning and the library once (tests/distributed.py: ~9 s of CPU less per
    launch), and the ranks it launches are forks of it (tests/forked_ranks.py: ~9 s each less); `fresh_ranks=True`
    launches them as new interpreters, as a user's run does (the failure tests, which watch the processes), and
    `fresh=True` also starts the first process as one, as `python train.py` does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    if not fresh:
        return run_script(ROOT / "train.py", list(args), cwd=cwd, env=env, timeout=timeout, fork_ranks=not fresh_ranks)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="session")
def single_and_ddp_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`train.py -m strategy=single,ddp trainer.devices=2` run once, tiny: its result and the directory it ran in.
    Shared by test_cli (the job directories) and test_sweep_report (the report of a real sweep), which each ran it."""
    cwd = tmp_path_factory.mktemp("single_and_ddp_sweep")
    tiny = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "callbacks=none"]
    return run_cli("-m", "strategy=single,ddp", "trainer.devices=2", "trainer.accelerator=cpu", *tiny, cwd=cwd), cwd


@contextmanager
def fake_world(size: int) -> Iterator[None]:
    """A process group of `size` ranks inside this process (torch's fake backend): DTensor shards without peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# Integer tensors crossing stages and tensor parallelism inside traced stages need torch >= 2.13
# (`seams.NEEDS_TORCH`); older torch refuses them in one line (test_older_torch_refuses_in_one_line).
needs_torch_2_13 = pytest.mark.skipif(not seams.torch_at_least((2, 13)), reason="needs torch >= 2.13")
