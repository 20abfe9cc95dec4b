"""Gradient clipping by one global norm when a model's parameters are spread over several ranks.

Lightning clips with the local norm, which under pipeline parallelism differs per stage. This module
only computes and applies the norm; it does not decide which process groups to combine.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def clip_grad_norm_global(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale gradients in place so that their norm over all ranks of `group` is at most `max_norm`.

    Each rank passes the parameters it alone owns (e.g. its pipeline stages); the squared norms are
    summed over `group`. Matches `torch.nn.utils.clip_grad_norm_` (L2, eps 1e-6) on one process.
    Returns the global norm before clipping.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    # float32 explicitly: under bf16-true the default dtype would make the collective lossy.
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares += g.detach().float().pow(2).sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    total = squares.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total
