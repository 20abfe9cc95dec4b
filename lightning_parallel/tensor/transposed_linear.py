"""torch's column and row styles for a Linear whose weight is stored transposed, (in, out): transformers' `Conv1D`
(GPT-2's projections), found by class name (`Conv1D` here; this library does not import transformers).

torch's `ColwiseParallel` / `RowwiseParallel` take nn.Linear / nn.Embedding only and shard the weight's dim 0 / 1; a
transposed weight needs the other dimension. Only the partitioning differs: inputs and outputs are laid out by
torch's own style, and DTensor computes the module's `addmm` on the shards. Which module gets a style is a plan.
"""

from __future__ import annotations

from abc import ABC
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.tensor.local_output import OwnOutputColwise, OwnOutputRowwise

__all__ = ["TRANSPOSED_STYLES", "Conv1D"]


class Conv1D(ABC):  # noqa: B024 - a marker recognised by __subclasshook__, nothing to implement
    """transformers' `Conv1D` (GPT-2's projections), recognised by class name (this library does not import
    transformers): a Linear whose weight is stored transposed, (in `nx`, out `nf`), computed as
    `addmm(bias, x, weight)`. torch's styles take nn.Linear only: this file has its column and row styles,
    `packed.py` its interleaved column style, and traced pipeline stages compute on its DTensor shards."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        return other.__name__ == "Conv1D" and issubclass(other, nn.Module)


def _partition(placements: dict[str, Placement]):  # noqa: ANN202 - distribute_module's partition_fn
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, placement in placements.items():
            param = getattr(module, key, None)
            if param is not None:
                sharded = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
                module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))

    return partition


class TransposedColwiseParallel(OwnOutputColwise):
    """Shard output features: the weight's dim 1 and the bias; the input replicated, the output a local shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            _partition({"weight": Shard(1), "bias": Shard(0)}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class TransposedRowwiseParallel(OwnOutputRowwise):
    """Shard input features: the weight's dim 0; the bias replicated and added once; the output all-reduced (no view,
    `local_output.py`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # as torch's style sets for nn.Linear: the input's features split
        return distribute_module(
            module,
            device_mesh,
            _partition({"weight": Shard(0), "bias": Replicate()}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


# style name -> the torch style for a transposed Linear (without sequence parallelism)
TRANSPOSED_STYLES: dict[str, type[ParallelStyle]] = {
    "colwise": TransposedColwiseParallel,
    "rowwise": TransposedRowwiseParallel,
}
