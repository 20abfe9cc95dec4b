"""The GPU check's report: results/gpu_check.md (pytest, one row per run, gpu_throughput.py's tables, the planner
against them) and the one-screen summary on stdout. Reads the report dict `gpu_check.py` builds; measures nothing.
"""

from __future__ import annotations

import argparse
import re
import statistics
from typing import Any

from gpu_throughput import table, verdicts
from shared_device import PARITY_GPT, TOLERANCE, parity
from throughput_runs import RUNS

MiB = 2**20


def device_name(report: dict[str, Any]) -> str:
    names = {row["device"] for row in report.get("runs", []) if row.get("part") == "one_device"}
    if report["config"]["device"] == "cpu":
        return "CPU rehearsal (no CUDA device)"
    return ", ".join(sorted(names)) or "CUDA"


def number(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else f"{value:{fmt}}"


def status(error: str | None) -> str:
    """Status "ok", "refused: needs torch >= X" (seams.NEEDS_TORCH on an older torch) or "failed: <the one line>"."""
    if error is None:
        return "ok"
    needs = re.search(r"needs torch >= (\d+\.\d+)", error)
    return f"refused: needs torch >= {needs.group(1)}" if needs else f"failed: {error}"


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


def pytest_lines(result: dict[str, Any] | None) -> list[str]:
    if not result:
        return ["Not run yet on this device."]
    counts = ", ".join(f"{result.get(k, 0)} {k}" for k in ("passed", "failed", "errors", "skipped"))
    lines = [
        f"`{result['command']}`: {counts}, {result['deselected']} deselected ({result['seconds']:.0f} s, exit "
        f"code {result['exit_code']}; pytest's last line: {result['last_line']})."
    ]
    return lines + [f"- {f['test']}: {f['line']}" for f in result["failures"]]


def run_cells(row: dict[str, Any]) -> list[str]:
    losses = row.get("losses") or []
    shown = f"{losses[0]:.4f} .. {losses[-1]:.4f} ({len(losses)})" if losses else "-"
    parity = row.get("parity")
    parity_cell = (
        "-"
        if not parity
        else (
            f"{parity['max_loss_diff']:.1e} / {parity['max_param_diff']:.1e} (<= {parity['tolerance']:.0e}: "
            f"{'yes' if parity['within'] else 'NO'}"
            + (f"; missing {parity['missing_parameters']}" if parity["missing_parameters"] else "")
            + ")"
        )
    )
    return [
        f"`{row['strategy']}`",
        str(row["devices"]),
        row["device"],
        "yes" if row["ok"] else "NO",
        row["status"],
        shown,
        number(row.get("step_ms")),
        number(row.get("vs_auto"), ".3f"),
        number(row.get("peak_memory_mib"), ",.0f"),
        number(row.get("max_loss_gap_vs_auto"), ".1e"),
        parity_cell,
    ]


def runs_lines(report: dict[str, Any]) -> list[str]:
    sizes, config = report["config"]["sizes"], report["config"]
    precision = "bf16-mixed" if config["device"] == "cuda" else "32-true"
    lines = [
        f"- **one device**: `{sizes['workloads'][0]}` (benchmarks/throughput_runs.py), {precision}, torch's default "
        f"AdamW (foreach on CUDA tensors), each run its own process, {sizes['steps']} measured steps after "
        f"{sizes['warmup']}; **step**: median wall time per step, **vs auto**: over auto's; losses of every step.",
        f"- **multi-rank**: GPT {PARITY_GPT}, batch 8, fp32 (TF32 off), SGD lr 0.5 momentum 0.9 (torch's default "
        f"kernel: foreach on CUDA), {sizes['parity_steps']} steps; 2 or 4 ranks on one device over gloo_host "
        "(gloo, tensors staged through host memory; `benchmarks/shared_device.py`), against one process (Lightning's "
        "auto). **parity**: largest |loss difference| over every step and rank / largest |parameter difference| over "
        "every parameter.",
        "",
        "| strategy | devices | device | ok | status | losses: first .. last (steps) | step ms | vs auto | peak "
        "memory MiB | max loss gap vs auto | parity: loss / parameters |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + ["| " + " | ".join(run_cells(row)) + " |" for row in report.get("runs", [])]


def throughput_lines(report: dict[str, Any]) -> list[str]:
    summary = report.get("throughput")
    if not summary:
        return ["Not run yet on this device."]
    args = argparse.Namespace(device=report["config"]["device"], runs=[])
    lines = [*verdicts(summary, args), ""]
    for workload, part in summary.items():
        args.runs = list(part["rows"])
        lines += table(workload, part, args)
    return lines


def mfu_headline(report: dict[str, Any]) -> str | None:
    """The mfu part in one line: each run's MFU (its step on CPU: no peak there) and the strategy's MFU over plain
    Lightning's, both compiled with fused AdamW (auto_compiled_fused's step / tensor_compiled_fused's)."""
    summary = (report.get("mfu") or {}).get("summary")
    if not summary:
        return None
    [(workload, part)] = summary.items()
    cells = [
        f"{run} failed"
        if "step_ms" not in r
        else f"{run} " + (f"{r['mfu']:.1%} MFU" if r["mfu"] is not None else f"{r['step_ms']['median']:.1f} ms")
        for run, r in part["rows"].items()
    ]
    ratio = part["rows"].get("tensor_compiled_fused", {}).get("vs_auto_compiled_fused")
    shown = "not measured" if ratio is None else f"{ratio:.3f}"
    device = part["facts"].get("device_name", report["config"]["device"])
    return f"mfu {workload} ({device}): " + " | ".join(cells) + f" | strategy / plain Lightning (MFU): {shown}"


def mfu_lines(report: dict[str, Any]) -> list[str]:
    headline = mfu_headline(report)
    if headline is None:
        return ["Not run yet on this device."]
    [(workload, part)] = report["mfu"]["summary"].items()
    sizes = report["config"]["sizes"]
    lines = [
        f"`python benchmarks/gpu_check.py --parts mfu`: `{workload}` (benchmarks/throughput_runs.py), "
        f"{'bf16-mixed' if report['config']['device'] == 'cuda' else '32-true'}, each run its own process, "
        f"{sizes['steps']} measured steps after {sizes['warmup']}. MFU: counted FLOPs per step / median step / the "
        "GPU's dense bf16 peak. **graphs**: what torch.compile built in the run's process (0: eager); **AdamW**: the "
        "kernel its optimizer was built with (default: foreach on CUDA tensors, a for-loop on CPU); **vs plain "
        "compiled**: auto_compiled_fused's step / the run's (its MFU over auto_compiled_fused's).",
        "",
        f"- {headline}",
        "",
        "| run | what it runs | graphs | AdamW | step ms (p10-p90) | TFLOP/s | MFU | vs plain compiled | peak memory "
        "MiB | losses: first .. last (steps) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, r in part["rows"].items():
        if "step_ms" not in r:
            lines.append(f"| `{run}` | {RUNS[run].description} | failed: {r['errors'][0]} |" + " |" * 7)
            continue
        s, losses = r["step_ms"], r["loss"]
        lines.append(
            f"| `{run}` | {RUNS[run].description} | {r.get('compiled_graphs', '-')} | {r.get('adamw', '-')} | "
            f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f}) | {number(r['tflops'], '.3g')} | "
            f"{number(r['mfu'], '.1%')} | {number(r['vs_auto_compiled_fused'], '.3f')} | "
            f"{r['peak_memory_mib']:,.0f} | {losses[0]:.4f} .. {losses[-1]:.4f} ({len(losses)}) |"
        )
    return lines


def planner_lines(rows: list[dict[str, Any]] | None) -> list[str]:
    if not rows:
        return ["Not run yet on this device (it needs the throughput rows)."]
    lines = [
        "`CostModel(workload_from_module(model, batch), hardware_preset(preset), precision).estimate(Layout(dp=1))`: "
        "the predicted step on one device against the measured ones. **efficiency matching auto**: the preset's "
        "`efficiency` at which the prediction equals auto's step (the other terms kept). Memory: the planner's total "
        "per device against auto's peak (CUDA: max allocated; CPU: the process's peak RSS, Python and torch included).",
        "",
        "| workload | preset | predicted ms (compute / optimizer / overhead) | measured ms: auto / raw / raw "
        "compiled | predicted / auto | preset efficiency -> matching auto | predicted memory / auto's peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        parts = " / ".join(f"{r['breakdown_s'][k] * 1e3:.1f}" for k in ("compute", "optimizer", "overhead"))
        measured = " / ".join(number(r["measured_s"][k] and r["measured_s"][k] * 1e3) for k in r["measured_s"])
        lines.append(
            f"| {r['workload']} | {r['preset']} ({r['precision']}) | {r['predicted_s'] * 1e3:.1f} ({parts}) | "
            f"{measured} | {number(r.get('predicted_vs_auto'), '.2f')} | {r['preset_efficiency']} -> "
            f"{number(r.get('efficiency_matching_auto'), '.3f')} | {r['predicted_memory_mib']:,.0f} / "
            f"{number(r['measured_peak_memory_mib'], ',.0f')} |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    config = report["config"]
    parts = ", ".join(
        f"{name} {p['date']} ({p['wall_s'] / 60:.1f} min" + (f"; it broke: {p['error']}" if "error" in p else "") + ")"
        for name, p in report["parts"].items()
    )
    lines = [
        f"# GPU check: {device_name(report)}",
        "",
        f"`make gpu-check` (`benchmarks/gpu_check.py`), {config['machine']}, CUDA {config['cuda'] or '-'}, Lightning "
        f"{config['lightning']}. Parts, when each last ran: {parts}.",
    ]
    if config["device"] == "cpu":
        lines += [
            "",
            "**A rehearsal on CPU at toy sizes, not a GPU measurement**: there was no CUDA device. It shows "
            "that every step of the check runs; its timings are a shared CPU's.",
        ]
    nccl = f" torch bundles NCCL {config['nccl_version']}." if config.get("nccl_version") else ""
    lines += [
        "",
        config["nccl"] + nccl,
        "",
        "## pytest -m gpu",
        "",
        *pytest_lines(report.get("pytest")),
        "",
        "## Runs",
        "",
    ]
    lines += [*runs_lines(report), "", "## MFU: the tensor strategy against plain Lightning, both compiled with "
              "fused AdamW", "", *mfu_lines(report)]  # fmt: skip
    lines += ["", "## Throughput (gpu_throughput.py's rows)", "", *throughput_lines(report)]
    lines += ["", "## Planner against the measured steps", "", *planner_lines(report.get("planner"))]
    return "\n".join(lines) + "\n"


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One screen: what ran, what failed and the headline numbers."""
    config = report["config"]
    lines = [
        f"gpu-check: {device_name(report)} | torch {config['torch']} | Lightning {config['lightning']} | "
        f"{config['wall_s'] / 60:.1f} min"
    ]
    lines += [f"part {name} broke: {p['error']}" for name, p in report["parts"].items() if "error" in p]
    result = report.get("pytest")
    if result:
        lines.append(
            f"pytest -m gpu: {result['passed']} passed, {result['failed']} failed, {result['errors']} errors, "
            f"{result['skipped']} skipped (exit {result['exit_code']})"
        )
        lines += [f"  FAILED {f['test']}: {f['line'][:150]}" for f in result["failures"]]
    for part, title in (("one_device", "one device, vs auto"), ("multi_rank", "ranks sharing one device, gloo_host")):
        rows = [r for r in report.get("runs", []) if r["part"] == part]
        if not rows:
            continue
        cells = []
        for r in rows:
            detail = number(r.get("step_ms")) + " ms" if r["strategy"] == "auto" or r["devices"] == 1 else "ok"
            if part == "one_device" and r["ok"] and r["strategy"] != "auto":
                detail = f"{number(r.get('vs_auto'), '.2f')}x"
            if r.get("parity"):
                detail = f"parity {max(r['parity']['max_loss_diff'], r['parity']['max_param_diff']):.0e}" + (
                    "" if r["parity"]["within"] else " NOT within"
                )
            cells.append(f"{r['strategy']} {detail if r['ok'] else r['status'][:60]}")
        lines.append(f"{title}: " + " | ".join(cells))
    lines.append("NCCL untested: one GPU here, and NCCL refuses two ranks on one device.")
    lines += [line for line in [mfu_headline(report)] if line]
    for workload, part in (report.get("throughput") or {}).items():
        shown = [
            f"{run} {r['step_ms']['median']:.1f} ms" + (f" {r['mfu']:.0%} MFU" if r.get("mfu") else "")
            for run, r in part["rows"].items()
            if run in ("raw", "raw_compiled", "auto") and "step_ms" in r
        ]
        failed = [run for run, r in part["rows"].items() if "step_ms" not in r]
        lines.append(
            f"throughput {workload}: " + " | ".join(shown) + (f" | failed: {', '.join(failed)}" if failed else "")
        )
    for r in report.get("planner") or []:
        lines.append(
            f"planner ({r['preset']}) {r['workload']}: predicted {r['predicted_s'] * 1e3:.1f} ms vs auto "
            f"{number((r['measured_s']['auto'] or 0) * 1e3)} ms ({number(r.get('predicted_vs_auto'), '.2f')}x; "
            f"efficiency matching auto {number(r.get('efficiency_matching_auto'), '.3f')})"
        )
    return lines
