"""Pipeline partitioning: optimal contiguous splits, explicit splits, stage->rank maps, pruning (no processes)."""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from lightning_parallel.models import GPT, ResNet
from lightning_parallel.pipeline import (
    Partition,
    loop_stage_to_rank,
    make_partition,
    parameter_costs,
    prune_to_blocks,
    split_by_cost,
    split_explicit,
    stage_module,
    v_stage_to_rank,
)
from lightning_parallel.pipeline.partition import plan_partition


@pytest.fixture(scope="module")
def resnet152() -> ResNet:
    with torch.device("meta"):
        return ResNet(depth=152, in_channels=3, num_classes=1000)


@pytest.fixture(scope="module")
def gpt12() -> GPT:
    with torch.device("meta"):
        return GPT(vocab_size=32000, context_length=128, depth=12, width=768, heads=12)


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=50, context_length=8, depth=3, width=16, heads=2)


def brute_force_min_max(costs: Sequence[float], num_stages: int) -> float:
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_split_by_cost_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for n in range(1, 10):
        names = [f"b{i}" for i in range(n)]
        # Mix integer-like, continuous, zero and one dominant cost, the shapes real models produce.
        costs = [rng.choice([rng.randint(0, 5), rng.uniform(0, 10), rng.uniform(0, 1e6)]) for _ in range(n)]
        for num_stages in range(1, n + 1):
            split = split_by_cost(names, costs, num_stages)
            assert len(split) == num_stages and all(split)
            assert [name for stage in split for name in stage] == names
            cost_of = dict(zip(names, costs, strict=True))
            got = max(sum(cost_of[name] for name in stage) for stage in split)
            assert math.isclose(got, brute_force_min_max(costs, num_stages), rel_tol=1e-9, abs_tol=1e-12)


def test_split_by_cost_prefers_even_stages_among_optimal_ones() -> None:
    names = [f"b{i}" for i in range(10)]
    # [3, 3, 3, 1] and [3, 3, 2, 2] share the optimal maximum 3; the even one wins.
    assert sorted(map(len, split_by_cost(names, [1.0] * 10, 4))) == [2, 2, 3, 3]
    assert [len(stage) for stage in split_by_cost(names, [1.0] * 10, 10)] == [1] * 10


def test_split_by_cost_errors() -> None:
    names = [f"b{i}" for i in range(5)]
    with pytest.raises(ValueError) as info:
        split_by_cost(names, [1.0] * 5, 8)
    assert str(info.value) == (
        "cannot split 5 blocks into 8 stages: each stage needs at least one block. HINT: use at most 5 stages "
        "(pipeline size x virtual stages per rank) or a model with more blocks"
    )
    with pytest.raises(ValueError, match="num_stages 0 must be >= 1"):
        split_by_cost(names, [1.0] * 5, 0)
    with pytest.raises(ValueError, match="got 5 block names but 4 costs"):
        split_by_cost(names, [1.0] * 4, 2)
    with pytest.raises(ValueError, match=re.escape("finite and >= 0, got [('b1', -1.0), ('b3', nan)]")):
        split_by_cost(names, [1.0, -1.0, 1.0, math.nan, 1.0], 2)


def test_split_explicit_accepts_a_valid_split() -> None:
    names = ["a", "b", "c", "d"]
    assert split_explicit(names, (("a",), ("b", "c"), ("d",))) == [["a"], ["b", "c"], ["d"]]


@pytest.mark.parametrize(
    ("stages", "fragment"),
    [
        (
            [["a", "x"], ["b", "y", "c", "d"]],
            "unknown blocks ['x', 'y'] in the explicit split. HINT: valid block names are ['a', 'b', 'c', 'd']",
        ),
        ([["a", "b"], ["b", "c", "d"]], "duplicated ['b'], missing []"),
        ([["a", "b"], ["c"]], "duplicated [], missing ['d']"),
        ([["a", "c"], ["b", "d"]], "stage 0 has 'c' where 'b' comes next"),
        ([["a", "b"], [], ["c", "d"]], "non-empty lists"),
        (["a", "b", "c", "d"], "list of non-empty lists of block names"),
        ([], "non-empty list"),
    ],
)
def test_split_explicit_errors(stages: list, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)) as info:
        split_explicit(["a", "b", "c", "d"], stages)
    assert "HINT:" in str(info.value)


def test_loop_and_v_maps() -> None:
    assert loop_stage_to_rank(4, 4) == [0, 1, 2, 3]
    assert loop_stage_to_rank(8, 4) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert v_stage_to_rank(8, 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v_stage_to_rank(2, 1) == [0, 0]
    with pytest.raises(ValueError, match="num_stages a positive multiple of pp, got num_stages 6, pp 4"):
        loop_stage_to_rank(6, 4)
    with pytest.raises(ValueError, match="exactly 2 stages per rank, got num_stages 4 for pp 4"):
        v_stage_to_rank(4, 4)


def test_partition_queries() -> None:
    partition = Partition(
        stages=(("a",), ("b",), ("c",), ("d",)),
        stage_to_rank=(0, 1, 1, 0),
        costs=(1.0, 1.0, 1.0, 5.0),
        cost_unit="given",
    )
    assert partition.num_ranks == 2
    assert partition.stages_of(1) == [1, 2]
    assert partition.blocks_of(0) == ["a", "d"]
    assert partition.rank_costs() == [6.0, 2.0]
    assert partition.imbalance == pytest.approx(1.5)
    with pytest.raises(ValueError, match="every rank 0..pp-1 owning a stage"):
        Partition(stages=(("a",), ("b",)), stage_to_rank=(0, 2), costs=(1.0, 1.0), cost_unit="given")


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("model_name", ["resnet152", "gpt12"])
def test_make_partition_balances_real_models(model_name: str, pp: int, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(model_name)
    names = [name for name, _ in model.named_children()]
    partition = make_partition(model, pp=pp)
    assert [name for stage in partition.stages for name in stage] == names
    assert partition.stage_to_rank == tuple(range(pp))
    total = sum(p.numel() for p in model.parameters())
    assert sum(partition.costs) == total  # every block has parameters, so the max(numel, 1) floor never applies
    ratio = max(partition.rank_costs()) / (total / pp)
    # Measured: ResNet-152 1.011 (pp=2), 1.114 (pp=4, layer4_0 alone holds 10% of the model); GPT-12 1.001, 1.056.
    assert ratio <= 1.15, partition.table()
    assert partition.imbalance == pytest.approx(ratio)


def test_make_partition_virtual_stages_and_v_style(gpt12: GPT) -> None:
    loop = make_partition(gpt12, pp=4, stages_per_rank=2)
    assert len(loop.stages) == 8 and loop.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    v = make_partition(gpt12, pp=4, stages_per_rank=2, style="v")
    assert v.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    # The V puts the first and last stage on rank 0: here the untied embedding and head (37% of the model).
    assert v.blocks_of(0) == ["embed", "head"]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        make_partition(gpt12, pp=4, style="v")


def test_make_partition_balance_options() -> None:
    model = tiny_gpt()  # embed, block_0, block_1, block_2, head
    timed = make_partition(model, pp=2, balance="time", block_costs=[1.0, 1.0, 1.0, 1.0, 4.0])
    assert timed.cost_unit == "seconds"
    assert timed.stages == (("embed", "block_0", "block_1", "block_2"), ("head",))
    explicit = make_partition(model, pp=2, balance=[["embed", "block_0"], ["block_1", "block_2", "head"]])
    assert explicit.cost_unit == "parameters"
    assert sum(explicit.costs) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match=re.escape("balance='time' needs block_costs")):
        make_partition(model, pp=2, balance="time")
    with pytest.raises(ValueError, match="block_costs has 2 entries but the model has 5 blocks"):
        make_partition(model, pp=2, balance="time", block_costs=[1.0, 2.0])
    with pytest.raises(ValueError, match=re.escape("explicit split has 2 stages but pp(4) x stages_per_rank(1) = 4")):
        make_partition(model, pp=4, balance=[["embed", "block_0"], ["block_1", "block_2", "head"]])
    with pytest.raises(ValueError, match="unknown balance 'flops'"):
        make_partition(model, pp=2, balance="flops")
    with pytest.raises(ValueError, match="unknown pipeline style 'zigzag'"):
        make_partition(model, pp=2, style="zigzag")
    with pytest.raises(ValueError, match="cannot split 5 blocks into 6 stages"):
        make_partition(model, pp=3, stages_per_rank=2)


@pytest.mark.parametrize(
    ("model", "type_name"),
    [(nn.Linear(2, 2), "Linear"), (nn.Sequential(nn.Linear(2, 2)), "Sequential"), (nn.ModuleList(), "ModuleList")],
)
def test_make_partition_states_the_model_contract(model: nn.Module, type_name: str) -> None:
    with pytest.raises(ValueError) as info:
        make_partition(model, pp=1)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(
        "pipeline parallelism needs the network as an nn.Sequential of named blocks (stem, blocks..., head); "
        f"got {type_name}"
    )
    assert "HINT:" in message


def test_parameter_costs_floor_parameterless_blocks_at_one() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1, bias=False))
    assert parameter_costs(model) == [16.0, 1.0, 4.0]


def test_prune_to_blocks_keeps_original_names() -> None:
    model = tiny_gpt()
    full = dict(model.named_parameters())
    kept_block = model.block_1
    prune_to_blocks(model, ["block_1", "block_2"])
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name in full if name.startswith(("block_1.", "block_2."))]
    assert model.block_1 is kept_block
    assert [name for name, _ in model.named_children()] == ["embed", "block_0", "block_1", "block_2", "head"]
    assert isinstance(model.embed, nn.Identity) and isinstance(model.head, nn.Identity)
    with pytest.raises(ValueError, match=re.escape("cannot keep unknown blocks ['block_9']")):
        prune_to_blocks(model, ["block_9"])


def test_stage_module_shares_parameters() -> None:
    model = tiny_gpt()
    stage = stage_module(model, ["embed", "block_0"])
    assert [name for name, _ in stage.named_children()] == ["embed", "block_0"]
    assert stage.block_0.attn.q.weight is model.block_0.attn.q.weight
    tokens = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(stage(tokens), model.block_0(model.embed(tokens)))
    with pytest.raises(ValueError, match="not a non-empty, contiguous run"):
        stage_module(model, ["embed", "block_1"])
    with pytest.raises(ValueError, match="not a non-empty, contiguous run"):
        stage_module(model, ["nope"])


def test_table_lists_every_stage(resnet152: ResNet) -> None:
    partition = make_partition(resnet152, pp=4, stages_per_rank=2)
    lines = partition.table().splitlines()
    assert lines[0].split() == ["stage", "rank", "blocks", "count", "parameters", "share"]
    assert len(lines) == 1 + len(partition.stages) + 1
    for index, (row, blocks) in enumerate(zip(lines[1:-1], partition.stages, strict=True)):
        cells = row.split()
        assert cells[:2] == [str(index), str(partition.stage_to_rank[index])]
        assert cells[2].startswith(blocks[0]) and cells[2].endswith(blocks[-1])
        assert cells[3] == str(len(blocks))
    assert lines[-1].startswith(f"imbalance {partition.imbalance:.3f}")


def test_a_balanced_split_never_leaves_a_rank_without_parameters() -> None:
    """A noisy timing can make a Flatten look expensive; alone on a rank it would give that rank's optimizer an
    empty parameter list. The parameter-free block joins the next block with parameters instead."""
    names, costs = ["flatten", "fc1", "relu", "fc2", "relu2", "head"], [58.0, 10.0, 1.0, 10.0, 1.0, 20.0]
    holds = [False, True, False, True, False, True]
    assert plan_partition(names, costs, "seconds", pp=2, balance="time").stages == (
        ("flatten",),
        ("fc1", "relu", "fc2", "relu2", "head"),
    )
    kept = plan_partition(names, costs, "seconds", pp=2, balance="time", holds_parameters=holds)
    assert kept.stages == (("flatten", "fc1"), ("relu", "fc2", "relu2", "head"))
    # A split that already gives every rank parameters is left as it is.
    even = [1.0] * 6
    assert (
        plan_partition(names, even, "seconds", pp=2, balance="time", holds_parameters=holds).stages
        == plan_partition(names, even, "seconds", pp=2, balance="time").stages
    )
