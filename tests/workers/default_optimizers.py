"""Worker: fit a user-style classifier (`user_modules.TutorialOptimizers`) under one layout per payload entry with a
torch optimizer as CUDA runs it (foreach or fused), gradient clipping, accumulation and a per-step LR scheduler. An
entry with "resume_at" first fits to that step, saving a checkpoint there, and then resumes from it in a new Trainer.

Payload: [{"strategy": "tensor" | "pipeline" | "auto", "args": {...}, "net", "optimizer": [name, kwargs], "steps",
"batch_size" (per replica), "resume_at"?, "resume_args"? (the resumed run's strategy arguments), "accelerator"?
("cpu")}]. Saves per entry the losses and the weights this rank holds, whole.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from common import payload
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).parents[1]))
from user_modules import CLIP_ACCUMULATE, NETWORKS, TutorialOptimizers, fit  # noqa: E402

from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy  # noqa: E402
from lightning_parallel.parameter_kinds import kind  # noqa: E402

STRATEGIES = {"tensor": TensorParallelStrategy, "pipeline": PipelineParallelStrategy}


def run(config: dict[str, Any], save_dir: Path) -> dict[str, Any]:
    def module() -> TutorialOptimizers:
        torch.manual_seed(0)
        name, kwargs = config["optimizer"]
        return TutorialOptimizers(NETWORKS[config["net"]](), name, **kwargs)

    def strategy(args: dict[str, Any] | None = None) -> Any:
        if config["strategy"] == "auto":  # Lightning's own single device, the reference on a GPU
            return "auto"
        return STRATEGIES[config["strategy"]](**(args or config["args"]), timeout=60)

    size = {"devices": config["devices"], "shuffle": False, "batch_size": config["batch_size"], **CLIP_ACCUMULATE}
    size["accelerator"] = config.get("accelerator", "cpu")
    graphs = counters["stats"]["unique_graphs"]  # TorchDynamo's, for entries that compile
    resume_at, last = config.get("resume_at"), module()
    if resume_at is None:
        result = fit(last, strategy=strategy(), steps=config["steps"], **size)
    else:
        first = fit(
            module(), strategy=strategy(), steps=resume_at, save_every=resume_at, save_dir=str(save_dir), **size
        )
        checkpoint = str(save_dir / f"step={resume_at}.ckpt")
        resumed = strategy(config.get("resume_args"))  # e.g. eager from a compiled run's checkpoint
        result = fit(last, strategy=resumed, steps=config["steps"], ckpt_path=checkpoint, **size)
        result["losses"] = first["losses"] + result["losses"]
    compiled = counters["stats"]["unique_graphs"] - graphs
    return {**result, "kinds": len({kind(p) for p in last.parameters()}), "compiled_graphs": compiled}


configs, out = payload()
results = [run(config, out / f"checkpoints{index}") for index, config in enumerate(configs)]
torch.save(results, out / f"rank{os.environ['RANK']}.pt")
