"""How a mesh strategy sets up its network, one named step after another (`order.py`): split -> plan -> prune ->
materialise and shard -> tie -> activation checkpointing -> compile -> replicas (-> deferred BatchNorm), each step
in its own module. Torch only: the strategies (`strategies/`) hand in their sizes, mesh and arguments."""

from lightning_parallel.parallelize.order import (
    PipelineSetUp,
    SetUp,
    TensorSetUp,
    parallelize_pipeline,
    parallelize_tensor,
)

__all__ = ["PipelineSetUp", "SetUp", "TensorSetUp", "parallelize_pipeline", "parallelize_tensor"]
