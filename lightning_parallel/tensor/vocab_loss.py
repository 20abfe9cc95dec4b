"""Cross-entropy on logits split by vocabulary over "tp", never gathered: per token three all-reduces of one number
(largest logit, sum of exponentials, target's logit), as Megatron and torchtitan do, and a local backward. It decides
nothing about when it applies (`sharded_logits.py` routes `F.cross_entropy` here) and shards nothing."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """(M, V / tp) local logits, (M,) targets -> (M,) per-token losses (0 where the target is ignored)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, ignore_index: int, group: Any
    ) -> torch.Tensor:
        logits = logits.float()  # computed in fp32 whatever the logits' dtype, as a fused kernel would
        largest = logits.detach().amax(-1)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)  # 1: the largest logit over the vocabulary
        shifted = logits - largest.unsqueeze(-1)
        valid = target != ignore_index
        # the target's column in this rank's shard, where it lies in it (the offset as a tensor made from the logits:
        # one rank's number under torch's one-process simulation of ranks, where a plain int could not be)
        local = target - logits.new_full((), start, dtype=target.dtype)
        here = valid & (local >= 0) & (local < logits.shape[-1])
        column = torch.where(here, local, torch.zeros_like(local))
        picked = shifted.gather(-1, column.unsqueeze(-1)).squeeze(-1) * here  # read before exp_ overwrites it
        # in place: the logits and one (M, V / tp) copy at once, not two (the same numbers as an exp() beside it)
        exp = shifted.exp_()
        total = exp.sum(-1)
        dist.all_reduce(total, group=group)  # 2: the sum of exponentials over the vocabulary
        dist.all_reduce(picked, group=group)  # 3: the target's logit, found on one rank
        ctx.save_for_backward(exp, total, column, here, valid)
        return torch.where(valid, total.log() - picked, torch.zeros_like(picked))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        exp, total, column, here, valid = ctx.saved_tensors
        softmax = exp / total.unsqueeze(-1)
        softmax.scatter_add_(-1, column.unsqueeze(-1), -here.to(softmax.dtype).unsqueeze(-1))
        # in place: the saved exponentials and one (M, V / tp) copy at once, not two
        return softmax.mul_((grad * valid).unsqueeze(-1)), None, None, None, None


def sharded_class_dim(input: torch.Tensor) -> int | None:
    """The class dimension of `F.cross_entropy`'s input when it is a DTensor split along it over one mesh dimension
    (our vocabulary-sharded logits after views), else None."""
    if not isinstance(input, DTensor) or input.device_mesh.ndim != 1:
        return None
    dim = 1 if input.dim() > 1 else 0
    (placement,) = input.placements
    return dim if isinstance(placement, Shard) and placement.dim % input.dim() == dim else None


def cross_entropy_on_shards(
    input: DTensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """`F.cross_entropy(input, target, ignore_index=..., reduction=...)` for `input` (N, C, ...) or (C,) split along
    C (`sharded_class_dim`), `target` integer class indices, whole on every rank; returns a plain tensor, the same on
    every rank of the split. Class weights, label smoothing and probability targets are not handled here."""
    dim = 1 if input.dim() > 1 else 0
    mesh = input.device_mesh
    start = _shard_start(input.shape[dim], mesh.size(), mesh.get_local_rank())
    local = input.to_local().movedim(dim, -1)  # (N, ..., C / tp)
    losses = _VocabParallelCrossEntropy.apply(
        local.reshape(-1, local.shape[-1]), target.reshape(-1), start, ignore_index, mesh.get_group()
    )
    # under autocast (precision="bf16-mixed") torch's cross-entropy runs and returns fp32 (autocast's fp32 list):
    # so does this one; otherwise it returns the logits' dtype
    losses = losses.to(torch.float32 if torch.is_autocast_enabled(input.device.type) else input.dtype)
    if reduction == "none":
        return losses.reshape(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()  # 0 / 0 = nan with every target ignored, as torch's


def _shard_start(size: int, parts: int, rank: int) -> int:
    """Where rank `rank`'s piece of a dimension of `size` split by `Shard` over `parts` starts: torch.chunk's rule
    (pieces of ceil(size / parts), the last ones shorter or empty). Plain arithmetic, where torch's
    `compute_local_shape_and_global_offset` reads its offsets back from tensors, which fake tensors cannot answer."""
    return min(-(-size // parts) * rank, size)
