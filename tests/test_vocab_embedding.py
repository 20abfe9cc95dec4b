"""The vocabulary-parallel embedding in one process (LocalTensorMode simulates the ranks, collectives included): its
output and its weight's gradient are one device's, and each rank's gradient holds only its own rows (Shard(0)),
padding row included, in the module's forward and in a traced stage's; an uneven vocabulary's forward too
(LocalTensorMode's backward through uneven shards is NYI).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from conftest import fake_world  # noqa: E402

local_tensor = pytest.importorskip("torch.distributed._local_tensor")

V, WIDTH = 12, 4


def ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (3, 7), generator=generator)
    tokens[0, :3] = torch.tensor([0, V - 1, 2])  # the first and last rows, and the padding row
    return tokens


@pytest.mark.parametrize("where", ["module", "traced"])
@pytest.mark.parametrize(("ranks", "vocabulary"), [(2, V), (4, V), (3, V - 1)])
def test_the_embedding_looks_up_its_own_rows_and_its_gradient_holds_only_them(
    ranks: int, vocabulary: int, where: str
) -> None:
    """`where`: the style's module forward, or a traced pipeline stage's `aten.embedding` (`traced_stages`), which
    runs the same lookup on the parameter placed as the style places it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_parallel.tensor.plans import make_style
    from lightning_parallel.tensor.traced_stages import _embedding, distribute_planned

    torch.manual_seed(0)
    whole = nn.Embedding(vocabulary, WIDTH, padding_idx=2)
    tokens = ids() % vocabulary
    upstream = torch.randn(3, 7, WIDTH)
    expected = whole(tokens)
    (expected * upstream).sum().backward()
    even = vocabulary % ranks == 0
    with fake_world(ranks), local_tensor.LocalTensorMode(ranks):
        mesh = init_device_mesh("cpu", (ranks,))
        sharded = nn.Embedding(vocabulary, WIDTH, padding_idx=2)
        sharded.load_state_dict(whole.state_dict())
        if where == "module":
            style = make_style("vocab_parallel", sequence_parallel=False)
            assert style is not None
            parallelize_module(sharded, mesh, style)
            out = sharded(tokens)
        else:  # the graph's ids are a Replicate DTensor, its output one too
            distribute_planned(sharded, "vocab_parallel", mesh)
            out = _embedding(sharded.weight, DTensor.from_local(tokens, mesh, [Replicate()]), 2).to_local()
        assert not isinstance(out, DTensor)
        assert float((out - expected).detach().abs().max()) == 0.0
        if not even:
            return
        (out * upstream).sum().backward()
        grad = sharded.weight.grad
        assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), grad
        assert grad.to_local().shape == (vocabulary // ranks, WIDTH)  # never the whole vocabulary on a rank
        gathered = grad.redistribute(placements=[Replicate()]).to_local()
        assert whole.weight.grad is not None
        assert float((gathered - whole.weight.grad).abs().max()) < 1e-6
