"""Lightning strategies over one DeviceMesh; loaded on first use (see lightning_parallel/__init__.py)."""

from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.strategies.tensor import TensorParallelStrategy

__all__ = ["MeshStrategy", "PipelineParallelStrategy", "TensorParallelStrategy"]
