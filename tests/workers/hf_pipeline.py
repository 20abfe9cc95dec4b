"""Worker: fit Hugging Face-style modules (tests/hf_modules.py) under the pipeline strategy (or, with "kind": "tensor",
the tensor strategy), one fit per config ({"name", "devices", "steps", "strategy": constructor kwargs, and any of
OPTIONAL}); save each fit's losses, metrics, local weights (tensor-parallel shards gathered) and `describe()`.
An error stops the rank (the launcher stops the others)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import payload

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_modules import fit  # noqa: E402

from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy  # noqa: E402

OPTIONAL = ("batch_size", "save_every", "save_dir", "ckpt_path", "validate", "gradient_clip_val")
configs, out = payload()
results = []
for config in configs:
    kind = TensorParallelStrategy if config.get("kind") == "tensor" else PipelineParallelStrategy
    strategy = kind(**config.get("strategy", {}))
    extra = {key: config[key] for key in OPTIONAL if config.get(key) is not None}
    result = fit(config["name"], strategy=strategy, devices=config["devices"], steps=config["steps"], **extra)
    results.append({**result, "parallel": strategy.describe()})
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
