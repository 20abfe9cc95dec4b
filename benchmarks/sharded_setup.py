"""Peak parameter bytes per rank while a model is materialised and sharded (set-up) and after training, against the
ideal total / (pp x tp), for one GPT trained by train.py under pipeline, tensor and pipeline x tensor layouts.
Writes results/sharded_setup.{json,md}. Usage: .venv/bin/python benchmarks/sharded_setup.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from measure import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
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
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "train.py", *MODEL, *RUN, *overrides, f"hydra.run.dir={tmp}/run"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        summary = Path(tmp) / "run" / "summary.json"
        if done.returncode != 0 or not summary.exists():
            return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
        return json.loads(summary.read_text())


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
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sharded_setup.json").write_text(json.dumps(result, indent=2))
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
    (RESULTS / "sharded_setup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
