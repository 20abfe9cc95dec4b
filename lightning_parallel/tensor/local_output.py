"""Column- and row-parallel Linear / Embedding layers hand model code their local output as a tensor of its own over
the same memory (no copy), not torch's view, so model code may change it in place (`nn.ReLU(inplace=True)` after a
column-parallel layer, Falcon's `mlp_output += attention_output` or a user's `out += residual` after a row-parallel
one) and stays exact. It changes nothing else of torch's `ColwiseParallel` / `RowwiseParallel`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = ["OwnOutputColwise", "OwnOutputRowwise", "own_local"]


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


def own_local(local: Any) -> Any:  # noqa: ANN401 - a style's output: a tensor, or a DTensor left as is
    """A style's `to_local()` result as no view (a DTensor output, `use_local_output=False`, passes as is). Sound only
    where no autograd node saves the DTensor it came from (the result of a linear, an embedding or a redistribution:
    their backward reads their inputs), so changing its memory in place changes the returned tensor's own. Under
    `torch.no_grad` `to_local` already returns no view. One graph under `torch.compile` (no break), as `to_local`."""
    if isinstance(local, DTensor) or not torch.is_grad_enabled():
        return local
    return _Unviewed.apply(local)


class OwnOutputColwise(ColwiseParallel):
    """torch's `ColwiseParallel` (a Linear's or Embedding's output features split, gathered where asked) whose local
    output is no view (`own_local`)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN205 - torch's signature
        return own_local(
            ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        )


class OwnOutputRowwise(RowwiseParallel):
    """torch's `RowwiseParallel` (a partial sum all-reduced, or reduce-scattered) whose local output is no view
    (`own_local`)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN205 - torch's signature
        return own_local(
            RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        )
