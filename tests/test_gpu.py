"""On CUDA (`pytest -m gpu`; skipped where there is none, as in CI, where only the worker's own CPU check runs):
every strategy trains on one device with bf16-mixed and torch's default AdamW (the foreach kernel on CUDA tensors) and
tracks Lightning's own single-device run where the maths is the same; `train.py trainer=gpu` runs with each strategy;
with 2+ devices the optimizer layouts of test_default_optimizers.py run on nccl. The nccl paths a one-GPU machine
cannot run are listed in the README as untested."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from distributed import WORKERS, run_workers

sys.path.insert(0, str(WORKERS))

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 6
# Degree 1 of each: the same maths as one device (no DTensor at tp=1, no schedule or micro-batches at pp=1).
SAME_MATHS = ["tensor", "pipeline", "ddp", "local_sgd", "diloco", "async_sgd"]
DDP_FAMILY = {"ddp", "local_sgd", "diloco", "async_sgd"}


def test_the_one_device_worker_itself_runs_on_cpu(tmp_path: Path) -> None:
    """CI has no GPU: this keeps the GPU tests' worker from rotting unseen (two steps, fp32). At degree 1 every
    strategy runs the same maths as one device, exactly, and adds nothing to the step: no DTensor, no DDP wrapper,
    no parameter server or averaging (the summary's `collectives` is false)."""
    names = ("auto", *SAME_MATHS)
    configs = [{"strategy": name, "precision": "32-true", "steps": 2, "accelerator": "cpu"} for name in names]
    auto, *others = run_workers("gpu_one_device", 1, configs, tmp_path, timeout=300)[0]
    assert auto["moved"] > 0, auto.get("error")
    for name, run in zip(names[1:], others, strict=True):
        assert run["losses"] == auto["losses"], (name, run.get("error"))
        assert run["dtensors"] == 0  # no one-rank DTensor dispatch in the step
        assert not run["ddp_wrapped"], name  # no all-reduce of every gradient with itself
        if name in DDP_FAMILY:  # summary.json says so; async SGD starts no parameter server
            assert run["parallel"]["collectives"] is False and "server" not in run["parallel"], name


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    names = ["auto", *SAME_MATHS]
    configs = [{"strategy": name, "precision": "bf16-mixed", "steps": STEPS} for name in names]
    results = run_workers("gpu_one_device", 1, configs, tmp_path_factory.mktemp("gpu"), timeout=600)[0]
    return dict(zip(names, results, strict=True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", SAME_MATHS)
def test_each_strategy_trains_on_one_gpu_like_lightnings_own(one_device: dict[str, dict[str, Any]], name: str) -> None:
    auto, run = one_device["auto"], one_device[name]
    assert "error" not in run, run["error"]
    assert "error" not in auto, auto["error"]
    gaps = [abs(a - b) for a, b in zip(run["losses"], auto["losses"], strict=True)]
    assert max(gaps) < 1e-2 * max(1.0, max(auto["losses"])), (name, gaps)  # bf16 kernels may differ: tracked
    assert all(math.isfinite(loss) for loss in run["losses"]) and run["moved"] > 0  # it stepped
    assert run["dtensors"] == 0  # degree 1 is plain


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "strategy", ["single", "ddp", "fsdp", "pipeline", "tensor", "local_sgd", "diloco", "async_sgd"]
)
def test_train_py_on_one_gpu(tmp_path: Path, strategy: str) -> None:
    run_dir = tmp_path / "run"
    args = ["trainer=gpu", f"strategy={strategy}", "trainer.devices=1", "trainer.max_steps=10", "callbacks=none"]
    result = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 10


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl takes one device per rank: needs 2+ CUDA devices")
def test_optimizer_layouts_on_nccl(tmp_path: Path) -> None:
    """The CPU optimizer layouts that fit the devices, on nccl with CUDA's default kernels, against one GPU."""
    from test_default_optimizers import LAUNCHES

    sizes = [size for size in LAUNCHES if 1 < size <= torch.cuda.device_count()]
    for size in sizes:
        entries = [{**entry, "accelerator": "gpu"} for entries in LAUNCHES[size].values() for entry in entries]
        per_rank = run_workers("default_optimizers", size, entries, tmp_path / f"nccl{size}", timeout=600)
        references = run_workers(
            "default_optimizers",
            1,
            [{**e, "devices": 1, "strategy": "auto", "args": {}, "batch_size": 16} for e in entries],
            tmp_path / f"one{size}",
            timeout=600,
        )[0]
        for index, entry in enumerate(entries):
            losses = torch.tensor([rank[index]["losses"] for rank in per_rank]).mean(0)
            gap = (losses - torch.tensor(references[index]["losses"])).abs().max().item()
            assert gap < 1e-3, f"{entry['name']} on {size} GPUs: losses differ by {gap:.2e}"
