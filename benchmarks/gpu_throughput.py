"""Training throughput on one device: a raw torch loop (eager, compiled), Lightning's `strategy="auto"` and each
strategy of this library at degree 1, for GPT and ResNet-50. Step time, CPU time, tokens or images per second, MFU
against the GPU's bf16 peak, peak memory; each run against auto. Writes results/gpu_throughput_<device>.{json,md}.

Each run is its own process (`--case`, throughput_runs.py), repeats interleaved. On CPU (`--size cpu`) it is the
CPU-time check that degree 1 is free. Usage:
  .venv/bin/python benchmarks/gpu_throughput.py --size cpu --device cpu [--steps 30 --warmup 5 --repeats 3]
  python benchmarks/gpu_throughput.py --size gpu --device cuda [--workloads gpt2_small] [--runs raw auto tensor]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import lightning
import torch
from harness import arguments as harness_arguments
from harness import counts, machine, run_case, write_case, write_results
from throughput_runs import RUNS, WORKLOADS
from throughput_runs import run_case as measure_case
from timing import order, stats_ms

TARGET = 0.03  # a strategy at degree 1 may cost at most 3% more per step than Lightning's auto
MFU_TARGET = 0.40  # compiled GPT-2 small on a GPU
QUIET = 0.1  # a run is quiet when other processes kept fewer cores than this busy: on CPU the verdict prefers them
# On CPU every run gets the same process set-up, else runs differ by more than a strategy costs:
# - Lightning's DDP-based strategies set torch's threads to cores / processes unless OMP_NUM_THREADS is set, while
#   auto keeps torch's own: one thread everywhere.
# - glibc raises its mmap threshold after the first large free, after which big tensors come from the heap instead
#   of fresh zeroed pages: ResNet-50's steps got 20% cheaper after DiLoCo's first outer step freed its
#   pseudo-gradients. A fixed threshold (32 MiB, glibc's most) and no trimming keep every run in that state.
CPU_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=list(WORKLOADS), help="workload sizes (default: gpu on cuda, else cpu)")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], help="default: bf16-mixed on cuda, 32-true")
    parser.add_argument("--workloads", nargs="+", help="a subset of the size's workloads (default: all)")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), help="a subset of the runs (default: all that apply)")
    parser.add_argument("--compile-on-cpu", action="store_true", help="also run raw_compiled on CPU")
    parser.add_argument("--workload", help=argparse.SUPPRESS)  # child mode (--case): one run (or "flops") of it


def arguments() -> argparse.Namespace:
    """The command line, with the defaults that depend on the device (size, precision, workloads, runs) filled in."""
    args = harness_arguments(__doc__.splitlines()[0], steps=30, warmup=5, repeats=3, timeout=1200, extra=options)
    error = lambda message: SystemExit(f"gpu_throughput.py: error: {message}")  # noqa: E731
    args.size = args.size or ("gpu" if args.device == "cuda" else "cpu")
    args.precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "32-true")
    args.workloads = args.workloads or list(WORKLOADS[args.size])
    unknown = set(args.workloads) - set(WORKLOADS[args.size])
    if unknown:
        known = list(WORKLOADS[args.size])
        raise error(f"--workloads {sorted(unknown)} not in --size {args.size}: choose from {known}")
    skip_compiled = args.device == "cpu" and not args.compile_on_cpu
    args.runs = args.runs or [name for name, run in RUNS.items() if not (run.cuda_only and skip_compiled)]
    if "auto" not in args.runs:
        raise error("--runs needs auto: every run is reported against it")
    return args


def case(args: argparse.Namespace) -> None:
    """Child: run one case and write its JSON, or the one line it stopped with."""
    workload = WORKLOADS[args.size][args.workload]
    total = args.warmup + args.steps
    write_case(args.out, lambda: measure_case(args.case, workload, args.device, args.precision, total))


def launch(name: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one case in a fresh process; with how many cores other processes kept busy meanwhile."""
    command = ["--case", name, "--workload", workload, "--size", args.size, "--device", args.device]
    command += ["--precision", args.precision, *counts(args, ("steps", "warmup"))]
    env = CPU_ENV if args.device == "cpu" else {"PYTHONUNBUFFERED": "1"}
    return run_case(__file__, command, timeout=args.timeout, env=env)


# ---- summary (per workload, per run) -----------------------------------------------------------------------------
def row(runs: list[dict[str, Any]], facts: dict[str, Any], units: int, args: argparse.Namespace) -> dict[str, Any]:
    """Pooled measured steps of one run's repeats; throughput, TFLOP/s and MFU from the median step."""
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"errors": [r["error"] for r in runs if "error" in r], "repeats_ok": len(ok)}
    out["other_cores"] = statistics.mean(r["other_cores"] for r in runs)
    if not ok:
        return out
    wall = [t for r in ok for t in r["wall_s"][args.warmup :]]
    cpu = [t for r in ok for t in r["cpu_s"][args.warmup :]]
    out |= {"step_ms": stats_ms(wall), "cpu_ms": stats_ms(cpu), "cpu_mean_ms": statistics.mean(cpu) * 1e3}
    out["repeat_cpu_ms"] = [statistics.median(r["cpu_s"][args.warmup :]) * 1e3 for r in ok]
    quiet = [t for r in ok if r["other_cores"] < QUIET for t in r["cpu_s"][args.warmup :]]
    out["quiet_runs"] = sum(r["other_cores"] < QUIET for r in ok)
    out["quiet_cpu_ms"] = statistics.median(quiet) * 1e3 if quiet else None  # others' load inflates CPU time too
    step_s, flops = out["step_ms"]["median"] / 1e3, facts.get("flops_per_step")
    out["per_s"] = units / step_s
    out["tflops"] = flops / step_s / 1e12 if flops else None
    bf16 = args.precision.startswith("bf16")
    out["mfu"] = flops / step_s / facts["peak_flops"] if flops and facts.get("peak_flops") and bf16 else None
    out["peak_memory_mib"] = statistics.median(r["peak_memory_mib"] for r in ok)
    out["loss"] = ok[0]["loss"]
    out |= {key: ok[0].get(key) for key in ("compiled_graphs", "adamw")}  # what torch saw the run do
    return out


def against(rows: dict[str, dict[str, Any]], device: str) -> None:
    """Each row's ratios to auto (wall, CPU; CPU per repeat; CPU over quiet runs), its loss gap to raw, and the 3%
    verdict: on CPU by CPU time (quiet runs where both have some: others' load slows our work too), on CUDA by wall
    time (the GPU's step)."""
    auto, raw = rows.get("auto", {}), rows.get("raw", {})  # a check cut off may not have run auto yet
    for name, r in rows.items():
        if "step_ms" not in r or "step_ms" not in auto:
            continue
        r["wall_vs_auto"] = r["step_ms"]["median"] / auto["step_ms"]["median"]
        r["cpu_vs_auto"] = r["cpu_ms"]["median"] / auto["cpu_ms"]["median"]
        r["repeat_cpu_vs_auto"] = [a / b for a, b in zip(r["repeat_cpu_ms"], auto["repeat_cpu_ms"], strict=False)]
        if "loss" in raw:
            r["max_loss_gap_vs_raw"] = max(abs(a - b) for a, b in zip(r["loss"], raw["loss"], strict=True))
        quiet = r["quiet_cpu_ms"] and auto["quiet_cpu_ms"]
        r["quiet_cpu_vs_auto"] = r["quiet_cpu_ms"] / auto["quiet_cpu_ms"] if quiet else None
        judged = (r["quiet_cpu_vs_auto"] or r["cpu_vs_auto"]) if device == "cpu" else r["wall_vs_auto"]
        r["within_target"] = judged - 1 <= TARGET if RUNS[name].degree_one else None


def summarise(entries: list[dict], facts: dict[str, dict], args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for w in args.workloads:
        workload = WORKLOADS[args.size][w]
        rows = {}
        for name in args.runs:
            runs = [e for e in entries if e["workload"] == w and e["run"] == name]
            if runs:  # none yet in a check's part saved midway
                rows[name] = row(runs, facts[w], workload.units_per_step, args)
        against(rows, args.device)
        out[w] = {"workload": {**asdict(workload), "unit": workload.unit}, "facts": facts[w], "rows": rows}
    return out


# ---- report --------------------------------------------------------------------------------------------------
def cells(name: str, r: dict[str, Any], unit: str) -> list[str]:
    run = RUNS[name]
    head = [f"`{name}`: {run.description}", "yes" if run.compiled else "no", "yes" if run.checkpointing else "no"]
    if "step_ms" not in r:
        return [*head, f"failed: {r['errors'][0]}", *[""] * 9, f"{r['other_cores']:.2f}"]
    s, c = r["step_ms"], r["cpu_ms"]
    spread = r.get("repeat_cpu_vs_auto") or [1.0]
    verdict = {None: "-", True: "yes", False: "NO"}[r.get("within_target")]
    gap = r.get("max_loss_gap_vs_raw")
    return [
        *head,
        f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f})",
        f"{c['median']:.1f} ({r['cpu_mean_ms']:.1f})",
        f"{r['wall_vs_auto']:.3f} / {r['cpu_vs_auto']:.3f} ({min(spread):.3f}-{max(spread):.3f})"
        if "cpu_vs_auto" in r
        else "-",
        "-" if r.get("quiet_cpu_vs_auto") is None else f"{r['quiet_cpu_vs_auto']:.3f} ({r['quiet_runs']})",
        verdict,
        f"{r['per_s']:,.0f}",
        "-" if r["tflops"] is None else f"{r['tflops']:.3g}",
        "-" if r["mfu"] is None else f"{r['mfu']:.1%}",
        f"{r['peak_memory_mib']:,.0f}",
        "-" if gap is None else f"{gap:.1e}",
        f"{r['other_cores']:.2f}" + (f" ({len(r['errors'])} failed)" if r["errors"] else ""),
    ]


def table(w: str, part: dict[str, Any], args: argparse.Namespace) -> list[str]:
    sizes, facts, unit = part["workload"], part["facts"], part["workload"]["unit"]
    shape = ", ".join(f"{k} {v}" for k, v in sizes["sizes"].items())
    pixels = f", {sizes['image']}x{sizes['image']} images" if sizes["image"] else ""
    memory = "max allocated MiB" if args.device == "cuda" else "peak RSS MiB (process)"
    lines = [
        f"## {w}: {sizes['kind']} ({shape}{pixels}), batch {sizes['batch']}",
        "",
        f"{facts.get('parameters', 0):,} parameters; {facts.get('flops_per_step', 0) / 1e9:,.2f} GFLOP per training "
        "step (FlopCounterMode, forward + backward).",
        "",
        f"| run | compiled | act. ckpt | step ms (p10-p90) | CPU ms/step (mean) | vs auto: wall / CPU (CPU per "
        f"repeat) | CPU vs auto, quiet runs (n) | <= {TARGET:.0%} | {unit}/s | TFLOP/s | MFU | {memory} | "
        "max abs loss gap vs raw | other cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + ["| " + " | ".join(cells(name, part["rows"][name], unit)) + " |" for name in args.runs] + [""]


def verdicts(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    judged = [(w, n, r) for w, p in summary.items() for n, r in p["rows"].items() if RUNS[n].degree_one]
    met = [f"{w}/{n}" for w, n, r in judged if r.get("within_target")]
    missed = [f"{w}/{n}" for w, n, r in judged if not r.get("within_target")]
    quiet = f"CPU time per step, over quiet runs (< {QUIET} other cores) where it and auto have some, else all"
    basis = quiet if args.device == "cpu" else "wall time per step"
    lines = [f"- Degree 1 is free (each strategy within {TARGET:.0%} of auto; judged on {basis}): {len(met)} of "
             f"{len(judged)} rows" + (f"; not: {', '.join(missed)}" if missed else "") + "."]  # fmt: skip
    compiled = summary.get("gpt2_small", {}).get("rows", {}).get("raw_compiled", {})
    if compiled.get("mfu") is not None:
        ok = "met" if compiled["mfu"] >= MFU_TARGET else "NOT met"
        lines.append(f"- Compiled GPT-2 small MFU {compiled['mfu']:.1%} (target >= {MFU_TARGET:.0%}: {ok}).")
    return lines


def markdown(summary: dict[str, Any], config: dict[str, Any], args: argparse.Namespace) -> str:
    load = config["other_cores"]
    threads = (
        ", one torch thread per process, glibc's malloc thresholds fixed (CPU_ENV)" if args.device == "cpu" else ""
    )
    lines = [
        f"# Throughput on one device: {config['device']}",
        "",
        f"`benchmarks/gpu_throughput.py --size {args.size} --device {args.device}`, {config['date']}, "
        f"{config['machine']}, Lightning {config['lightning']}, precision {args.precision}{threads}. Each run "
        f"in its own process; {args.repeats} interleaved repeats (order reversed every other repeat) x {args.steps} "
        f"steps after {args.warmup} warm-up steps. Other processes kept {load['mean']:.2f} cores busy on average "
        f"(max {load['max']:.2f}); on a small shared machine judge by CPU ms, not wall ms.",
        "",
        "- **step**: on_train_batch_start to on_train_batch_end (the raw loop: forward, loss, backward, AdamW step, "
        "zero_grad), batch already on the device, the GPU synchronised at both ends; medians over all repeats' "
        "measured steps. **CPU ms**: this process's CPU time in the same window (all its threads).",
        "- **vs auto**: median / auto's median (range: CPU ratio per repeat). MFU = counted FLOPs per step / step / "
        "the GPU's dense bf16 peak (none on CPU). Loss gap: same weights and batches; DiLoCo departs at its first "
        "outer step (period 10) by design, the pipeline's micro-batches round differently.",
        *verdicts(summary, args),
        "",
    ]
    for w, part in summary.items():
        lines += table(w, part, args)
    return "\n".join(lines)


def measure(
    args: argparse.Namespace,
    after_each: Callable[[dict[str, dict], list[dict]], None] = lambda *_: None,
    facts: dict[str, dict] | None = None,
) -> tuple[dict[str, dict], list[dict]]:
    """FLOPs once per workload (unless given), then every run of every workload, repeats interleaved;
    `after_each(facts, entries)` after each run (gpu_check.py saves there: a check cut off keeps its finished runs)."""
    facts = facts or {w: launch("flops", w, args) for w in args.workloads}
    entries: list[dict] = []
    for rep in range(args.repeats):
        for w in args.workloads:
            for name in order(rep, args.runs):
                entries.append({"workload": w, "run": name, "repeat": rep, **launch(name, w, args)})
                e = entries[-1]
                done = e.get("error") or f"CPU {statistics.median(e['cpu_s'][args.warmup :]) * 1e3:.1f} ms/step"
                print(f"repeat {rep + 1}/{args.repeats} {w} {name}: {done}", flush=True)
                after_each(facts, entries)
    return facts, entries


def main() -> None:
    args = arguments()
    if args.case:
        case(args)
        return
    started = time.perf_counter()
    facts, entries = measure(args)
    first = next(iter(facts.values()))
    load = [e["other_cores"] for e in entries]
    config = {
        "device": first.get("device_name", "?") if args.device == "cuda" else f"CPU ({machine()})",
        "machine": machine(),
        "cuda": first.get("cuda"),
        "lightning": lightning.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "args": {k: v for k, v in vars(args).items() if k not in ("case", "workload", "out", "worker")},
        "other_cores": {"mean": statistics.mean(load), "max": max(load)},
        "target": TARGET,
        "wall_s": time.perf_counter() - started,
    }
    summary = summarise(entries, facts, args)
    report = {"config": config, "summary": summary, "entries": entries}
    name = f"gpu_throughput_{args.device}"
    write_results(name, report, markdown(summary, config, args), config["wall_s"])


if __name__ == "__main__":
    main()
