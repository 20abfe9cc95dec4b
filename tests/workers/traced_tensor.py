"""Worker: fit user-style modules (tests/user_modules.py) whose networks are split by tracing, under the pipeline
strategy with tensor parallelism inside the stages; save each run's losses and weights (DTensors gathered whole)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
from common import payload

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_families import causal_lm  # noqa: E402
from user_modules import CausalLM, build, fit, tiny_gpt2, token_loader  # noqa: E402

from lightning_parallel import PipelineParallelStrategy  # noqa: E402

LANGUAGE_MODELS = {"gpt2": tiny_gpt2, "qwen2_tied": lambda: causal_lm("qwen2_tied")}  # called positionally

configs, out = payload()
results = []
for config in configs:
    torch.manual_seed(0)
    gpt2 = config["net"] in LANGUAGE_MODELS
    module = CausalLM(LANGUAGE_MODELS[config["net"]]()) if gpt2 else build(config["net"], "criterion")
    strategy = PipelineParallelStrategy(**config["strategy"], timeout=120)
    try:
        data = token_loader(batch_size=config["batch_size"]) if gpt2 else None
        run = {"devices": config["devices"], "steps": config["steps"], "batch_size": config["batch_size"]}
        result = fit(module, strategy=strategy, shuffle=False, data=data, **run)
        result["parallel"] = strategy.describe()
        result["shapes"] = {name: tuple(getattr(p, "_local_tensor", p).shape) for name, p in module.named_parameters()}
        results.append(result)
    except Exception as error:  # a refusal raises the same line on every rank
        traceback.print_exc()
        results.append({"error": f"{type(error).__name__}: {error}"})
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
