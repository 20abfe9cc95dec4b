"""The "head_norm" style (transformers' `replicated_with_grad_allreduce`): a norm over each of this rank's heads between
a column-parallel projection and attention (Qwen3's, Gemma-3's q_norm / k_norm), its weight whole on every rank and its
gradient summed over the ranks. It splits no parameter, and does nothing in traced stages (they see every head).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["HeadNorm"]


class HeadNorm(ParallelStyle):
    """Keep a per-head norm's parameters whole on every rank, with their gradients summed over the ranks' heads.

    The parameters become Replicate DTensors and the input enters as this rank's heads (a shard of the dimension before
    the normalised last one), so DTensor computes the weight's gradient as the partial sum over this rank's heads and
    `plans.keep_gradients_sharded` all-reduces it: every rank holds what one process computes over all heads. The
    output leaves as a local tensor, as the input came.
    """

    @staticmethod
    def _replicate(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            value = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=None)
            module.register_parameter(key, nn.Parameter(value, requires_grad=param.requires_grad))

    @staticmethod
    def _heads_in(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if x.ndim < 2:
            raise ValueError(
                f"head_norm: {type(module).__name__} got a {x.ndim}-D input; it normalises the last dimension of "
                "(..., heads, head_dim). HINT: map this module to 'replicate'"
            )
        # (..., heads / tp, head_dim): this rank's heads
        return (DTensor.from_local(x, mesh, [Shard(x.ndim - 2)], run_check=False), *inputs[1:])

    @staticmethod
    def _local_out(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch types the hooks as returning None, but uses what they return (as its own styles do)
        heads_in: Any = self._heads_in
        local_out: Any = self._local_out
        return distribute_module(module, device_mesh, self._replicate, heads_in, local_out)
