"""Row-parallel projections hand model code their all-reduced output as a tensor of its own over the same memory (no
copy), not torch's view, so model code may change it in place (Falcon's `mlp_output += attention_output`, or a user's
`out += residual`) and stays exact. It changes nothing else of torch's `RowwiseParallel`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor.parallel import RowwiseParallel

__all__ = ["OwnOutputRowwise"]


class _Unviewed(torch.autograd.Function):
    """Identity whose output is no view: `to_local` returns a view made inside its custom autograd Function, and
    autograd refuses any in-place change of such a view (it would bypass that Function's backward). `detach` is a
    plain tensor over the same memory, sharing its version counter; its gradient passes through as is."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor) -> torch.Tensor:  # noqa: ANN401 - torch's ctx
        return view.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN401 - torch's ctx
        return grad


class OwnOutputRowwise(RowwiseParallel):
    """torch's `RowwiseParallel` whose local output is not a view. Sound where its output is redistributed (a partial
    sum becomes a sum or a shard, always for a row-parallel Linear): the redistributed DTensor is a fresh temporary
    that no autograd node saves, so changing its memory in place changes the output's own. Under `torch.no_grad`
    `to_local` already returns no view. One graph under `torch.compile` (no break), as `RowwiseParallel`."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN205 - torch's signature
        fresh = outputs.placements != output_layouts  # redistributed: a new tensor
        local = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return _Unviewed.apply(local) if fresh and use_local_output and torch.is_grad_enabled() else local
