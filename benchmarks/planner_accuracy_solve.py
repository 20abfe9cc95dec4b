"""planner_accuracy.py's calibration and comparison: the overhead constants (and the contention inside training) solved
by least squares from the calibration runs' residuals, then every layout predicted with them against its measured runs.
It measures nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any

import numpy
from planner_accuracy_cases import (
    CALIBRATION,
    CORES,
    LAYOUTS,
    MODELS,
    SECONDS_PER_BYTE,
    TARGET,
    UNIT,
    describe_layout,
    group_name,
)

from lightning_parallel.planner import CostModel, Hardware, Layout, Network, Workload
from lightning_parallel.strategies.layouts import train_overrides


def predict(workload: Workload, base: Hardware, layout: Layout, batch: int) -> Any:
    return CostModel(workload, base, precision="32-true").estimate(layout, batch=batch)


def with_constants(base: Hardware, values: dict[str, float]) -> Hardware:
    """``base`` with some constants set; SECONDS_PER_BYTE sets both network bandwidths (0: unlimited)."""
    values = dict(values)
    if SECONDS_PER_BYTE in values:
        seconds = values.pop(SECONDS_PER_BYTE)
        bandwidth = 1.0 / seconds if seconds > 0 else 1e30
        network = replace(base.network, intra_bandwidth=bandwidth, inter_bandwidth=bandwidth)
        values["network"] = network  # type: ignore[assignment]
    return replace(base, **values)


def solve_group(
    workloads: dict[str, Workload], base: Hardware, constants: tuple[str, ...], runs: list, steady: list[float]
) -> dict[str, float]:
    """Least squares on (measured - predicted without them) / measured; a negative one is fixed at 0, rest re-solved."""
    free = list(constants)
    while True:
        zero = with_constants(base, dict.fromkeys(constants, 0.0))
        rows, residuals = [], []
        for (key, layout, batch), measured in zip(runs, steady, strict=True):
            without = predict(workloads[key], zero, layout, batch).step_time
            units = [predict(workloads[key], with_constants(zero, {c: UNIT.get(c, 1e-3)}), layout, batch).step_time
                     - without for c in free]  # fmt: skip
            rows.append([u / measured for u in units])
            residuals.append((measured - without) / measured)
        solution = numpy.linalg.lstsq(numpy.array(rows), numpy.array(residuals), rcond=None)[0] if free else []
        values = {c: float(x) * UNIT.get(c, 1e-3) for c, x in zip(free, solution, strict=True)}
        negative = [c for c, v in values.items() if v < 0]
        if not negative:
            return {**dict.fromkeys(constants, 0.0), **values}
        free = [c for c in free if c not in negative]


def solve_overheads(
    workloads: dict[str, Workload], base: Hardware, steady: dict[str, list[float]]
) -> tuple[Hardware, list[dict[str, Any]]]:
    """Each group of constants in turn, twice over, so the groups solved first see the bandwidth solved last."""
    for _ in range(2):
        record = []
        for constants, runs in CALIBRATION.items():
            values = solve_group(workloads, base, constants, runs, steady[group_name(constants)])
            base = with_constants(base, values)
            for (key, layout, batch), measured in zip(runs, steady[group_name(constants)], strict=True):
                record.append({"constants": values, "model": key, "layout": describe_layout(layout), "batch": batch,
                               "steady_s": measured,
                               "predicted_s": predict(workloads[key], base, layout, batch).step_time})  # fmt: skip
    return base, record


CONTENTION_STEPS = [step / 100 for step in range(151)]  # tried above the measured contention


def solve_contention(
    workloads: dict[str, Workload], base: Hardware, steady: dict[str, list[float]]
) -> tuple[Hardware, list[dict[str, Any]]]:
    """The contention inside training: from the one measured on bare compute up (in training, communication threads
    and the runtime compete for the cores too), the value whose re-solved overheads fit the calibration runs best."""
    best: tuple[float, Hardware, list[dict[str, Any]]] | None = None
    for extra in CONTENTION_STEPS:
        hardware, record = solve_overheads(workloads, replace(base, contention=base.contention + extra), steady)
        misfit = sum((run["predicted_s"] / run["steady_s"] - 1) ** 2 for run in record)
        if best is None or misfit < best[0]:
            best = (misfit, hardware, record)
    assert best is not None
    return best[1], best[2]


def analyse(
    built: dict[str, tuple], figures: dict[str, Any], layout_runs: list[list[dict[str, Any]]], facts: dict[str, Any]
) -> dict[str, Any]:
    """Solve the constants from the calibration runs, predict every layout and compare with its runs."""
    network = Network(devices_per_node=64, intra_bandwidth=figures["network"]["bandwidth"],
                      intra_latency=figures["network"]["latency"], inter_bandwidth=figures["network"]["bandwidth"],
                      inter_latency=figures["network"]["latency"])  # fmt: skip
    workloads = {key: built[key][0].with_seconds(figures["blocks"][key]) for key in MODELS}
    base = Hardware(name="CPU process", memory="4GB", flops=1e12, efficiency=1.0, network=network,
                    optimizer_time=figures["adam"], shared_cores=CORES,
                    contention=figures["contention"]["contention"])  # fmt: skip
    base, calibration_runs = solve_contention(workloads, base, figures["calibration"])
    rows = []
    for (key, layout), runs in zip(LAYOUTS, layout_runs, strict=True):
        batch = int(built[key][3].data.batch_size)
        estimate = predict(workloads[key], base, layout, batch)
        median = statistics.median(r["steady_s"] for r in runs)
        summary_median = statistics.median(r["step_time_s"] for r in runs)
        predicted_bytes = [p * 4 for p in estimate.parameters_per_rank]
        actual = runs[0]["parameter_bytes_per_rank"]
        # ranks are laid out dp outermost, tp innermost: compare the first replica's pipeline ranks (one tp rank each)
        first = [actual[r * layout.tp] for r in range(layout.pp)]
        rows.append({
            "model": key, "layout": asdict(layout), "describe": describe_layout(layout),
            "overrides": train_overrides(layout), "predicted_s": estimate.step_time, "breakdown_s": estimate.time,
            "measured_s": median, "measured_runs_s": [r["steady_s"] for r in runs],
            "error": estimate.step_time / median - 1, "summary_step_time_s": summary_median,
            "summary_runs_s": [r["step_time_s"] for r in runs],
            "error_vs_summary": estimate.step_time / summary_median - 1,
            "others_cores": [r["others_cores"] for r in runs], "attempts": [r["attempts"] for r in runs],
            "parameter_bytes_predicted": predicted_bytes,
            "parameter_bytes_measured": actual, "params_match": first == predicted_bytes,
        })  # fmt: skip
        print(f"{key:4s} {describe_layout(layout):40s} predicted {estimate.step_time * 1e3:7.1f} ms  steady "
              f"{median * 1e3:7.1f} ms  error {rows[-1]['error']:+.1%}  (summary {summary_median * 1e3:.1f} ms)",
              flush=True)  # fmt: skip
    rounds = facts.pop("rounds")
    return {
        **facts, "target": TARGET,
        "others_median": statistics.median(x for r in rows for x in r["others_cores"]),
        "repeated_runs": sum(a - 1 for r in rows for a in r["attempts"]),
        "loopback": figures["network"],
        "calibration": {"hardware": asdict(base), "runs": calibration_runs, "rounds": rounds,
                        "measured_contention": figures["contention"]["contention"],
                        "block_seconds": figures["blocks"]},
        "layouts": rows,
    }  # fmt: skip
