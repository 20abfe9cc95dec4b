"""Channel-parallel CNN styles for `parallelize_module`: Conv2d sharded by output channels (column) or by input
channels with the partial outputs all-reduced (row), and BatchNorm (2d on channel, 1d on feature shards).

Only the styles live here; which module gets which style is a plan (see `plans.py`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.seams import conv_forward
from lightning_parallel.tensor.local_output import own_local

__all__ = ["BatchNormParallel", "ConvColwiseParallel", "ConvRowwiseParallel"]


class ConvColwiseParallel(ParallelStyle):
    """Shard a `Conv2d` by output channels: each rank computes its slice of the output feature map.

    Input: the full feature map (B, C_in, H, W), replicated. Output: a local tensor (B, C_out / tp, H', W') with
    this rank's channels, ready for `BatchNormParallel`, element-wise ops, pooling and `ConvRowwiseParallel`.
    Weight and bias become DTensors sharded on dim 0.

    torch 2.13's DTensor shards `aten.convolution` along the batch (or, with halos, spatial) dimension only, never
    by channel, so the convolution runs on the local weight shard; the input passes through an autograd-aware
    DTensor redistribution that is the identity forward and all-reduces the input gradient backward.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        conv = _plain_conv2d(module, type(self).__name__)
        _shard_parameter(conv, "weight", device_mesh, Shard(0), self.src_data_rank)
        _shard_parameter(conv, "bias", device_mesh, Shard(0), self.src_data_rank)
        conv.forward = partial(_column_forward, conv, device_mesh)  # type: ignore[method-assign]
        return conv


class ConvRowwiseParallel(ParallelStyle):
    """Shard a `Conv2d` by input channels: each rank convolves its channel slice, the partial sums are all-reduced.

    Input: a local channel shard (B, C_in / tp, H, W), e.g. the output of `ConvColwiseParallel`, or a DTensor.
    Output: the full feature map (B, C_out, H', W'), replicated, as a local tensor. The weight becomes a DTensor
    sharded on dim 1; the bias is replicated and added once, after the reduction.

    Implemented on local shards like `ConvColwiseParallel`: the reduction is a DTensor `Partial -> Replicate`
    redistribution (all-reduce forward, identity backward).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        conv = _plain_conv2d(module, type(self).__name__)
        _shard_parameter(conv, "weight", device_mesh, Shard(1), self.src_data_rank)
        _shard_parameter(conv, "bias", device_mesh, Replicate(), self.src_data_rank)
        conv.forward = partial(_row_forward, conv, device_mesh)  # type: ignore[method-assign]
        return conv


class BatchNormParallel(ParallelStyle):
    """`BatchNorm2d` on channel shards, `BatchNorm1d` on feature shards: weight, bias and running statistics become
    DTensors sharded on dim 0.

    Input: a local shard (B, C / tp, H, W) after `ConvColwiseParallel`, or (B, F / tp) after a column-parallel
    Linear, or a DTensor. Output: the local shard. Statistics are per channel, so this needs no communication.
    DTensor has channel-sharding rules for batch norm, but the local tensor it hands back is a view that an
    in-place ReLU (as in ResNet) may not modify, so the functional batch norm runs on the local shards instead.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
            raise ValueError(
                f"{type(self).__name__} shards nn.BatchNorm1d / nn.BatchNorm2d, got {type(module).__name__}"
            )
        for key in ("weight", "bias"):
            _shard_parameter(module, key, device_mesh, Shard(0), self.src_data_rank)
        for key in ("running_mean", "running_var"):
            buffer = module._buffers.get(key)
            if buffer is not None:
                module._buffers[key] = distribute_tensor(
                    buffer, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank
                )
        module.forward = partial(_norm_forward, module, device_mesh)  # type: ignore[method-assign]
        return module


def _plain_conv2d(module: nn.Module, style: str) -> nn.Conv2d:
    if not isinstance(module, nn.Conv2d) or module.groups != 1:
        found = type(module).__name__ + (f" with groups={module.groups}" if isinstance(module, nn.Conv2d) else "")
        raise ValueError(f"{style} shards an nn.Conv2d with groups=1, got {found}")
    return module


def _shard_parameter(
    module: nn.Module, name: str, mesh: DeviceMesh, placement: Shard | Replicate, src_data_rank: int | None
) -> None:
    param = getattr(module, name)
    if param is None:
        return
    sharded = distribute_tensor(param.data, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_or_none(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else _local(tensor)


def _column_forward(conv: nn.Conv2d, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    full = (
        x.redistribute(mesh, [Replicate()])
        if isinstance(x, DTensor)
        else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    )
    # Identity forward; backward, each rank's input gradient covers only its output channels: sum them.
    x = full.to_local(grad_placements=[Partial()])  # (B, C_in, H, W)
    return conv_forward(conv)(x, _local(conv.weight), _local_or_none(conv.bias))  # (B, C_out / tp, H', W')


def _row_forward(conv: nn.Conv2d, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    if isinstance(x, DTensor):
        x = x.redistribute(mesh, [Shard(1)]).to_local()  # (B, C_in / tp, H, W)
    partial_sum = conv_forward(conv)(x, _local(conv.weight), None)  # (B, C_out, H', W'), this rank's inputs only
    out = DTensor.from_local(
        partial_sum, mesh, [Partial()], run_check=False
    ).full_tensor()  # all-reduce; gradient passes through
    bias = _local_or_none(conv.bias)
    return own_local(out) if bias is None else out + bias.view(1, -1, 1, 1)  # no view: model code may change it


def _norm_forward(bn: nn.BatchNorm1d | nn.BatchNorm2d, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    if isinstance(x, DTensor):
        x = x.redistribute(mesh, [Shard(1)]).to_local()  # (B, C / tp, H, W) or (B, F / tp)
    # As nn.BatchNorm2d.forward, on this rank's channels.
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    use_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    return F.batch_norm(
        x,
        _local_or_none(bn.running_mean) if track else None,
        _local_or_none(bn.running_var) if track else None,
        _local_or_none(bn.weight),
        _local_or_none(bn.bias),
        use_batch_stats,
        factor,
        bn.eps,
    )
