"""Worker: the GPU check's parts on CPU (benchmarks/gpu_check.py), in forked processes. Payload {"layout": "tp2" |
"pp2" | "pp2 x tp2", "steps"}: this rank's parity fit (benchmarks/shared_device.py; it writes rank<r>.json and
rank<r>.pt itself). Payload {"runs": [...], "steps"}: one process runs each one-device case of the toy GPT in turn
(benchmarks/throughput_runs.py), "flops" included, and saves {name: result} to rank0.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import payload

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from shared_device import worker  # noqa: E402
from throughput_runs import WORKLOADS, run_case  # noqa: E402

config, out = payload()
if "layout" in config:
    worker(out, config["layout"], "cpu", config["steps"])
else:
    gpt = WORKLOADS["toy"]["gpt_toy"]
    torch.save(
        {name: run_case(name, gpt, "cpu", "32-true", config["steps"]) for name in config["runs"]}, out / "rank0.pt"
    )
