"""planner_accuracy.py's report: the page of predicted against measured step times, the targets' verdicts and the
calibrated constants, written to results/planner_accuracy[_repeats<N>].{json,md}. It runs nothing.
"""

from __future__ import annotations

import statistics
from typing import Any

from harness import write_results
from planner_accuracy_cases import CORES, MEDIAN_TARGET, QUIET, TARGET, WARMUP_STEPS


def write_report(result: dict[str, Any]) -> None:
    rows = result["layouts"]
    within = sum(abs(r["error"]) <= TARGET for r in rows)
    within_mean = sum(abs(r["error_vs_summary"]) <= TARGET for r in rows)
    hw, net = result["calibration"]["hardware"], result["calibration"]["hardware"]["network"]
    median = statistics.median(abs(r["error"]) for r in rows)
    under = sum(r["error"] < 0 for r in rows)
    lines = [
        "# Planner accuracy: predicted vs measured step time",
        "",
        f"`benchmarks/planner_accuracy.py`, {result['when']}, {result['machine']}; {result['wall_s'] / 60:.1f} min"
        + (
            f" (constants solved again on {result['solved']} from these measurements, `--from-results`). "
            if "solved" in result
            else ". "
        )
        + f"Each layout ran {result['repeats']} times x {result['steps']} steps of `train.py` (interleaved, one thread "
        f"per process, gloo). **Measured** = the slowest rank's median step after the first {WARMUP_STEPS} (recorded "
        "by a callback the benchmark adds), median over the runs; the planner predicts this steady-state step. "
        "`step_time_s` of summary.json (mean over all steps, warm-up included) is shown next to it. Other "
        f"processes (other engineers' jobs) kept a median {result['others_median']:.2f} of the {CORES} cores busy "
        f"during the compared runs; a run during which they used more than {QUIET} cores was repeated once and the "
        f"quieter run kept ({result['repeated_runs']} repeats).",
        "",
        f"**Median |error| {median:.1%}** (target {MEDIAN_TARGET:.0%}: "
        f"{'met' if median <= MEDIAN_TARGET else 'NOT met'}); "
        f"**{under} of {len(rows)} under-predicted, {len(rows) - under} over**; {within} of {len(rows)} layouts within "
        f"{TARGET:.0%} of the steady step, largest |error| {max(abs(r['error']) for r in rows):.1%}. Against "
        f"summary.json's warm-up-inclusive mean: {within_mean} of {len(rows)} within {TARGET:.0%}.",
        "",
        "| model | layout | train.py overrides | predicted ms | measured ms (median, min-max) | error | within 25% | "
        "summary.json step_time_s ms | error | params/rank exact | other load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        steady = r["measured_runs_s"]
        lines.append(
            f"| {r['model']} | {r['describe']} | `{' '.join(r['overrides'])}` | {r['predicted_s'] * 1e3:.1f} | "
            f"{r['measured_s'] * 1e3:.1f} ({min(steady) * 1e3:.1f}-{max(steady) * 1e3:.1f}) | {r['error']:+.1%} | "
            f"{'yes' if abs(r['error']) <= TARGET else 'NO'} | {r['summary_step_time_s'] * 1e3:.1f} | "
            f"{r['error_vs_summary']:+.1%} | {'yes' if r['params_match'] else 'NO'} | "
            f"{statistics.median(r['others_cores']):.2f} |"
        )
    lines += [
        "",
        "Models: `gpt` = `model=transformer data=synthetic_tokens` (4 blocks, width 128, 32 tokens, batch 32); `cnn` = "
        "`model=simple_cnn data=synthetic_images data.image_size=32 data.num_classes=10` (batch 64). "
        "params/rank exact: the planner's parameter bytes per pipeline rank equal summary.json's "
        "`parameter_bytes_per_rank`.",
        "",
        "Calibrated constants (copied into `lightning_parallel/planner/presets/hardware/cpu.yaml`): step overhead "
        f"{hw['step_overhead'] * 1e3:.2f} ms, multi-process sync overhead {hw['sync_overhead'] * 1e3:.2f} ms and DDP "
        f"wrapper overhead {hw['dp_overhead'] * 1e3:.2f} ms per step, DTensor collective "
        f"overhead {hw['collective_overhead'] * 1e3:.2f} ms per tensor-parallel / FSDP collective, Adam "
        f"{hw['optimizer_time'] * 1e9:.2f} ns/parameter, contention {hw['contention']:.2f} inside training (each of "
        f"{CORES} processes computing at once is that many times slower than one alone; solved from the calibration "
        f"runs, from the {result['calibration']['measured_contention']:.2f} measured on bare compute up: both models' "
        f"blocks timed in one process, then in {CORES} at once), gloo latency {net['intra_latency'] * 1e6:.0f} us, and "
        f"{net['intra_bandwidth'] / 1e9:.2f} GB/s reached by collectives inside training (gloo alone, two idle "
        f"processes: {result['loopback']['bandwidth'] / 1e9:.2f} GB/s); compute and host overheads x devices / "
        f"{CORES} when processes outnumber cores, and a pipeline's ranks compute faster while others wait in the "
        "bubble (the schedule's share of time with each number of ranks busy). The "
        "pipeline action overhead is left at 0: solved from pipeline "
        "runs it came out at or below 0 on this machine (the per-micro-batch cost is inside the measured block times).",
        "",
        "How (every round, medians over rounds): block forward+backward times are fitted as fixed + per-sample from "
        "timings at two batch sizes (gpt 8 and 32, cnn 16 and 64) in this process, one thread; latency comes from a "
        "Theil-Sen fit of 2-process gloo all-reduce and send/recv times over 1 KiB-2 MiB; Adam from timing AdamW on "
        "the gpt. Then each group of constants is solved by least squares on the relative residuals "
        "((measured - predicted without them) / measured) of train.py runs that are not in the table, group after "
        "group, twice over: the step overhead from single-process runs at batch 8 (gpt) / 16 (cnn); the sync "
        "overhead from GPipe runs with 2 micro-batches at batch 16 / 32; the DDP wrapper overhead from DDP runs at "
        "batch 8 / 16; the collective overhead and the bandwidth collectives reach in training from tp=2 runs at "
        "two batch sizes each (gpt 8 and 16, cnn 16 and 32). A constant solved below 0 is fixed at 0.",
    ]
    name = "planner_accuracy" if result["repeats"] == 3 else f"planner_accuracy_repeats{result['repeats']}"
    write_results(name, result, "\n".join(lines) + "\n", result["wall_s"], indent=2, show=False)
