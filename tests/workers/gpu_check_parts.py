"""Worker: the GPU check's parts on CPU (benchmarks/gpu_check.py), in forked processes. Payload {"layouts": ["tp2",
"pp2", ...], "steps"}: this rank's parity fit of each layout in turn, in the same processes and process group
(gloo_host, staging CPU tensors as CUDA ones: benchmarks/shared_device.py writes rank<r>.json and rank<r>.pt under
<out>/<layout>). Payload {"runs": [...], "steps"}: one process runs each one-device case of the toy GPT in turn
(benchmarks/throughput_runs.py), "flops" included, and saves {name: result} to rank0.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from common import payload

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from shared_device import worker  # noqa: E402
from throughput_runs import WORKLOADS, run_case  # noqa: E402

config, out = payload()
if "layouts" in config:
    for layout in config["layouts"]:
        (out / layout).mkdir(exist_ok=True)
        worker(out / layout, layout, "cpu", config["steps"])
    torch.save(config["layouts"], out / f"rank{dist.get_rank()}.pt")
else:
    gpt = WORKLOADS["toy"]["gpt_toy"]
    torch.save(
        {name: run_case(name, gpt, "cpu", "32-true", config["steps"]) for name in config["runs"]}, out / "rank0.pt"
    )
