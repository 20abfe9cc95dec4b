"""Parameters shared by blocks on different pipeline ranks (an embedding tied to the output head), kept tied.

Each rank that uses such a parameter holds its own copy after pruning. As Megatron does for embeddings, the
copies start from one value and their gradient contributions are summed between the holders before every
optimizer step, so the copies stay identical and equal one process's single parameter. A copy sharded over "tp"
(a DTensor, sharded alike on every holder: `shard_dim`) is tied shard by shard. Torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class TiedGroup:
    """One parameter used on several pipeline ranks.

    Args:
        names: every qualified name the parameter has in the network (one per module holding it).
        ranks: the pipeline ranks holding a block that uses it.
        source: the rank whose value every holder starts from: the one holding the last block that uses it,
            because name-keyed initialisation on one process leaves the value of the last module initialised.
        shape / dtype: the parameter's, so ranks without it can join the collectives.
        shard_dim: the dimension every holder shards it on over "tp" (a DTensor's Shard), None when held whole.
    """

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    source: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard_dim: int | None = None

    def local_shape(self, tp_rank: int, tp_size: int) -> tuple[int, ...]:
        """The shape of tensor rank `tp_rank`'s part: DTensor's Shard, torch.chunk's sizes (the last ones shorter)."""
        if self.shard_dim is None:
            return self.shape
        size = self.shape[self.shard_dim]
        chunk = -(-size // tp_size)
        shape = list(self.shape)
        shape[self.shard_dim] = max(0, min(chunk, size - tp_rank * chunk))
        return tuple(shape)


def local_parameter(network: nn.Module, group: TiedGroup) -> nn.Parameter | None:
    """This rank's copy of the shared parameter (under whichever of its names survived pruning), or None."""
    for name in group.names:
        try:
            return network.get_parameter(name)
        except AttributeError:
            continue
    return None


def broadcast_tied_values(
    network: nn.Module, groups: Sequence[TiedGroup], pp_group: dist.ProcessGroup, tp: tuple[int, int] = (0, 1)
) -> None:
    """Give every holder the source rank's value (the ranks not holding it join with a scratch tensor). `tp`: this
    rank's (tensor rank, tensor size); a sharded copy is broadcast between the holders' parts of one tensor rank."""
    for tied in groups:
        param = local_parameter(network, tied)
        device = _device(network)
        if param is not None:
            buffer = _local(param).detach().clone()
        else:
            buffer = torch.empty(tied.local_shape(*tp), dtype=tied.dtype, device=device)
        dist.broadcast(buffer, group_src=tied.source, group=pp_group)
        if param is not None:
            with torch.no_grad():
                _local(param).copy_(buffer)


def sum_tied_gradients(
    network: nn.Module, groups: Sequence[TiedGroup], pp_group: dist.ProcessGroup, tp: tuple[int, int] = (0, 1)
) -> None:
    """Sum each shared parameter's gradient over the pipeline ranks; every holder gets the total (of its part, for a
    copy sharded over "tp": the holders' parts of one tensor rank are the same rows)."""
    for tied in groups:
        param = local_parameter(network, tied)
        if param is not None and param.grad is not None:
            total = _local(param.grad).detach().float().clone()
        else:
            total = torch.zeros(tied.local_shape(*tp), dtype=torch.float32, device=_device(network))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        if param is None:
            continue
        grad = total.to(param.dtype)
        if isinstance(param, DTensor):
            grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)
        param.grad = grad


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def counted_elsewhere(network: nn.Module, groups: Sequence[TiedGroup], rank: int) -> set[int]:
    """Ids of the shared parameters this rank holds but another rank counts in a global gradient norm."""
    ids = set()
    for tied in groups:
        param = local_parameter(network, tied)
        if param is not None and rank != min(tied.ranks):
            ids.add(id(param))
    return ids


def _device(network: nn.Module) -> torch.device:
    first = next(iter(network.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def refuse_ties_within_a_rank(
    tied: dict[str, list[str]], stages: Sequence[Sequence[str]], stage_to_rank: Sequence[int], schedule: str
) -> None:
    """Refuse a split-backward schedule when one rank runs two stages that read one parameter (an embedding tied to
    the head, both on rank 0 in a V layout): torch's split backward then leaves that parameter a wrong gradient
    (measured on a tied GPT-2 under zbv: losses 4e-3 apart after 3 steps), so the run would be silently wrong.

    Args:
        tied: parameter name -> the blocks that read it (``tied_blocks()`` of the split).
        stages / stage_to_rank: the partition's.
    """
    stage_of = {block: index for index, blocks in enumerate(stages) for block in blocks}
    for name, blocks in tied.items():
        by_rank: dict[int, set[int]] = {}
        for block in blocks:
            by_rank.setdefault(stage_to_rank[stage_of[block]], set()).add(stage_of[block])
        for rank, held in by_rank.items():
            if len(held) > 1:
                raise ValueError(
                    f"schedule={schedule!r} splits the backward, and parameter {name!r} is read in stages "
                    f"{sorted(held)} (blocks {blocks}), all on pipeline rank {rank}; torch's split backward would "
                    "give it a wrong gradient. HINT: use schedule='interleaved_zero_bubble' or 'interleaved_1f1b', or "
                    "untie the weights (e.g. tie_word_embeddings=False)"
                )
