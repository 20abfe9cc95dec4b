"""The "vocab_parallel" style: an `nn.Embedding` sharded by vocabulary that looks up its own rows and sums the ranks'
partial outputs, so its backward gives each rank the gradient of its own rows only (a Shard(0) DTensor). Torch's
`RowwiseParallel` leaves the lookup to DTensor, whose embedding backward (torch 2.13) has no vocabulary-sharded rule
and makes the whole vocabulary x width gradient on every rank (2 GiB fp32 at Llama-3's 128,256 x 4,096).

Exact against one device: a token outside a rank's rows reads row 0 and is zeroed (forward and backward), and the
all-reduce adds one non-zero term per element. One lookup (`lookup_own_rows`) for the module's own forward and for
traced pipeline stages' `aten.embedding` (`traced_stages.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from lightning_parallel.one_process_ranks import per_rank
from lightning_parallel.tensor.local_output import OwnOutputRowwise

__all__ = ["VocabParallelEmbedding", "lookup_own_rows"]


class VocabParallelEmbedding(OwnOutputRowwise):
    """`RowwiseParallel` (input and output placements as given) whose `nn.Embedding` forward runs on local rows; its
    all-reduced output no view (`local_output.py`), so model code may scale it in place."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if isinstance(module, nn.Embedding) and not (module.max_norm or module.scale_grad_by_freq or module.sparse):
            module.forward = _LocalRowsForward(module)  # type: ignore[method-assign, assignment]
        return module  # max_norm (renormalises rows in place) and friends keep DTensor's whole-gradient path


class _LocalRowsForward:
    """The embedding's forward on its own rows: a Partial DTensor the style's output function all-reduces."""

    def __init__(self, module: nn.Embedding) -> None:
        self.module = module

    def __call__(self, ids: Any) -> DTensor:
        weight = self.module.weight
        if not isinstance(weight, DTensor):  # set up but not sharded (e.g. replaced since): the module's own forward
            return nn.Embedding.forward(self.module, ids)  # type: ignore[return-value]
        return lookup_own_rows(weight, ids, self.module.padding_idx)


def lookup_own_rows(weight: DTensor, ids: Any, padding_idx: int | None = None) -> DTensor:
    """The embedding of `ids` (plain or a Replicate DTensor) in `weight` split by vocabulary (Shard(0)): each rank
    looks up the ids among its own rows, zeros elsewhere, as a Partial DTensor whose sum is the embedding; its
    gradient comes back to `weight` as a Shard(0) DTensor of those rows. The `padding_idx` row gets no gradient."""
    mesh = weight.device_mesh
    local_ids = ids.to_local() if isinstance(ids, DTensor) else ids
    rows = weight.to_local()  # differentiable: the gradient comes back a DTensor placed like the weight
    index, outside = _local_index(local_ids, weight.shape[0], mesh.size(), mesh.get_local_rank())
    out = F.embedding(index, rows).masked_fill(outside.unsqueeze(-1), 0.0)  # (..., C)
    if padding_idx is not None:  # the padding row is read but gets no gradient (as `padding_idx`)
        out = torch.where((local_ids == padding_idx).unsqueeze(-1), out.detach(), out)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


@per_rank
def _local_index(ids: torch.Tensor, vocabulary: int, ranks: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's row among this rank's (0 where it is not here) and whether it is elsewhere; the rows are those
    `distribute_tensor`'s Shard(0) gives the rank (torch.chunk's sizes: ceil, the last ones short or empty)."""
    size = -(-vocabulary // ranks)
    start = min(rank * size, vocabulary)
    shifted = ids - start
    outside = (shifted < 0) | (shifted >= min(size, vocabulary - start))
    return shifted.masked_fill(outside, 0), outside
