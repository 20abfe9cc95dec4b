"""A planned layer's matmul inside a traced stage (a Linear's `aten.linear`, a transformers `Conv1D`'s `aten.addmm`) as
its style runs outside a trace: a `vocab_head` takes its input whole; others take and leave no partial sums, a
row-parallel one its input split, their output's gradient placed like it: weight gradients are shards. Others: DTensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lightning_parallel.tensor.packed import splits_a_dimension

aten = torch.ops.aten


def sharded(tensor: Any) -> bool:
    """Whether `tensor` is a DTensor split along some dimension (a planned layer's weight, packed q | k | v too)."""
    return isinstance(tensor, DTensor) and any(splits_a_dimension(p) for p in tensor.placements)


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
    return _settled(aten.linear.default(_layer_input(input, weight, Shard(1)), weight, bias))


def planned_addmm(bias: Any, input: Any, weight: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    """`aten.addmm(bias, input, weight)` with a sharded `weight` (stored (in, out): a transformers `Conv1D`, GPT-2's
    projections) as `planned_linear`, its row-parallel weight Shard(0). Left to DTensor, a row-parallel `c_proj` took
    the attention's whole output into its weight's gradient, and a `c_attn` whose q | k | v are split apart (gathered)
    got its output's gradient whole: both weight gradients were whole-sized on every rank; here each is a shard."""
    if not sharded(weight) or not isinstance(input, DTensor):
        return aten.addmm.default(bias, input, weight, beta=beta, alpha=alpha)
    out = aten.addmm.default(bias, _layer_input(input, weight, Shard(0)), weight, beta=beta, alpha=alpha)
    return _settled(out)


def _layer_input(input: DTensor, weight: DTensor, rowwise: Placement) -> DTensor:
    """A planned layer's input: its partial sums summed, and split by features when the weight is `rowwise` (split
    along its input features) and the input whole."""
    input = summed(input)
    if weight.placements == (rowwise,) and input.placements == (Replicate(),):
        input = input.redistribute(input.device_mesh, [Shard(input.ndim - 1)])
    return input


def summed(value: Any) -> Any:
    """A DTensor's partial sums summed (Partial -> Replicate), its gradient too: Redistribute's backward hands a
    Partial gradient on Partial, which the matmul making `value` would turn into a whole-sized weight gradient. Other
    values as they are. The one reduction of partial sums in traced stages (a planned layer's input, dropout's)."""
    if not (isinstance(value, DTensor) and any(p.is_partial() for p in value.placements)):
        return value
    return _settled(value)


def _settled(value: DTensor) -> DTensor:
    """A planned layer's output: partial sums summed and its gradient placed like the result (a Replicate's summed,
    a shard's a shard): left to DTensor it arrives as the consumers made it (a Replicate after GPT-2's split of q | k |
    v gathered them), which the matmul making `value` turns into a whole-sized weight gradient."""
    mesh, placements = value.device_mesh, tuple(Replicate() if p.is_partial() else p for p in value.placements)
    if placements != value.placements:
        value = value.redistribute(mesh, placements)  # backward: keeps a Replicate gradient Replicate
    # an identity whose backward places the gradient as `placements` (from_local's backward redistributes it so)
    local = value.to_local()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride())
