"""Scaled-dot-product attention inside a traced stage (`traced_stages.py`): by each rank's own heads when q, k and v
arrive split by heads (column-parallel projections viewed to heads, or a packed q | k | v split by `split_packed`), so
the output leaves split by heads for the row-parallel output projection; whole on every rank otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

aten = torch.ops.aten


def attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """`aten.scaled_dot_product_attention` on DTensors: each rank attends with its own heads when q, k and v are
    split evenly by heads (a head's attention needs only that head's q, k and v) and nothing drops, its output split
    by heads; else whole on every rank (`whole`)."""
    rest = {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    mask = _local_mask(attn_mask, query) if _split_by_heads(query, key, value) and not dropout_p else None
    if mask is None:
        return whole(query, key, value, attn_mask, **rest)
    mesh = query.device_mesh
    local = aten.scaled_dot_product_attention.default(
        query.to_local(), key.to_local(), value.to_local(), mask[0], **rest
    )  # (B, H / tp, T, D_v): this rank's heads
    # global shape and strides from the local ones (even heads): a stride taken as is would make the transpose and
    # reshape before the output projection copy the output
    return DTensor.from_local(local, mesh, [Shard(query.ndim - 3)], run_check=False)


def whole(*args: Any, **kwargs: Any) -> Any:
    """Attention on whole tensors on every rank: a q / k / v split otherwise (a fused q|k|v projection's output
    gathered, heads that do not divide, dropout, which must draw one device's mask over every head) is all-gathered
    first, and every rank holds and computes every head's attention."""
    mesh = _mesh_of(args, kwargs)
    if mesh is None:
        return aten.scaled_dot_product_attention.default(*args, **kwargs)
    args, kwargs = pytree.tree_map_only(
        DTensor, lambda t: t.redistribute(mesh, [Replicate()]).to_local(), (args, kwargs)
    )
    out = aten.scaled_dot_product_attention.default(*args, **kwargs)
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False)


def split_packed(tensor: Any, split_size: int, dim: int = 0) -> Any:
    """`aten.split.Tensor` of a packed q | k | v projection's output (qkv_colwise: each rank holds its share of each
    block, a `_StridedShard` with one piece per block) into its blocks: each rank splits its own share, so q, k and v
    come out split by features (heads) with no all-gather; DTensor's rule gathers them whole. Anything else as DTensor
    splits it."""
    if not isinstance(tensor, DTensor) or len(tensor.placements) != 1:
        return aten.split.Tensor(tensor, split_size, dim)
    dim, placement, size = dim % tensor.ndim, tensor.placements[0], tensor.device_mesh.size()
    pieces = placement.split_factor if isinstance(placement, _StridedShard) and placement.dim == dim else 0
    if not (pieces and tensor.shape[dim] == pieces * split_size and split_size % size == 0):
        return aten.split.Tensor(tensor, split_size, dim)
    parts = tensor.to_local().split(split_size // size, dim)  # this rank's share of each block
    return tuple(DTensor.from_local(part, tensor.device_mesh, [Shard(dim)], run_check=False) for part in parts)


def _split_by_heads(query: Any, key: Any, value: Any) -> bool:
    """Whether q, k and v (..., heads, tokens, head size) are DTensors on one mesh of one dimension, each Shard on its
    heads dimension in even parts (torch.chunk's uneven last part would pair a rank's q heads with others' k heads)."""
    if not all(isinstance(t, DTensor) for t in (query, key, value)) or query.device_mesh.ndim != 1:
        return False
    size = query.device_mesh.size()
    for t in (query, key, value):
        dim = t.ndim - 3
        if t.device_mesh != query.device_mesh or t.placements != (Shard(dim),) or t.shape[dim] % size:
            return False
    return True


def _local_mask(mask: Any, query: DTensor) -> tuple[Any] | None:
    """This rank's part of an attention mask, in a 1-tuple (None: attend whole): a mask broadcast over heads (no
    heads dimension, or one of size 1) whole, a mask per head its rank's heads (Replicate to Shard is a local slice).
    Its gradient, if it has one: a broadcast mask's is each rank's heads' part of a sum (Partial)."""
    if not isinstance(mask, DTensor):
        return (mask,) if mask is None or not isinstance(mask, torch.Tensor) else None  # a plain tensor: no mesh
    mesh: DeviceMesh = query.device_mesh
    if mask.device_mesh != mesh:
        return None
    heads = mask.ndim - 3
    if mask.ndim < 3 or mask.shape[heads] == 1:
        return (mask.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]),)
    if mask.shape[heads] == query.shape[query.ndim - 3]:
        return (mask.redistribute(mesh, [Shard(heads)]).to_local(),)
    return None


def _mesh_of(*values: Any) -> DeviceMesh | None:
    return next((v.device_mesh for v in pytree.tree_leaves(values) if isinstance(v, DTensor)), None)
