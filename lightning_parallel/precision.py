"""Gradient clipping by one global norm when a model's parameters are spread over several ranks.

Lightning clips with the local norm, which under pipeline parallelism differs per stage, and crashes on a mix of
DTensor and plain gradients under tensor parallelism; and each rank's GradScaler would skip fp16 steps on its own.
This module computes and applies the norm and agrees on overflow; it does not decide which process groups combine.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Replicate
from typing_extensions import override

from lightning_parallel.seams import found_inf_flags
from lightning_parallel.tensor.packed import splits_a_dimension


def clip_grad_norm_global(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    group: dist.ProcessGroup | None = None,
    shared: Container[int] = (),
) -> torch.Tensor:
    """Scale gradients in place so that their norm over all ranks of `group` is at most `max_norm`.

    Each rank passes the parameters it alone owns (e.g. its pipeline stages); the squared norms are
    summed over `group`. DTensor gradients are first summed over the mesh dimensions they are sharded
    on and counted once over those they are replicated on, so plain and DTensor parameters may mix.
    Parameters whose id is in `shared` are also held by another rank that counts them (tied weights): they
    are scaled here but not counted. Matches `torch.nn.utils.clip_grad_norm_` (L2, eps 1e-6) on one process.
    Returns the global norm before clipping.
    """
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    counted = [p.grad for p in parameters if p.grad is not None and id(p) not in shared]
    device = _local(grads[0]).device if grads else torch.device("cpu")
    # float32 explicitly: under bf16-true the default dtype would make the collective lossy.
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in counted:
        if not isinstance(g, DTensor):
            squares += g.detach().float().pow(2).sum()
    squares += _dtensor_squares([g for g in counted if isinstance(g, DTensor)], device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    total = squares.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        local = _local(g)  # a view: scaling it scales the DTensor's shard in place
        local.mul_(scale.to(local.dtype))
    return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _dtensor_squares(grads: list[DTensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of DTensor gradients over their whole meshes, each element counted once."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_layout: dict[tuple[Any, tuple[Placement, ...]], list[DTensor]] = {}
    for g in grads:
        if any(p.is_partial() for p in g.placements):  # pending sums: reduce before squaring
            g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
        by_layout.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
    for (mesh, placements), members in by_layout.items():
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for g in members:
            squares += g.to_local().detach().float().pow(2).sum()
        for dim, placement in enumerate(placements):
            if splits_a_dimension(placement) and mesh.size(dim) > 1:
                dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total += squares
    return total


def clip_grad_value_mixed(parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient element to [-clip_value, clip_value], plain and DTensor gradients alike.

    Element-wise, so each rank clamps its own shard; `torch.nn.utils.clip_grad_value_` refuses the mix.
    """
    for p in parameters:
        if p.grad is not None:
            _local(p.grad).clamp_(min=-clip_value, max=clip_value)


class AgreeingGradScaler(torch.amp.GradScaler):
    """A GradScaler whose steps every rank skips together under fp16 loss scaling.

    Each rank's scaler checks only its own gradients for inf/NaN; when one pipeline stage or tensor shard
    overflows, all must skip the step and lower the scale together. So the found-inf flags are max-reduced over
    `group` (None: every rank) right after unscaling, before clipping or `step` reads them.
    """

    def __init__(self, *args: Any, group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    @classmethod
    def like(
        cls, scaler: torch.amp.GradScaler, device: str, group: dist.ProcessGroup | None = None
    ) -> AgreeingGradScaler:
        """A copy of `scaler` (scale, growth settings and tracker) that agrees over `group`."""
        agreeing = cls(device, group=group, enabled=scaler.is_enabled())
        state = scaler.state_dict()
        if state:  # empty when disabled
            agreeing.load_state_dict(state)
        return agreeing

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        for found_inf in found_inf_flags(self, optimizer):
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
