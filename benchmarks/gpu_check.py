"""`make gpu-check`: the GPU proof in one command. In order: `pytest -m gpu`; every strategy on one device with the CUDA
defaults (bf16-mixed, torch's default AdamW) against Lightning's `strategy="auto"`; tensor tp2, pipeline pp2 and
pp2 x tp2 as 2 or 4 ranks sharing the one device (gloo_host), each against one process; gpu_throughput.py's rows
(eager and compiled, MFU, degree-1 ratios); the planner's preset against them. Writes results/gpu_check.{json,md}.

Without CUDA it rehearses the same sequence on CPU at toy sizes (`device: cpu`). Each run is its own process and a
failed run is a row saying why, never the end of the check. Usage: python benchmarks/gpu_check.py [--parts ...]
(a part run alone merges into the existing results of the same device: the device tool allows 10 minutes a command).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import torch
from gpu_check_pytest import pytest_part
from gpu_check_report import markdown, summary_lines
from gpu_throughput import measure, summarise
from harness import RESULTS, error_line, machine, write_results
from shared_device import LAYOUTS, TOLERANCE, parity, run_layout
from throughput_runs import RUNS, WORKLOADS

from lightning_parallel.planner import CostModel, Layout, workload_from_module
from lightning_parallel.planner.presets import hardware_preset

PARTS = ("pytest", "one_device", "multi_rank", "throughput", "planner")
# Every strategy at degree 1 on one device, against Lightning's auto (rows of throughput_runs.RUNS).
ONE_DEVICE = ["auto", "ddp", "tensor", "pipeline", "three_d", "local_sgd", "diloco", "async_sgd"]
IMAGE_RUNS = ["raw", "raw_compiled", "auto", "tensor"]  # the ResNet's throughput rows (the GPT gets every row)
NCCL = (
    "NCCL itself stays untested: one GPU is the most a machine here has and NCCL refuses two ranks on one device, "
    "so the multi-rank rows share the device over gloo_host (gloo, every tensor staged through host memory: the CUDA "
    "code of each path runs, NCCL's collectives do not)."
)


@dataclass(frozen=True)
class Sizes:
    """What the check runs on a device kind: the throughput size and its two workloads (the GPT first: the
    one-device runs use it), measured steps after warm-up steps per run, parity steps, the planner's preset."""

    size: str
    workloads: tuple[str, str]
    steps: int
    warmup: int
    parity_steps: int
    preset: str


SIZES = {
    "cuda": Sizes("gpu", ("gpt2_small", "resnet50"), steps=20, warmup=5, parity_steps=8, preset="h100"),
    "cpu": Sizes("toy", ("gpt_toy", "resnet18_toy"), steps=3, warmup=1, parity_steps=4, preset="cpu"),
}


def nccl_version() -> str | None:
    """The NCCL torch bundles ("2.29.7"; the issue asks for it: 2.30 lets ranks share a GPU), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    found = torch.cuda.nccl.version()
    return ".".join(map(str, found)) if isinstance(found, tuple) else str(found)


def status(error: str | None) -> str:
    """Status "ok", "refused: needs torch >= X" (seams.NEEDS_TORCH on an older torch) or "failed: <the one line>"."""
    if error is None:
        return "ok"
    needs = re.search(r"needs torch >= (\d+\.\d+)", error)
    return f"refused: needs torch >= {needs.group(1)}" if needs else f"failed: {error}"


# ---- parts -----------------------------------------------------------------------------------------------------
def throughput_args(
    device: str, sizes: Sizes, workload: str, runs: list[str], timeout: float = 0
) -> argparse.Namespace:
    """What gpu_throughput.py's measure and summarise read: one workload, the runs that apply on this device."""
    precision = "bf16-mixed" if device == "cuda" else "32-true"
    applies = [name for name in runs if device == "cuda" or not RUNS[name].cuda_only]
    return argparse.Namespace(device=device, size=sizes.size, precision=precision, workloads=[workload], runs=applies,
                              steps=sizes.steps, warmup=sizes.warmup, repeats=1, timeout=timeout)  # fmt: skip


def one_device_part(device: str, sizes: Sizes, timeout: float) -> dict[str, Any]:
    """Every strategy at degree 1 on the GPT, each run its own process: gpu_throughput.py's entries."""
    args = throughput_args(device, sizes, sizes.workloads[0], ONE_DEVICE, timeout)
    facts, entries = measure(args)
    return {"facts": facts, "entries": entries}


def one_device_rows(one_device: dict[str, Any], device: str, sizes: Sizes) -> list[dict[str, Any]]:
    """One row per strategy of the one-device part: status, losses, step, its ratio to auto's, peak memory."""
    workload = sizes.workloads[0]
    args = throughput_args(device, sizes, workload, ONE_DEVICE)
    rows = summarise(one_device["entries"], one_device["facts"], args)[workload]["rows"]
    name = one_device["facts"][workload].get("device_name", device)
    auto = rows["auto"].get("loss")
    return [
        {
            "part": "one_device",
            "strategy": run,
            "devices": 1,
            "device": name,
            "ok": "step_ms" in r,
            "status": status(r["errors"][0] if r["errors"] else None),
            "losses": r.get("loss"),
            "step_ms": r["step_ms"]["median"] if "step_ms" in r else None,
            "vs_auto": r.get("wall_vs_auto"),
            "peak_memory_mib": r.get("peak_memory_mib"),
            "max_loss_gap_vs_auto": max(abs(a - b) for a, b in zip(r["loss"], auto, strict=True))
            if auto and r.get("loss")
            else None,
        }
        for run, r in rows.items()
    ]


def multi_rank_part(device: str, sizes: Sizes, timeout: float) -> list[dict[str, Any]]:
    """The one-process reference, then each layout on ranks sharing the device, with its parity to the reference."""
    reference = run_layout("one", device, sizes.parity_steps, timeout)
    rows = [rank_row("auto (one process: the parity reference)", 1, device, reference, None)]
    usable = reference[0] if isinstance(reference, list) and "error" not in reference[0] else None
    for layout, (processes, _) in LAYOUTS.items():
        print(f"multi-rank {layout} on {processes} ranks ...", flush=True)
        rows.append(
            rank_row(layout, processes, device, run_layout(layout, device, sizes.parity_steps, timeout), usable)
        )
        print(f"  {rows[-1]['status']}", flush=True)
    return rows


def rank_row(
    layout: str, processes: int, device: str, ranks: list[dict[str, Any]] | str, reference: dict[str, Any] | None
) -> dict[str, Any]:
    """A runs-table row of a layout (or of the one-process reference): status, rank 0's losses, the slowest rank's
    median step after the first, the largest peak memory, and the parity to the reference."""
    shared = f"{'cuda:0' if device == 'cuda' else 'cpu'} x{processes}" + (" (gloo_host)" if processes > 1 else "")
    row: dict[str, Any] = {"part": "multi_rank", "strategy": layout, "devices": processes, "device": shared}
    error = ranks if isinstance(ranks, str) else next((r["error"] for r in ranks if "error" in r), None)
    row |= {"ok": error is None, "status": status(error)}
    if error is not None:
        return row
    assert not isinstance(ranks, str)
    steps = [max(times) for times in zip(*(r["step_s"] for r in ranks), strict=True)][1:]  # slowest rank, after one
    row |= {
        "losses": ranks[0]["losses"],
        "step_ms": statistics.median(steps) * 1e3 if steps else None,
        "peak_memory_mib": max(r["peak_memory_mib"] for r in ranks),
    }
    if reference is not None and processes > 1:
        found = parity(ranks, reference)
        tolerance = TOLERANCE
        within = max(found["max_loss_diff"], found["max_param_diff"]) <= tolerance and not found["missing_parameters"]
        row["parity"] = {**found, "tolerance": tolerance, "within": within}
    return row


def throughput_part(device: str, sizes: Sizes, one_device: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    """gpu_throughput.py's rows for both workloads; the GPT's strategy rows are the one-device part's when it ran."""
    gpt, image = sizes.workloads
    every = [name for name in RUNS if device == "cuda" or not RUNS[name].cuda_only]
    out = {}
    for workload, runs in ((gpt, every), (image, IMAGE_RUNS)):
        reuse = one_device if workload == gpt and one_device else None
        args = throughput_args(device, sizes, workload, [r for r in runs if not reuse or r not in ONE_DEVICE], timeout)
        facts, entries = measure(args)
        if reuse:
            facts, entries = reuse["facts"], [*reuse["entries"], *entries]
        args.runs = [name for name in RUNS if name in runs and (device == "cuda" or not RUNS[name].cuda_only)]
        out |= summarise(entries, facts, args)
    return out


def planner_part(throughput: dict[str, Any], device: str, sizes: Sizes) -> list[dict[str, Any]]:
    """The preset's predicted step for each workload on one device against the measured ones (auto, raw, compiled),
    and the efficiency at which the prediction would equal auto's measured step."""
    hardware = hardware_preset(sizes.preset)
    precision = "bf16-mixed" if device == "cuda" else "32-true"
    rows = []
    for name, part in throughput.items():
        workload = WORKLOADS[sizes.size][name]
        torch.manual_seed(0)
        sample = workload.batches()[0][0][:2]
        estimate = CostModel(workload_from_module(workload.build(), sample), hardware, precision=precision).estimate(
            Layout(dp=1), batch=workload.batch
        )
        measured = {run: r["step_ms"]["median"] / 1e3 for run, r in part["rows"].items() if "step_ms" in r}
        row: dict[str, Any] = {
            "workload": name,
            "preset": sizes.preset,
            "precision": precision,
            "preset_efficiency": hardware.efficiency,
            "predicted_s": estimate.step_time,
            "breakdown_s": estimate.time,
            "predicted_memory_mib": estimate.memory["total"] / 2**20,
            "measured_s": {run: measured.get(run) for run in ("auto", "raw", "raw_compiled")},
            "measured_peak_memory_mib": part["rows"]["auto"].get("peak_memory_mib"),
        }
        auto = measured.get("auto")
        if auto:
            rest = estimate.step_time - estimate.time["compute"]
            row["predicted_vs_auto"] = estimate.step_time / auto
            row["efficiency_matching_auto"] = (
                hardware.efficiency * estimate.time["compute"] / (auto - rest) if auto > rest else None
            )
        rows.append(row)
    return rows


# ---- the check ----------------------------------------------------------------------------------------------------
def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="default: all, in order")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before one run's processes are killed")
    parser.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)  # tests write elsewhere
    return parser.parse_args()


def earlier(results: Path, device: str) -> dict[str, Any]:
    """What an earlier check on the same kind of device wrote (a part run alone keeps the others)."""
    path = results / "gpu_check.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    return report if report.get("config", {}).get("device") == device else {}


def run_part(part: str, report: dict[str, Any], sizes: Sizes, timeout: float) -> None:
    """One part, its result in `report` under its name. The throughput part reuses this invocation's one-device runs;
    the planner reads the throughput rows, of this invocation or an earlier one on the same device."""
    device = report["config"]["device"]
    if part == "pytest":
        report["pytest"] = pytest_part(timeout)
    elif part == "one_device":
        report["one_device"] = one_device_part(device, sizes, timeout)
        report["fresh_one_device"] = report["one_device"]  # not saved: the throughput part of this invocation reuses it
    elif part == "multi_rank":
        report["multi_rank"] = multi_rank_part(device, sizes, timeout)
    elif part == "throughput":
        report["throughput"] = throughput_part(device, sizes, report.get("fresh_one_device"), timeout)
    else:
        report["planner"] = planner_part(report["throughput"], device, sizes) if "throughput" in report else []


def save(report: dict[str, Any], sizes: Sizes, results: Path, started: float) -> None:
    """Write results/gpu_check.{json,md} as they stand: after every part, so a check stopped midway keeps what ran."""
    device = report["config"]["device"]
    one = one_device_rows(report["one_device"], device, sizes) if "one_device" in report else []
    report["runs"] = [*one, *report.get("multi_rank", [])]
    report["config"]["wall_s"] = time.perf_counter() - started
    saved = {key: value for key, value in report.items() if key != "fresh_one_device"}
    write_results("gpu_check", saved, markdown(saved), results=results, show=False)


def main() -> None:
    args = arguments()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        print(f"CUDA device {torch.cuda.get_device_name()}: the GPU check ({', '.join(args.parts)})", flush=True)
    else:
        print("No CUDA device here: rehearsing the GPU check on CPU at toy sizes (results say device: cpu)", flush=True)
    sizes, started = SIZES[device], time.perf_counter()
    report = earlier(args.results, device)
    report["config"] = {"device": device, "machine": machine(), "torch": torch.__version__, "cuda": torch.version.cuda,
                        "lightning": lightning.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                        "sizes": sizes.__dict__, "nccl": NCCL, "nccl_version": nccl_version()}  # fmt: skip
    report.setdefault("parts", {})
    for part in (p for p in PARTS if p in args.parts):
        began = time.perf_counter()
        print(f"== {part}", flush=True)
        try:
            run_part(part, report, sizes, args.timeout)
            outcome = {}
        except Exception as error:  # a part that broke is a line of the report; the next part still runs
            traceback.print_exc()
            outcome = {"error": error_line(error)}
        report["parts"][part] = {"date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": time.perf_counter() - began}
        report["parts"][part] |= outcome
        save(report, sizes, args.results, started)
    print("\n".join(summary_lines(report)))


if __name__ == "__main__":
    main()
