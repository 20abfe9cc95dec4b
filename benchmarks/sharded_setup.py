"""Peak parameter bytes per rank while a model is materialised and sharded (set-up) and after training, against the
ideal total / (pp x tp), for one GPT trained by train.py under pipeline, tensor and pipeline x tensor layouts.
Writes results/sharded_setup.{json,md}. Usage: .venv/bin/python benchmarks/sharded_setup.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from harness import machine, train_py, write_results

MODEL = ["model=transformer", "model.depth=8", "model.width=256", "model.heads=8", "data=synthetic_tokens"]
RUN = ["trainer.accelerator=cpu", "trainer.max_steps=1", "trainer.limit_val_batches=0", "callbacks=none", "~logger"]
LAYOUTS = {  # name -> (pp, tp, overrides)
    "pp2": (2, 1, ["strategy=pipeline", "trainer.devices=2"]),
    "tp2": (1, 2, ["strategy=tensor", "trainer.devices=2"]),
    "tp4": (1, 4, ["strategy=tensor", "trainer.devices=4"]),
    "pp2 x tp2": (2, 2, ["strategy=pipeline", "trainer.devices=4", "strategy.tensor_parallel_size=2"]),
    "dp2 x pp2 x tp2": (
        2,
        2,
        [
            "strategy=pipeline",
            "trainer.devices=8",
            "strategy.pipeline_parallel_size=2",
            "strategy.tensor_parallel_size=2",
        ],
    ),
}
QUICK = ("tp2", "pp2 x tp2")


def run(overrides: list[str]) -> dict[str, Any]:
    return train_py([*MODEL, *RUN, *overrides], timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    args = parser.parse_args()
    started = time.perf_counter()
    single = run(["strategy=single"])
    total = single["parameter_bytes_per_rank"][0]
    rows = []
    for name, (pp, tp, overrides) in LAYOUTS.items():
        if args.quick and name not in QUICK:
            continue
        summary = run(overrides)
        row: dict[str, Any] = {"layout": name, "pp": pp, "tp": tp, "overrides": overrides, "ideal": total / (pp * tp)}
        if "error" in summary:
            row["error"] = summary["error"]
        else:
            row["setup_peak"] = max(summary["parameter_bytes_peak_setup_per_rank"])
            row["after"] = max(summary["parameter_bytes_per_rank"])
        print(row, flush=True)
        rows.append(row)
    result = {"machine": machine(), "model": MODEL, "total_parameter_bytes": total, "layouts": rows}
    result["wall_s"] = time.perf_counter() - started
    lines = [
        "# Parameter bytes per rank during set-up",
        "",
        f"`benchmarks/sharded_setup.py`: `{' '.join(MODEL)}` ({total / 2**20:.1f} MiB of fp32 parameters), one step "
        "per layout on CPU. **setup peak**: the most parameter bytes a rank held while its part was materialised "
        "and sharded (summary.json's `parameter_bytes_peak_setup_per_rank`, fullest rank); **after**: held after "
        "training; **ideal**: total / (pp x tp).",
        "",
        "| layout | ideal MiB | setup peak MiB | peak / ideal | after MiB | after / ideal |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['ideal'] / 2**20:.2f} | failed: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['layout']} | {r['ideal'] / 2**20:.2f} | {r['setup_peak'] / 2**20:.2f} | "
            f"{r['setup_peak'] / r['ideal']:.2f} | {r['after'] / 2**20:.2f} | {r['after'] / r['ideal']:.2f} |"
        )
    write_results("sharded_setup", result, "\n".join(lines) + "\n", result["wall_s"], indent=2)


if __name__ == "__main__":
    main()
