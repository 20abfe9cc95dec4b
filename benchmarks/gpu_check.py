"""`make gpu-check`: the GPU proof in one command. In order: `pytest -m gpu`; every strategy on one device with the CUDA
defaults (bf16-mixed, torch's default AdamW) against Lightning's `strategy="auto"`; tensor tp2, pipeline pp2 and
pp2 x tp2 as 2 or 4 ranks sharing the one device (gloo_host), each against one process; `mfu`: GPT-2 small's MFU
through the tensor strategy against plain Lightning, both compiled with fused AdamW; gpu_throughput.py's rows (eager and
compiled, MFU, degree-1 ratios); the planner's preset against them. Writes results/gpu_check.{json,md} after each run.

Without CUDA it rehearses the same sequence on CPU at toy sizes (`device: cpu`). Each run is its own process and a
failed run is a row saying why, never the end of the check. Usage: python benchmarks/gpu_check.py [--parts ...]
(a part run alone merges into the existing results of the same device: the device tool allows 10 minutes a command).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning
import torch
from gpu_check_pytest import pytest_part
from gpu_check_report import markdown, rank_row, status, summary_lines
from gpu_throughput import measure, summarise
from harness import RESULTS, error_line, machine, write_results
from shared_device import LAYOUTS, run_layout
from throughput_runs import RUNS, WORKLOADS

from lightning_parallel.planner import CostModel, Layout, workload_from_module
from lightning_parallel.planner.presets import hardware_preset

PARTS = ("pytest", "one_device", "multi_rank", "mfu", "throughput", "planner")
# Every strategy at degree 1 on one device, against Lightning's auto (rows of throughput_runs.RUNS).
ONE_DEVICE = ["auto", "ddp", "tensor", "pipeline", "three_d", "local_sgd", "diloco", "async_sgd"]
# The MFU of this library's strategy against plain Lightning, both compiled with fused AdamW (and the references).
MFU_RUNS = ["auto", "auto_compiled_fused", "tensor_compiled_fused", "raw_compiled"]
MFU_RUN_TIMEOUT = 150  # s per CUDA run (H100: ~25 s, a compiled first step 2-10.5 s): a hung compile leaves the rest
IMAGE_RUNS = ["raw", "raw_compiled", "auto", "tensor"]  # the ResNet's throughput rows (the GPT gets every row)
Keep = Callable[[dict[str, Any], list[dict[str, Any]]], None]  # gpu_throughput.measure's after_each: save so far
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


# ---- parts -----------------------------------------------------------------------------------------------------
def throughput_args(
    device: str, sizes: Sizes, workload: str, runs: list[str], timeout: float = 0, compiled_on_cpu: bool = False
) -> argparse.Namespace:
    """What gpu_throughput.py's measure and summarise read: one workload, the runs that apply on this device (the
    compiled ones on CPU too when `compiled_on_cpu`)."""
    precision = "bf16-mixed" if device == "cuda" else "32-true"
    applies = [name for name in runs if device == "cuda" or compiled_on_cpu or not RUNS[name].cuda_only]
    return argparse.Namespace(device=device, size=sizes.size, precision=precision, workloads=[workload], runs=applies,
                              steps=sizes.steps, warmup=sizes.warmup, repeats=1, timeout=timeout)  # fmt: skip


def one_device_part(device: str, sizes: Sizes, timeout: float, keep: Keep) -> dict[str, Any]:
    """Every strategy at degree 1 on the GPT, each run its own process: gpu_throughput.py's entries."""
    facts, entries = measure(throughput_args(device, sizes, sizes.workloads[0], ONE_DEVICE, timeout), keep)
    return {"facts": facts, "entries": entries}


def mfu_part(device: str, sizes: Sizes, timeout: float, keep: Keep) -> dict[str, Any]:
    """MFU_RUNS on the GPT (on CPU too: a rehearsal compiles the toy GPT), each run its own process."""
    limit = min(timeout, MFU_RUN_TIMEOUT) if device == "cuda" else timeout  # CPU: inductor's C++ build takes minutes
    args = throughput_args(device, sizes, sizes.workloads[0], MFU_RUNS, limit, True)
    facts, entries = measure(args, keep)
    return {"facts": facts, "entries": entries}


def mfu_summary(mfu: dict[str, Any], device: str, sizes: Sizes) -> dict[str, Any]:
    """gpu_throughput.py's rows of the mfu part, each with its speed against plain Lightning compiled the same way
    (auto_compiled_fused's step / its step: its MFU over auto_compiled_fused's, the FLOPs being the same)."""
    workload = sizes.workloads[0]
    summary = summarise(mfu["entries"], mfu["facts"], throughput_args(device, sizes, workload, MFU_RUNS, 0, True))
    rows = summary[workload]["rows"]
    plain = rows.get("auto_compiled_fused", {}).get("step_ms")
    for r in rows.values():
        r["vs_auto_compiled_fused"] = plain["median"] / r["step_ms"]["median"] if plain and "step_ms" in r else None
    return summary


def one_device_rows(one_device: dict[str, Any], device: str, sizes: Sizes) -> list[dict[str, Any]]:
    """One row per strategy of the one-device part: status, losses, step, its ratio to auto's, peak memory."""
    workload = sizes.workloads[0]
    args = throughput_args(device, sizes, workload, ONE_DEVICE)
    rows = summarise(one_device["entries"], one_device["facts"], args)[workload]["rows"]
    name = one_device["facts"][workload].get("device_name", device)
    auto = rows.get("auto", {}).get("loss")
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


def throughput_part(report: dict[str, Any], sizes: Sizes, timeout: float, checkpoint: Callable[[], None]) -> None:
    """gpu_throughput.py's rows for both workloads into report["throughput"], written after each run; the GPT's runs
    this invocation's one_device and mfu parts measured (report["fresh"]) are theirs."""
    device, (gpt, image) = report["config"]["device"], sizes.workloads
    every = [name for name in RUNS if device == "cuda" or not RUNS[name].cuda_only]
    fresh = report.get("fresh", [])
    reused = {e["run"]: e for part in reversed(fresh) for e in part["entries"]}  # auto: the one_device part's
    report["throughput"] = {}
    for workload, runs in ((gpt, every), (image, IMAGE_RUNS)):
        kept = [e for name, e in reused.items() if name in runs] if workload == gpt else []
        todo = throughput_args(device, sizes, workload, [r for r in runs if r not in reused or not kept], timeout)
        shown = throughput_args(device, sizes, workload, runs)  # every row, in the table's order

        def rows(facts: dict[str, Any], entries: list[dict[str, Any]], kept: list = kept, shown: Any = shown) -> None:
            report["throughput"] |= summarise([*kept, *entries], facts, shown)
            checkpoint()

        rows(*measure(todo, rows, fresh[0]["facts"] if kept else None))


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
            "measured_peak_memory_mib": part["rows"].get("auto", {}).get("peak_memory_mib"),
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


def run_part(part: str, report: dict[str, Any], sizes: Sizes, timeout: float, checkpoint: Callable[[], None]) -> None:
    """One part, its result in `report` under its name, written by `checkpoint` after each run of the timed parts.
    The throughput part reuses this invocation's one-device and mfu runs (report["fresh"], not saved); the planner
    reads the throughput rows, of this invocation or an earlier one on the same device."""
    device = report["config"]["device"]

    def keep(facts: dict[str, Any], entries: list[dict[str, Any]]) -> None:  # measure()'s after_each
        report[part] = {"facts": facts, "entries": entries}
        checkpoint()

    if part == "pytest":
        report["pytest"] = pytest_part(timeout)
    elif part in ("one_device", "mfu"):
        report[part] = (one_device_part if part == "one_device" else mfu_part)(device, sizes, timeout, keep)
        report.setdefault("fresh", []).append(report[part])
    elif part == "multi_rank":
        report["multi_rank"] = multi_rank_part(device, sizes, timeout)
    elif part == "throughput":
        throughput_part(report, sizes, timeout, checkpoint)
    else:
        report["planner"] = planner_part(report["throughput"], device, sizes) if "throughput" in report else []


def save(report: dict[str, Any], sizes: Sizes, results: Path, started: float) -> None:
    """Write results/gpu_check.{json,md} as they stand (after every part and timed run: a check stopped keeps those)."""
    device = report["config"]["device"]
    one = one_device_rows(report["one_device"], device, sizes) if "one_device" in report else []
    report["runs"] = [*one, *report.get("multi_rank", [])]
    if "mfu" in report:
        report["mfu"]["summary"] = mfu_summary(report["mfu"], device, sizes)
    report["config"]["wall_s"] = time.perf_counter() - started
    saved = {key: value for key, value in report.items() if key != "fresh"}
    write_results("gpu_check", saved, markdown(saved), results=results, show=False)


def unfinished(report: dict[str, Any], part: str, began: float, write: Callable[[], None]) -> None:
    """Mid-part: the part marked cut off until it ends (if the check is killed, the mark stays), the results written."""
    line = "cut off: it had not finished when the results were last written (the runs it finished are kept)"
    report["parts"][part] = {"date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": time.perf_counter() - began} | {
        "error": line
    }
    write()


def main() -> None:
    args = arguments()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        print(f"CUDA device {torch.cuda.get_device_name()}: the GPU check ({', '.join(args.parts)})", flush=True)
    else:
        print("No CUDA device here: rehearsing the GPU check on CPU at toy sizes (results say device: cpu)", flush=True)
    sizes = SIZES[device]
    report = earlier(args.results, device)
    report["config"] = {"device": device, "machine": machine(), "torch": torch.__version__, "cuda": torch.version.cuda,
                        "lightning": lightning.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                        "sizes": sizes.__dict__, "nccl": NCCL, "nccl_version": nccl_version()}  # fmt: skip
    check(report, args.parts, sizes, args.timeout, args.results)
    print("\n".join(summary_lines(report)))


def check(report: dict[str, Any], parts: list[str], sizes: Sizes, timeout: float, results: Path) -> None:
    """The parts asked for, in order, into `report`; the results written after each timed run and each part."""
    started = time.perf_counter()
    report.setdefault("parts", {})
    for part in (p for p in PARTS if p in parts):
        began = time.perf_counter()
        print(f"== {part}", flush=True)
        checkpoint = partial(unfinished, report, part, began, partial(save, report, sizes, results, started))
        try:
            run_part(part, report, sizes, timeout, checkpoint)
            outcome = {}
        except Exception as error:  # a part that broke is a line of the report; the next part still runs
            traceback.print_exc()
            outcome = {"error": error_line(error)}
        report["parts"][part] = {"date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": time.perf_counter() - began}
        report["parts"][part] |= outcome
        save(report, sizes, results, started)


if __name__ == "__main__":
    main()
