"""lightning_parallel: pipeline and tensor parallelism as drop-in Lightning strategies.

Importing the package registers the strategies in Lightning's StrategyRegistry under their names
(`Trainer(strategy="pipeline")`) and the "gloo_host" process-group backend; the strategy code loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel import gloo_host

# public name -> module that defines it
_LAZY = {
    "PipelineParallelStrategy": "lightning_parallel.strategies.pipeline",
    "TensorParallelStrategy": "lightning_parallel.strategies.tensor",
    "AutoStrategy": "lightning_parallel.strategies.auto",
    "LocalSGDStrategy": "lightning_parallel.strategies.local_sgd",
    "DiLoCoStrategy": "lightning_parallel.strategies.diloco",
    "AsyncSGDStrategy": "lightning_parallel.strategies.async_sgd",
    "FaultTolerantStrategy": "lightning_parallel.strategies.fault_tolerant",
    "ParallelDims": "lightning_parallel.dims",
    "dry_run": "lightning_parallel.dryrun",
    "SharedCUDAAccelerator": "lightning_parallel.shared_cuda",
}
# registry name -> (class name, description)
_REGISTERED = {
    "pipeline": ("PipelineParallelStrategy", "Pipeline parallelism over torch.distributed.pipelining"),
    "tensor_parallel": ("TensorParallelStrategy", "Tensor parallelism: plans as data over DTensor parallelize_module"),
    "tensor": ("TensorParallelStrategy", "Tensor parallelism (alias of tensor_parallel)"),
    "local_sgd": ("LocalSGDStrategy", "Lightning's DDP with torch's post-local SGD (periodic parameter averaging)"),
    "diloco": ("DiLoCoStrategy", "DiLoCo: replicas step alone, an outer optimizer applies their averaged change"),
    "async_sgd": ("AsyncSGDStrategy", "Asynchronous SGD: a parameter server on rank 0 applies gradients on arrival"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_parallel' has no attribute {name!r}")


def _factory(class_name: str) -> Any:
    def build(**kwargs: Any) -> Any:
        return __getattr__(class_name)(**kwargs)

    build.__name__ = class_name
    return build


for _name, (_class_name, _description) in _REGISTERED.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _factory(_class_name), description=_description)

gloo_host.register()

__all__ = list(_LAZY)
