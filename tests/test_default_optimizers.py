"""The optimizers users write, as CUDA runs them: Adam, AdamW and SGD with `foreach=True` (torch's default for CUDA
tensors) and `fused=True` train under every tensor and pipeline layout and match one process (losses and final weights
within 1e-5), with gradient clipping, accumulation and a per-step LR scheduler, and after a resume from a checkpoint
saved with such an optimizer.

Tensor-parallel layouts hold DTensor parameters (the layers a plan shards) beside plain ones (those it leaves whole),
which one foreach or fused kernel call refuses to mix; CPU runs neither unless asked, so these tests ask. Each layout
runs one foreach and one fused optimizer; across layouts each of Adam, AdamW and SGD runs both ways. The modules are
written the way users write them (`user_modules.TutorialOptimizers`: `self.model`, `self.criterion`, a plain
DataLoader under Lightning's default distributed sampler). dp x pp x tp on 8 processes is in test_three_d.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import WORKERS, run_workers

sys.path.insert(0, str(WORKERS))
sys.path.insert(0, str(Path(__file__).parent))
from user_modules import CLIP_ACCUMULATE, NETWORKS, TutorialOptimizers, fit  # noqa: E402

STEPS = 6  # optimizer steps: 12 batches of 16 = two epochs of the 96 samples
TOLERANCE = 1e-5
ADAM = {"lr": 1e-2}
SGD = {"lr": 0.1, "momentum": 0.9}
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adam_foreach": ("Adam", {**ADAM, "foreach": True}),
    "adam_fused": ("Adam", {**ADAM, "fused": True}),
    "adamw_foreach": ("AdamW", {**ADAM, "foreach": True}),
    "adamw_fused": ("AdamW", {**ADAM, "fused": True}),
    "sgd_foreach": ("SGD", {**SGD, "nesterov": True, "foreach": True}),
    "sgd_fused": ("SGD", {**SGD, "fused": True}),
}
PIPE = {"schedule": "1f1b", "microbatches": 4}


def layout(devices: int, strategy: str, net: str, optimizers: tuple[str, ...], **args: Any) -> list[dict[str, Any]]:
    replicas = args.get("data_parallel_size", 1)
    base = {"devices": devices, "strategy": strategy, "args": args, "net": net, "steps": STEPS}
    return [{**base, "optimizer": OPTIMIZERS[o], "batch_size": 16 // replicas, "name": o} for o in optimizers]


# layout name -> entries, grouped by process count (one launch each)
LAUNCHES: dict[int, dict[str, list[dict[str, Any]]]] = {
    1: {"tensor tp1": layout(1, "tensor", "tutorial_cnn", ("adamw_foreach", "sgd_fused"), tensor_parallel_size=1)},
    2: {
        "tensor tp2": layout(2, "tensor", "tutorial_cnn", ("adam_fused", "sgd_foreach"), tensor_parallel_size=2),
        "pipeline pp2": layout(2, "pipeline", "tutorial_cnn", ("adamw_fused", "sgd_fused"), **PIPE),
    },
    4: {
        "tensor tp4": layout(4, "tensor", "sequential_mlp", ("adam_foreach", "sgd_fused"), tensor_parallel_size=4),
        "tensor dp2 x tp2 (FSDP2)": layout(
            4, "tensor", "sequential_mlp", ("adamw_foreach", "adam_fused"), tensor_parallel_size=2, data_parallel_size=2
        ),
        "pipeline pp2 x tp2": [
            *layout(4, "pipeline", "sequential_mlp", ("sgd_foreach", "adamw_fused"), tensor_parallel_size=2, **PIPE),
            {
                **layout(4, "pipeline", "sequential_mlp", ("adamw_fused",), tensor_parallel_size=2, **PIPE)[0],
                "resume_at": 3,
            },
        ],
        "dp2 x pipeline pp2 (FSDP2)": layout(
            4,
            "pipeline",
            "sequential_mlp",
            ("adam_foreach", "sgd_fused"),
            data_parallel_size=2,
            replicas="fsdp",
            **PIPE,
        ),
    },
}
CASES = [
    (size, name, index) for size, layouts in LAUNCHES.items() for name in layouts for index in range(len(layouts[name]))
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(layout, entry) -> per-rank results; one launch per process count."""
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for size, layouts in LAUNCHES.items():
        keys = [(name, index) for name, entries in layouts.items() for index in range(len(entries))]
        payload = [layouts[name][index] for name, index in keys]
        per_rank = run_workers("default_optimizers", size, payload, tmp_path_factory.mktemp(f"optimizers{size}"))
        for position, key in enumerate(keys):
            results[key] = [rank[position] for rank in per_rank]
    return results


_references: dict[str, dict[str, Any]] = {}


def reference(net: str, optimizer: str) -> dict[str, Any]:
    """One process, the same module, optimizer, global batch and steps."""
    key = f"{net} {optimizer}"
    if key not in _references:
        torch.manual_seed(0)
        module = TutorialOptimizers(NETWORKS[net](), OPTIMIZERS[optimizer][0], **OPTIMIZERS[optimizer][1])
        _references[key] = fit(module, strategy="auto", devices=1, steps=STEPS, shuffle=False, **CLIP_ACCUMULATE)
    return _references[key]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("size", "name", "index"),
    CASES,
    ids=[
        f"{n} {LAUNCHES[s][n][i]['name']}{' resumed' if 'resume_at' in LAUNCHES[s][n][i] else ''}" for s, n, i in CASES
    ],
)
def test_matches_one_process(launched: dict, size: int, name: str, index: int) -> None:
    entry = LAUNCHES[size][name][index]
    ref = reference(entry["net"], entry["name"])
    results = launched[(name, index)]
    replicas = entry["args"].get("data_parallel_size", 1)
    losses = torch.tensor([r["losses"] for r in results]).reshape(replicas, len(results) // replicas, -1).mean(0)
    assert losses.shape[-1] == len(ref["losses"]) == STEPS * CLIP_ACCUMULATE["accumulate_grad_batches"]
    gap = (losses - torch.tensor(ref["losses"])).abs().max().item()
    assert gap < TOLERANCE, f"{name} {entry['name']}: losses differ by {gap:.2e}"
    held = set()
    for rank, result in enumerate(results):  # every rank's parameters, whole; replicas hold the same
        for key, value in result["state"].items():
            torch.testing.assert_close(value, ref["state"][key], rtol=0, atol=TOLERANCE, msg=f"rank {rank} {key}")
        held |= result["state"].keys()
    assert held == ref["state"].keys()


@pytest.mark.slow
def test_the_runs_trained_and_tensor_layouts_mixed_parameter_kinds(launched: dict) -> None:
    """Guards for the parity above: weights moved, and in each tensor layout some rank held DTensor and plain
    parameters (under the pipeline, the last stage: the first holds only sharded layers)."""
    torch.manual_seed(0)
    initial = dict(NETWORKS["sequential_mlp"]().named_parameters())
    trained = reference("sequential_mlp", "adamw_fused")["state"]
    assert max((trained[f"model.{k}"] - v).abs().max().item() for k, v in initial.items()) > 100 * TOLERANCE
    for name in ("tensor tp2", "tensor tp4", "pipeline pp2 x tp2"):
        assert max(rank["kinds"] for rank in launched[(name, 0)]) == 2, name
