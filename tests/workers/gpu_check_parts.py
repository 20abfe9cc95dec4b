"""Worker: the GPU check's parts on CPU (benchmarks/gpu_check.py), in forked processes. Payload {"layouts": ["tp2",
"pp2", ...], "steps"}: this rank's parity fit of each layout in turn, in the same processes and process group
(gloo_host, staging CPU tensors as CUDA ones: benchmarks/shared_device.py writes rank<r>.json and rank<r>.pt under
<out>/<layout>). Payload {"runs": [...], "steps"}: one process runs each one-device case of the toy GPT in turn
(benchmarks/throughput_runs.py), "flops" included, and saves {name: result} to rank0.pt; with "compile_backend", every
torch.compile there uses that backend (the suite's stand-in for inductor, whose C++ build takes ~20 s a graph here).
"""

from __future__ import annotations

import sys
from functools import partial
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
    if config.get("compile_backend"):
        torch.compile = partial(torch.compile, backend=config["compile_backend"])  # type: ignore[assignment]
    gpt = WORKLOADS["toy"]["gpt_toy"]
    torch.save(
        {name: run_case(name, gpt, "cpu", "32-true", config["steps"]) for name in config["runs"]}, out / "rank0.pt"
    )
