"""`make gpu-check` (benchmarks/gpu_check.py) in its smallest parts, so the GPU proof cannot rot where no GPU is: ranks
sharing one device match one process (the worker the check launches under torchrun: tp2, pp2, pp2 x tp2), every
strategy's one-device run and the report's rows, the mfu part's compiled fused-AdamW rows and their ratio, a part cut
off keeping the runs it finished, and the device list of the accelerator that puts several ranks on one GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning
import pytest
import torch
from conftest import ROOT
from distributed import run_workers

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_throughput  # noqa: E402
from gpu_check import (  # noqa: E402
    MFU_RUNS,
    NCCL,
    ONE_DEVICE,
    SIZES,
    check,
    mfu_summary,
    one_device_rows,
    planner_part,
    throughput_args,
)
from gpu_check_report import markdown, rank_row, status, summary_lines  # noqa: E402
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


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One process: the FLOP count and every one-device and mfu run of the toy GPT, compiled with dynamo's eager
    backend (what torch.compile captured, not inductor's code: its C++ build takes ~20 s a graph here)."""
    payload = {"runs": ["flops", *dict.fromkeys([*ONE_DEVICE, *MFU_RUNS])], "steps": STEPS, "compile_backend": "eager"}
    return run_workers("gpu_check_parts", 1, payload, tmp_path_factory.mktemp("toy_runs"), 180)[0]


def entries_of(runs: dict[str, dict], names: list[str]) -> list[dict]:
    return [{"workload": "gpt_toy", "run": name, "repeat": 0, "other_cores": 0.0, **runs[name]} for name in names]


def test_every_strategy_on_one_device_and_the_report(toy_runs: dict[str, dict]) -> None:
    sizes = SIZES["cpu"]
    facts, entries = {"gpt_toy": toy_runs["flops"]}, entries_of(toy_runs, ONE_DEVICE)
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


def test_the_mfu_part_compiles_with_fused_adamw_against_plain_lightning(toy_runs: dict[str, dict]) -> None:
    """Each mfu row ran what its name says (torch.compile's graphs, the AdamW kernel), the same maths as auto, and the
    report gives each row's MFU and the strategy's over plain Lightning compiled the same way."""
    sizes = SIZES["cpu"]
    mfu = {"facts": {"gpt_toy": toy_runs["flops"]}, "entries": entries_of(toy_runs, MFU_RUNS)}
    summary = mfu_summary(mfu, "cpu", sizes)
    rows = summary["gpt_toy"]["rows"]
    ran = {name: (r["compiled_graphs"] > 0, r["adamw"]) for name, r in rows.items()}
    assert ran == {"auto": (False, "default"), "auto_compiled_fused": (True, "fused"),
                   "tensor_compiled_fused": (True, "fused"), "raw_compiled": (True, "default")}  # fmt: skip
    assert rows["tensor_compiled_fused"]["compiled_graphs"] >= 2  # each block (depth 2), not the network whole
    for r in rows.values():
        assert r["loss"] == pytest.approx(rows["auto"]["loss"], abs=1e-5)
    steps = {name: r["step_ms"]["median"] for name, r in rows.items()}
    assert (
        rows["tensor_compiled_fused"]["vs_auto_compiled_fused"]
        == steps["auto_compiled_fused"] / steps["tensor_compiled_fused"]
    )
    config = {"device": "cpu", "machine": "test", "torch": torch.__version__, "cuda": None, "date": "-",
              "lightning": lightning.__version__, "sizes": sizes.__dict__, "nccl": NCCL, "wall_s": 1.0}  # fmt: skip
    report = {"config": config, "parts": {"mfu": {"date": "-", "wall_s": 1.0}}, "mfu": {**mfu, "summary": summary}}
    headline = next(line for line in summary_lines(report) if line.startswith("mfu gpt_toy (cpu): auto "))
    ratio = rows["tensor_compiled_fused"]["vs_auto_compiled_fused"]
    assert headline.endswith(f"| strategy / plain Lightning (MFU): {ratio:.3f}") and headline in markdown(report)
    assert "| `tensor_compiled_fused` | TensorParallelStrategy(tensor_parallel_size=1, compile=True), AdamW(fused=" in (
        markdown(report)
    )


def test_a_part_cut_off_keeps_the_runs_it_finished(
    toy_runs: dict[str, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The results are written after each run: a check killed in its third run (as the device tool's time limit
    does) leaves the first two on disk, its part marked cut off."""
    launched = []

    def launch(name: str, workload: str, args: object) -> dict:
        launched.append(name)
        if len([n for n in launched if n != "flops"]) == 3:
            raise SystemExit("killed")  # not an Exception: the check does not catch it, as it cannot catch a kill
        return {**toy_runs[name], "other_cores": 0.0}

    monkeypatch.setattr(gpu_throughput, "launch", launch)
    report = {"config": {"device": "cpu", "machine": "test", "torch": "-", "cuda": None, "lightning": "-",
                         "date": "-", "sizes": SIZES["cpu"].__dict__, "nccl": NCCL}}  # fmt: skip
    with pytest.raises(SystemExit):
        check(report, ["one_device"], SIZES["cpu"], 60, tmp_path)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [row["strategy"] for row in saved["runs"]] == ONE_DEVICE[:2] and all(row["ok"] for row in saved["runs"])
    assert saved["parts"]["one_device"]["error"].startswith("cut off")
    assert "one_device" in (tmp_path / "gpu_check.md").read_text().split("it broke: cut off")[0]


def test_the_shared_accelerator_puts_every_rank_on_cuda_0() -> None:
    """What Lightning asks the accelerator class (no CUDA needed): N devices, every one cuda:0."""
    assert SharedCUDAAccelerator.parse_devices(4) == SharedCUDAAccelerator.parse_devices([0, 0, 0, 0]) == 4
    assert SharedCUDAAccelerator.get_parallel_devices(2) == [torch.device("cuda", 0)] * 2
    with pytest.raises(ValueError, match="devices >= 1"):
        SharedCUDAAccelerator.parse_devices(0)
