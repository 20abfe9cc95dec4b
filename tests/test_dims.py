"""ParallelDims: size validation and rank layout (pure), plus one 4-process gloo run that builds the mesh."""

from __future__ import annotations

import json
import math
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_parallel.dims import ParallelDims


def _example_product(message: str) -> int:
    """Product of the sizes suggested after 'e.g.' in an error hint."""
    example = message.split("e.g.", 1)[1]
    return math.prod(int(value) for value in re.findall(r"\b(?:dp|pp|tp)=(\d+)", example))


@pytest.mark.parametrize(
    ("world_size", "given", "expected"),
    [
        (8, {"dp": 2, "pp": 2, "tp": 2}, (2, 2, 2)),
        (8, {"pp": 2, "tp": 2}, (2, 2, 2)),
        (12, {"dp": 3, "tp": 2}, (3, 2, 2)),
        (6, {"dp": 3, "pp": 2}, (3, 2, 1)),
        (1, {"pp": 1, "tp": 1}, (1, 1, 1)),
        (4, {"dp": 1, "pp": 4, "tp": 1}, (1, 4, 1)),
    ],
)
def test_resolve_valid(world_size: int, given: dict[str, int], expected: tuple[int, int, int]) -> None:
    dims = ParallelDims.resolve(world_size, **given)
    assert (dims.dp, dims.pp, dims.tp) == expected
    assert dims.world_size == world_size


def test_product_mismatch_prints_every_factor_and_a_valid_example() -> None:
    with pytest.raises(ValueError) as info:
        ParallelDims.resolve(8, dp=2, pp=3, tp=2)
    message = str(info.value)
    assert message.startswith("dp(2) * pp(3) * tp(2) = 12 != world size 8. HINT: choose sizes whose product is 8")
    assert "\n" not in message
    assert _example_product(message) == 8


def test_underivable_size_names_the_missing_dimension() -> None:
    with pytest.raises(ValueError) as info:
        ParallelDims.resolve(6, dp=4, tp=1)
    message = str(info.value)
    assert message.startswith(
        "world size 6 is not divisible by dp(4) * tp(1) = 4, so the pipeline size cannot be derived. HINT:"
    )
    assert 6 % _example_product(message) == 0


@pytest.mark.parametrize(
    ("world_size", "given", "fragment"),
    [
        (8, {"dp": 0, "pp": 2, "tp": 4}, "dp(0) must be >= 1"),
        (8, {"tp": -2}, "tp(-2) must be >= 1"),
        (8, {"tp": 2}, "dp and pp are None"),
        (8, {}, "dp and pp and tp are None"),
        (0, {"dp": 1, "pp": 1, "tp": 1}, "world size 0 must be >= 1"),
        (8, {"dp": 3, "tp": 5}, "world size 8 is not divisible by dp(3) * tp(5) = 15"),
    ],
)
def test_resolve_invalid(world_size: int, given: dict[str, int], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)) as info:
        ParallelDims.resolve(world_size, **given)
    assert "HINT:" in str(info.value)


def test_direct_construction_is_validated_and_keyword_only() -> None:
    with pytest.raises(ValueError, match=re.escape("pp(0) must be an integer >= 1")):
        ParallelDims(dp=1, pp=0, tp=1)
    with pytest.raises(TypeError):
        ParallelDims(1, 1, 1)  # type: ignore[misc]


def test_coords_dp_outermost_tp_innermost() -> None:
    dims = ParallelDims(dp=2, pp=3, tp=2)
    assert [dims.coords(rank) for rank in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert dims.coords(6) == (1, 0, 0)
    assert dims.coords(11) == (1, 2, 1)
    for rank in range(dims.world_size):
        d, p, t = dims.coords(rank)
        assert (d * dims.pp + p) * dims.tp + t == rank
    with pytest.raises(ValueError, match=re.escape("rank 12 is outside [0, 12)")):
        dims.coords(12)


def test_build_mesh_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="HINT: call torch.distributed.init_process_group"):
        ParallelDims(dp=1, pp=1, tp=1).build_mesh("cpu")


def _mesh_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        mesh = ParallelDims(dp=2, pp=2, tp=1).build_mesh("cpu")
        pp_group = mesh["pp"].get_group()
        # A real collective proves the pipeline group connects the intended peers, not just that it exists.
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=pp_group)
        result = {
            "local": {name: mesh[name].get_local_rank() for name in ("dp", "pp", "tp")},
            "sizes": {name: dist.get_world_size(mesh[name].get_group()) for name in ("dp", "pp", "tp")},
            "pp_peers": dist.get_process_group_ranks(pp_group),
            "pp_sum": value.item(),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_build_mesh_on_four_gloo_processes(tmp_path: Path) -> None:
    dims = ParallelDims(dp=2, pp=2, tp=1)
    # fork, not spawn: four spawned children re-import torch and took 9-12 s on the 2-core machine; forked
    # ones start in milliseconds and touch only gloo and tiny tensors (no OpenMP work that fork could upset).
    mp.start_processes(_mesh_worker, args=(4, _free_port(), str(tmp_path)), nprocs=4, start_method="fork")
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        d, p, t = dims.coords(rank)
        assert result["local"] == {"dp": d, "pp": p, "tp": t}
        assert result["sizes"] == {"dp": 2, "pp": 2, "tp": 1}
        peers = [(d * dims.pp + stage) * dims.tp + t for stage in range(dims.pp)]
        assert result["pp_peers"] == peers
        assert result["pp_sum"] == sum(peers)
