"""Attention inside traced stages at tp2 and tp8, simulated in one process (LocalTensorMode): q, k and v split by heads
run on each rank's own heads (grouped-query, causal, masks broadcast over heads or one per head) with one device's
output and gradients, the output left split by heads; anything else runs whole; a packed q | k | v splits into its
blocks without a gather; a traced GPT-2 (its packed c_attn) at pp2 x tp2 gathers nothing in forward and is one
device's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("torch.distributed._local_tensor")

from conftest import needs_torch_2_13  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from lightning_parallel.one_process_ranks import simulated_ranks  # noqa: E402
from lightning_parallel.tensor.traced_attention import attention, split_packed  # noqa: E402

B, T, D = 2, 6, 8


def _mesh(size: int = 2) -> Any:
    return torch.distributed.device_mesh.init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))


def _gap(value: DTensor, expected: torch.Tensor) -> float:
    """The largest gap between `value` gathered and `expected`, over every simulated rank."""
    gathered = value.full_tensor().detach()
    return max(float((held - expected).abs().max()) for held in gathered._local_tensors.values())  # type: ignore[attr-defined]


CASES = {  # name: (tensor-parallel degree, query heads, key / value heads, mask shape or None, keywords)
    "grouped-query causal": (2, 4, 2, None, {"is_causal": True, "enable_gqa": True}),
    "mask broadcast over heads": (2, 4, 4, (B, 1, T, T), {}),
    "mask per head": (2, 4, 4, (B, 4, T, T), {"scale": 0.3}),
    # Llama-3-70B's grouping at tp 8: 64 query heads over 8 key / value heads -> 8 and 1 per rank (here 16 over 8)
    "grouped-query causal at tp8": (8, 16, 8, None, {"is_causal": True, "enable_gqa": True}),
    "mask broadcast over heads at tp8": (8, 16, 8, (B, 1, T, T), {"enable_gqa": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_attention_split_by_heads_runs_on_each_ranks_heads_as_one_device(case: str) -> None:
    size, heads, kv_heads, mask_shape, keywords = CASES[case]
    generator = torch.Generator().manual_seed(0)
    whole = [torch.randn(B, n, T, D, generator=generator, requires_grad=True) for n in (heads, kv_heads, kv_heads)]
    mask = torch.randn(mask_shape, generator=generator, requires_grad=True) if mask_shape else None
    expected = F.scaled_dot_product_attention(*whole, attn_mask=mask, **keywords)
    expected.square().sum().backward()
    with simulated_ranks(size):
        mesh = _mesh(size)
        qkv = [distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in whole]
        placed = distribute_tensor(mask.detach(), mesh, [Replicate()]).requires_grad_() if mask is not None else None
        out = attention(*qkv, placed, **keywords)
        assert out.placements == (Shard(1),) and out.to_local().shape == (B, heads // size, T, D), out
        assert out.stride() == expected.stride()  # as one device's: its transpose and reshape copy nothing
        out.square().sum().backward()
        assert _gap(out, expected.detach()) < 1e-6
        for value, reference in zip([*qkv, placed], [*whole, mask], strict=True):
            if value is not None:
                assert _gap(value.grad, reference.grad) < 1e-5, case


def test_attention_runs_whole_when_heads_do_not_split_evenly_or_it_drops() -> None:
    """Heads not split evenly (3 at tp2: torch.chunk gives 2 and 1), q split by tokens, or dropout (one device's mask
    is drawn over every head): whole on every rank, one device's output."""
    generator = torch.Generator().manual_seed(0)
    uneven = [torch.randn(B, 3, T, D, generator=generator) for _ in range(3)]
    even = [torch.randn(B, 4, T, D, generator=generator) for _ in range(3)]
    with simulated_ranks(2):
        mesh = _mesh()
        out = attention(*[distribute_tensor(t, mesh, [Shard(1)]) for t in uneven])
        assert out.placements == (Replicate(),) and _gap(out, F.scaled_dot_product_attention(*uneven)) < 1e-6
        by_tokens = [distribute_tensor(t, mesh, [Shard(2)]) for t in even]
        out = attention(*by_tokens, is_causal=True)
        expected = F.scaled_dot_product_attention(*even, is_causal=True)
        assert out.placements == (Replicate(),) and _gap(out, expected) < 1e-6
        dropped = attention(*[distribute_tensor(t, mesh, [Shard(1)]) for t in even], dropout_p=0.5)
        assert dropped.placements == (Replicate(),)


@needs_torch_2_13  # 2.11's DTensor cannot gather a _StridedShard(sf=3) on a 1-D mesh ("unable to be interpreted")
def test_a_packed_qkv_splits_into_blocks_split_by_heads_without_a_gather() -> None:
    """qkv_colwise's output (each rank its share of q, k and v: a `_StridedShard` of 3 pieces) split into q, k, v:
    each Shard on the features, one device's values and gradient; a split that is not into the packed blocks is
    DTensor's (whole here)."""
    generator = torch.Generator().manual_seed(0)
    packed = torch.randn(B, T, 3 * 16, generator=generator, requires_grad=True)
    weights = torch.randn(3, 16, generator=generator)
    sum(((part * w).sum() for part, w in zip(packed.split(16, 2), weights, strict=True))).backward()
    with simulated_ranks(2) as mode:
        mesh = _mesh()
        # each rank's share of each block (distribute_tensor under LocalTensorMode gives all rank 0's: torch 2.13)
        shares = mode.rank_map(
            lambda rank: torch.cat([block.chunk(2, 2)[rank] for block in packed.detach().split(16, 2)], 2)
        )
        placed = DTensor.from_local(shares, mesh, [_StridedShard(2, split_factor=3)], run_check=False).requires_grad_()
        parts = split_packed(placed, 16, -1)
        assert [part.placements for part in parts] == [(Shard(2),)] * 3
        assert [part.to_local().shape for part in parts] == [(B, T, 8)] * 3
        for part, expected in zip(parts, packed.split(16, 2), strict=True):
            assert _gap(part, expected.detach()) == 0.0
        placed_weights = distribute_tensor(weights, mesh, [Replicate()])
        sum((part * w).sum() for part, w in zip(parts, placed_weights, strict=True)).backward()
        assert _gap(placed.grad, packed.grad) < 1e-6
        other = split_packed(placed, 24, 2)
        assert [part.placements for part in other] == [(Replicate(),)] * 2
