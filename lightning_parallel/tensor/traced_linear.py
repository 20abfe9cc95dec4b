"""The `aten.linear` of a planned layer inside a traced stage (`traced_stages.py`), as its style runs outside a
trace: a `vocab_head` takes its input whole; other planned layers take and leave no partial sums, a row-parallel one
its input split, so each weight's gradient is a shard like the weight. Unplanned linears go to DTensor as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

aten = torch.ops.aten


def sharded(tensor: Any) -> bool:
    """Whether `tensor` is a DTensor split along some dimension (a planned layer's weight)."""
    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements)


def head_linear(input: Any, weight: Any, bias: Any = None) -> Any:
    """A `vocab_head`'s `aten.linear` takes its input whole, as its style does outside a trace, so its logits come out
    split by vocabulary: left to itself DTensor may move the weight instead (partial sums arriving from a traced
    Llama's last norm made it gather the head's weight and return partial sums: whole-sized logits on every rank)."""
    if isinstance(input, DTensor) and sharded(weight):
        input = input.redistribute(input.device_mesh, [Replicate()])
    return aten.linear.default(input, weight, bias)


def planned_linear(input: Any, weight: Any, bias: Any = None) -> Any:
    """`aten.linear` of a planned layer (its weight sharded) as its style runs outside a trace: no partial sums in or
    out, and a row-parallel layer's input split by features (a whole one sliced locally; its gradient all-gathered in
    backward, as before). Left to itself DTensor carries partial sums through a residual add and an RMSNorm's scaling
    into the next layer and multiplies a whole input into a row-parallel weight's gradient, so backward made weight
    gradients whole-sized on every rank (2 x a Llama-3-70B tp8 MLP weight, 896 MiB each); here each is a shard."""
    if not sharded(weight) or not isinstance(input, DTensor):
        return aten.linear.default(input, weight, bias)
    input = _summed(input)
    if weight.placements == (Shard(1),) and input.placements == (Replicate(),):  # rowwise: split by in-features
        input = input.redistribute(input.device_mesh, [Shard(input.ndim - 1)])
    return _summed(aten.linear.default(input, weight, bias))


def _summed(value: Any) -> Any:
    """A DTensor's partial sums summed (Partial -> Replicate), its gradient too: Redistribute's backward hands a
    Partial gradient on Partial, which the matmul making `value` would turn into a whole-sized weight gradient."""
    if not (isinstance(value, DTensor) and any(p.is_partial() for p in value.placements)):
        return value
    mesh, summed = value.device_mesh, [Replicate() if p.is_partial() else p for p in value.placements]
    local = value.to_local(grad_placements=summed)  # each rank's part: its gradient is the sum's, whole
    parts = DTensor.from_local(local, mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
    return parts.redistribute(mesh, summed)  # from_local's backward sums a Partial gradient (torch >= 2.13)
