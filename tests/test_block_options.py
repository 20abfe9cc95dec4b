"""Activation checkpointing and compile under the strategies: each layout with them matches one process without them
(losses and final weights within 1e-5, fp32), with gradient clipping, accumulation and an LR scheduler, and a
checkpoint saved by a compiled, checkpointed run resumes in an eager one. The set-up order puts them after sharding
and before replicas (`parallelize/order.py`). Per-block mechanics in one process: test_blocks.py.

Inductor compiles the 2-process layouts; the 4-process ones use `backend="aot_eager"` (TorchDynamo and AOTAutograd,
no code generation), since four ranks generating C++ on two cores would take minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_workers
from test_default_optimizers import OPTIMIZERS, STEPS, TOLERANCE, reference

sys.path.insert(0, str(Path(__file__).parent))

AOT_EAGER = {"backend": "aot_eager"}
PIPE = {"schedule": "1f1b", "microbatches": 4}


def entry(devices: int, strategy: str, optimizer: str, **args: Any) -> dict[str, Any]:
    replicas = args.get("data_parallel_size", 1)
    return {
        "devices": devices,
        "strategy": strategy,
        "args": args,
        "net": "sequential_mlp",
        "steps": STEPS,
        "optimizer": OPTIMIZERS[optimizer],
        "batch_size": 16 // replicas,
        "name": optimizer,
    }


# layout name -> entry, grouped by process count (one launch each)
LAUNCHES: dict[int, dict[str, dict[str, Any]]] = {
    2: {
        "tensor tp2, full, inductor": entry(
            2, "tensor", "adamw_foreach", tensor_parallel_size=2, activation_checkpointing="full", compile=True
        ),
        "pipeline pp2, selective, inductor; resumed eager": {
            **entry(2, "pipeline", "sgd_fused", activation_checkpointing="selective", compile=True, **PIPE),
            "resume_at": 3,
            "resume_args": PIPE,
        },
    },
    4: {
        "pipeline pp2 x tp2, full, aot_eager": entry(
            4,
            "pipeline",
            "adam_fused",
            tensor_parallel_size=2,
            activation_checkpointing="full",
            compile=AOT_EAGER,
            **PIPE,
        ),
        "tensor dp2 x tp2 (FSDP2), selective, aot_eager": entry(
            4,
            "tensor",
            "adamw_fused",
            tensor_parallel_size=2,
            data_parallel_size=2,
            activation_checkpointing="selective",
            compile=AOT_EAGER,
        ),
    },
}
CASES = [(size, name) for size, layouts in LAUNCHES.items() for name in layouts]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {}
    for size, layouts in LAUNCHES.items():
        per_rank = run_workers(
            "default_optimizers", size, list(layouts.values()), tmp_path_factory.mktemp(f"blocks{size}"), timeout=600
        )
        for position, name in enumerate(layouts):
            results[name] = [rank[position] for rank in per_rank]
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("size", "name"), CASES, ids=[name for _, name in CASES])
def test_matches_one_process_without_them(launched: dict, size: int, name: str) -> None:
    layout = LAUNCHES[size][name]
    ref = reference(layout["net"], layout["name"])
    results = launched[name]
    replicas = layout["args"].get("data_parallel_size", 1)
    losses = torch.tensor([r["losses"] for r in results]).reshape(replicas, len(results) // replicas, -1).mean(0)
    gap = (losses - torch.tensor(ref["losses"])).abs().max().item()
    assert gap < TOLERANCE, f"{name}: losses differ by {gap:.2e}"
    held = set()
    for rank, result in enumerate(results):
        for key, value in result["state"].items():
            torch.testing.assert_close(value, ref["state"][key], rtol=0, atol=TOLERANCE, msg=f"rank {rank} {key}")
        held |= result["state"].keys()
    assert held == ref["state"].keys()
    assert all(result["compiled_graphs"] > 0 for result in results)  # compiled, not silently eager
