"""Keeping replicas equal over one process group: start them from the first one's values, average what drifts.
Torch only; the strategies decide which group (all processes, "dp", "tp") and when."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["average_", "broadcast_module", "reduce_as_one_"]


@torch.no_grad()
def average_(tensors: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Replace each tensor by its mean over `group` (None: the default group): one float32 all-reduce per device,
    so low-precision values are summed without rounding each partial sum."""
    size = dist.get_world_size(group)
    if size == 1:  # the mean of one replica is itself: no copy, no collective
        return

    def mean_over_group(flat: Tensor) -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)  # gloo has no ReduceOp.AVG
        flat /= size

    reduce_as_one_(tensors, mean_over_group)


@torch.no_grad()
def reduce_as_one_(tensors: Sequence[Tensor], reduce_: Callable[[Tensor], None]) -> None:
    """Copy `tensors` into one float32 buffer per device, let `reduce_` change it in place (one collective per
    device), and copy the result back into each tensor."""
    buckets: dict[torch.device, list[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.device, []).append(tensor)
    for bucket in buckets.values():
        flat = torch.cat([t.reshape(-1).float() for t in bucket])  # (sum of numels,)
        reduce_(flat)
        for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            tensor.copy_(part.view_as(tensor))


@torch.no_grad()
def broadcast_module(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of `group` (None: all) the parameters and buffers of the group's first rank."""
    if dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=source, group=group)
