"""A column-parallel style for a projection whose output packs equal blocks side by side (a fused q | k | v, or
gate | up): each rank keeps its share of every block, so it holds whole heads of q, of k and of v, not q and half of k.

The weight (and bias) are split as torch's `_StridedShard` (an interleaved shard: `full_tensor()` and checkpoints see
the original layout) and DTensor computes the layer; its output leaves as this rank's [q_r | k_r | v_r]. nn.Linear
and transformers' Conv1D (weight stored (in, out)). Which module gets it, and how many blocks, is a plan's business.
Checkpoints see those shards as contiguous ones (`savable`, `copy_back`): torch.distributed.checkpoint cannot save them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from lightning_parallel.seams import refuse_older_torch
from lightning_parallel.tensor.local_output import own_local
from lightning_parallel.tensor.transposed_linear import Conv1D

__all__ = ["PackedColwiseParallel", "copy_back", "savable", "splits_a_dimension"]


def splits_a_dimension(placement: Placement) -> bool:
    """Whether ranks hold different parts of a dimension: a `Shard`, or the interleaved `_StridedShard` of a packed
    q | k | v or of FSDP2 over tensor parallelism, no `Shard` subclass in torch 2.13 (`is_shard()` misses it)."""
    return isinstance(placement, Shard | _StridedShard)


class PackedColwiseParallel(ParallelStyle):
    """Shard the output features of a Linear / Conv1D packed as `pieces` equal blocks, block by block.

    Args:
        pieces: Equal blocks along the output features (3 for q | k | v).
        input_layouts: How the input arrives: replicated, or split along the sequence (sequence parallelism).
    """

    def __init__(self, pieces: int, *, input_layouts: Placement | None = None) -> None:
        super().__init__()
        self.pieces = pieces
        self.input_layouts = input_layouts or Replicate()

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        refuse_older_torch(
            "a fused projection split by heads (qkv_colwise, packed_colwise)",
            f"leave {name or type(module).__name__} out of the tensor plan (it then stays whole on every rank)",
        )
        out_dim = 1 if isinstance(module, Conv1D) else 0  # Conv1D stores (in, out)
        for key, dim in (("weight", out_dim), ("bias", 0)):
            param = module._parameters.get(key)
            if param is not None:
                placement = _StridedShard(dim, split_factor=self.pieces)
                value = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
                module.register_parameter(key, nn.Parameter(value, requires_grad=param.requires_grad))

    def _prepare_input(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layouts], run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=[Replicate()])  # sequence shards gathered (all-gather)
        return (x, *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        expected = _StridedShard(output.ndim - 1, split_factor=self.pieces)
        if output.placements != (expected,):  # DTensor's linear / addmm rules keep the weight's interleaving
            raise RuntimeError(
                f"packed column-parallel {type(module).__name__}: DTensor gave the output placements "
                f"{output.placements}, not {expected}. HINT: map the layer to 'colwise_gather' instead"
            )
        return own_local(
            output.to_local()
        )  # (..., pieces * out / pieces / tp): this rank's share of every block, no view

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear | Conv1D):
            raise ValueError(f"packed column-parallel styles take nn.Linear or Conv1D, not {type(module).__name__}")
        # torch types the hooks as returning None, but uses what they return (as its own styles do)
        prepare_input: Any = self._prepare_input
        prepare_output: Any = self._prepare_output
        return distribute_module(module, device_mesh, self._partition, prepare_input, prepare_output)


def savable(state: Any) -> Any:
    """`state` (nested dicts / lists) with each interleaved shard seen as the contiguous shard of the same tensor:
    torch.distributed.checkpoint describes a rank's shard by one offset and size, which an interleaved one has not
    (a redistribution, at save and load only). Other values are the same objects."""
    return pytree.tree_map_only(DTensor, _contiguous, state)


def copy_back(state: Any, view: Any) -> None:
    """Copy what was loaded into `savable(state)` back into `state`: its new tensors into the interleaved shards, and
    every value the load replaced rather than filled in (an optimizer's learning rate, a step count) as it is."""
    keys = state.keys() if isinstance(state, dict) else range(len(state))
    for key in keys:
        original, loaded = state[key], view[key]
        if isinstance(original, DTensor) and loaded is not original:
            with torch.no_grad():
                original.copy_(loaded)  # DTensor redistributes to the original's placements
        elif isinstance(original, dict | list):
            copy_back(original, loaded)
        elif loaded is not original:
            state[key] = loaded


def _contiguous(tensor: DTensor) -> DTensor:
    if not any(isinstance(p, _StridedShard) for p in tensor.placements):
        return tensor
    placements = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in tensor.placements]
    moved = tensor.redistribute(tensor.device_mesh, placements)
    local = moved.to_local()
    if local.storage_offset() == 0 and local.untyped_storage().nbytes() == local.numel() * local.element_size():
        return moved
    # The redistribution may hand back a view into its gathered buffer (FSDP2 over conv_colwise, tensor rank 1:
    # ResNet-18's layer3/4 conv1). A DTensor over a view that starts past its storage's start is one DCP's background
    # staging cannot copy (torch's StateDictStager takes it for a plain tensor: "copy_() on an invalid python
    # storage"), and the view would keep the whole buffer (tp x the shard) until the write ends: a compact copy.
    with torch.no_grad():
        local = local.clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(
        local, moved.device_mesh, moved.placements, run_check=False, shape=moved.shape, stride=moved.stride()
    )
