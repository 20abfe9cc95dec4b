"""`make gpu-check` (benchmarks/gpu_check.py) in its smallest parts, so the GPU proof cannot rot where no GPU is: ranks
sharing one device match one process (the worker the check launches under torchrun: tp2, pp2, pp2 x tp2), every
strategy's one-device run and the report's rows, and the device list of the accelerator that puts several ranks on
one GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning
import pytest
import torch
from conftest import ROOT
from distributed import run_workers

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check import (  # noqa: E402
    NCCL,
    ONE_DEVICE,
    SIZES,
    one_device_rows,
    planner_part,
    rank_row,
    status,
    throughput_args,
)
from gpu_check_report import markdown, summary_lines  # noqa: E402
from gpu_throughput import summarise  # noqa: E402
from shared_device import fit, read_rank  # noqa: E402

from lightning_parallel import SharedCUDAAccelerator  # noqa: E402

STEPS = 3


def test_ranks_sharing_a_device_match_one_process(tmp_path: Path) -> None:
    """tp2 and pp2 in one launch of 2 ranks, pp2 x tp2 on 4, over gloo_host staging every tensor as on CUDA (and with
    no gloo past the staging: an op torch sent past it would fail here too)."""
    reference = fit("one", "cpu", STEPS)
    for processes, layouts in ((2, ["tp2", "pp2"]), (4, ["pp2 x tp2"])):
        run_workers("gpu_check_parts", processes, {"layouts": layouts, "steps": STEPS}, tmp_path, timeout=180)
        for layout in layouts:
            ranks = [read_rank(tmp_path / layout / f"rank{r}.json") for r in range(processes)]
            row = rank_row(layout, processes, "cpu", ranks, reference)
            assert row["ok"], row["status"]
            assert row["parity"]["within"], (layout, row["parity"])  # 1e-5 on CPU
            assert row["losses"] == ranks[-1]["losses"] and len(row["losses"]) == STEPS


def test_every_strategy_on_one_device_and_the_report(tmp_path: Path) -> None:
    sizes = SIZES["cpu"]
    runs = run_workers("gpu_check_parts", 1, {"runs": ["flops", *ONE_DEVICE], "steps": STEPS}, tmp_path, 180)[0]
    facts = {"gpt_toy": runs.pop("flops")}
    entries = [{"workload": "gpt_toy", "run": name, "repeat": 0, "other_cores": 0.0, **r} for name, r in runs.items()]
    one_device = {"facts": facts, "entries": entries}
    rows = one_device_rows(one_device, "cpu", sizes)
    assert [row["strategy"] for row in rows] == ONE_DEVICE and all(row["ok"] for row in rows), rows
    assert all(row["losses"] == rows[0]["losses"] for row in rows)  # degree 1: the same maths as auto, exactly
    failed = rank_row("pp2", 2, "cpu", "RuntimeError: gloo cannot send CUDA tensors", None)
    refused = status("ValueError: integer tensors between pipeline stages needs torch >= 2.13, installed 2.11.0")
    assert (failed["ok"], failed["status"], refused) == (False, "failed: RuntimeError: gloo cannot send CUDA tensors",
                                                         "refused: needs torch >= 2.13")  # fmt: skip

    throughput = summarise(entries, facts, throughput_args("cpu", sizes, "gpt_toy", ONE_DEVICE))
    config = {"device": "cpu", "machine": "test", "torch": torch.__version__, "cuda": None, "date": "-",
              "lightning": lightning.__version__, "sizes": sizes.__dict__, "nccl": NCCL, "wall_s": 1.0}  # fmt: skip
    report = {"config": config, "parts": {"one_device": {"date": "-", "wall_s": 1.0}}, "runs": [*rows, failed],
              "throughput": throughput, "planner": planner_part(throughput, "cpu", sizes)}  # fmt: skip
    text = markdown(report)
    for name in ONE_DEVICE:
        assert f"| `{name}` | 1 | cpu | yes | ok |" in text
    assert "| `pp2` | 2 | cpu x2 (gloo_host) | NO | failed: RuntimeError" in text and NCCL in text
    assert report["planner"][0]["predicted_s"] > 0 and report["planner"][0]["measured_s"]["auto"] > 0
    assert "NCCL untested" in "\n".join(summary_lines(report))


def test_the_shared_accelerator_puts_every_rank_on_cuda_0() -> None:
    """What Lightning asks the accelerator class (no CUDA needed): N devices, every one cuda:0."""
    assert SharedCUDAAccelerator.parse_devices(4) == SharedCUDAAccelerator.parse_devices([0, 0, 0, 0]) == 4
    assert SharedCUDAAccelerator.get_parallel_devices(2) == [torch.device("cuda", 0)] * 2
    with pytest.raises(ValueError, match="devices >= 1"):
        SharedCUDAAccelerator.parse_devices(0)
