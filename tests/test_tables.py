"""The schedule table and the tensor-style table: every row resolves or applies, and what the rows say (stage layout,
fallbacks, sharded parameters and dimensions, sizes to divide) is what torch and the planner actually do. No processes
(sharding runs on torch's in-process fake process group)."""

from __future__ import annotations

import pytest
import torch
from conftest import fake_world, needs_torch_2_13
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_parallel.pipeline.microbatches import plan_microbatches
from lightning_parallel.pipeline.schedule_plan import SCHEDULES, resolve_schedule
from lightning_parallel.pipeline.schedules import SCHEDULE_TRAITS
from lightning_parallel.planner import workload_from_module
from lightning_parallel.tensor.plans import STYLES, apply_plan, check_plan, make_style
from lightning_parallel.tensor.styles import STYLE_TRAITS
from lightning_parallel.tensor.styles import Conv1D as TransposedLinear
from lightning_parallel.tensor.traced_stages import distribute_planned


class Conv1D(nn.Module):
    """transformers' Conv1D as GPT-2 has it (the library recognises it by name): weight (in `nx`, out `nf`)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


# ---- schedules -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCHEDULE_TRAITS))
def test_every_schedule_resolves_at_its_defaults_as_its_row_says(name: str) -> None:
    traits = SCHEDULE_TRAITS[name]
    spec = resolve_schedule(name, pp=2, microbatches=8)  # 8: a multiple of the rounds and >= every stage count
    assert spec.traits is traits and spec.stages_per_rank == traits.default_stages_per_rank
    assert spec.torch_class is getattr(torch_schedules, SCHEDULES[name])
    assert issubclass(spec.torch_class, torch_schedules.PipelineScheduleMulti) == traits.multi_stage
    expected = [0, 1, 1, 0] if traits.style == "v" else [s % 2 for s in range(2 * spec.stages_per_rank)]
    assert spec.stage_to_rank(2) == expected


@pytest.mark.parametrize("name", list(SCHEDULE_TRAITS))
def test_each_schedule_falls_back_to_the_one_same_layout_schedule_that_takes_any_count(name: str) -> None:
    traits = SCHEDULE_TRAITS[name]
    fallback = SCHEDULE_TRAITS[traits.fallback]
    layout = (traits.style, traits.multi_stage)
    any_count = [
        t.name for t in SCHEDULE_TRAITS.values() if (t.style, t.multi_stage) == layout and t.microbatches == "any"
    ]
    assert any_count == [fallback.name]
    # the runtime times a fallback like the configured schedule: it may not split the backward when that one does not
    assert not fallback.splits_backward or traits.splits_backward
    v = traits.default_stages_per_rank
    for count in range(1, 13):
        resolve_schedule(fallback.name, pp=4, microbatches=count, stages_per_rank=v)  # any count: never raises
    if traits.microbatches == "per_stage":  # 3 rows give at most 3 micro-batches, fewer than 4 stages
        assert plan_microbatches(3, schedule=name, requested=8, pp=4, stages_per_rank=v) == (fallback.name, 3)


# ---- tensor styles ---------------------------------------------------------------------------------------------------
def example(module_type: type[nn.Module] | None, pieces: int = 1) -> nn.Module:
    """A small module of a type, every size divisible by 2 and none by 4 (per block of a packed projection)."""
    if pieces > 1:
        return nn.Linear(6, 6 * pieces) if module_type is nn.Linear else Conv1D(6 * pieces, 6)
    examples: dict[type[nn.Module] | None, nn.Module] = {
        nn.Linear: nn.Linear(6, 10),
        nn.Embedding: nn.Embedding(10, 6),
        nn.Conv2d: nn.Conv2d(6, 10, 3),
        nn.BatchNorm1d: nn.BatchNorm1d(6),
        nn.BatchNorm2d: nn.BatchNorm2d(6),
        nn.LayerNorm: nn.LayerNorm(6),
        nn.RMSNorm: nn.RMSNorm(6),
        nn.Dropout: nn.Dropout(0.1),
        TransposedLinear: Conv1D(10, 6),
        None: nn.Linear(6, 10),  # a style for any module
    }
    return examples[module_type]


# A fused projection split by heads (a shard of `pieces` > 1 blocks) is refused before torch 2.13 (seams.NEEDS_TORCH)
CASES = [
    pytest.param(name, module_type, marks=[needs_torch_2_13] if traits.shardings[0].pieces > 1 else [])
    if traits.shardings
    else (name, module_type)
    for name, traits in STYLE_TRAITS.items()
    for module_type in (traits.accepts or (None,))
]


@pytest.mark.parametrize(("name", "module_type"), CASES, ids=lambda case: getattr(case, "__name__", str(case)))
def test_every_style_applies_and_shards_what_its_row_says(name: str, module_type: type[nn.Module] | None) -> None:
    traits = STYLE_TRAITS[name]
    assert STYLES[name] == traits.description
    pieces = traits.shardings[0].pieces if traits.shardings else 1
    module = example(module_type, pieces)
    split = traits.sharded_parameters(module)
    model = nn.ModuleDict({"m": module})
    check_plan(model, {"m": name}, tensor_parallel_size=2, sequence_parallel=False)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        apply_plan(model, {"m": name}, mesh, sequence_parallel=False)
        sharded = [model["m"]]
        if module_type is TransposedLinear:  # its own torch styles (transposed_linear.py), and inside traced stages
            traced = example(module_type, pieces)
            distribute_planned(traced, name, mesh)
            sharded.append(traced)
        for key, param in (item for each in sharded for item in each.named_parameters()):
            if key in split:
                # contiguous, or interleaved block by block in a packed projection (q | k | v)
                want = Shard(split[key]) if pieces == 1 else _StridedShard(split[key], split_factor=pieces)
                assert isinstance(param, DTensor) and param.placements == (want,), (name, key)
                assert param.to_local().shape[split[key]] * 2 == param.shape[split[key]]
            else:  # left whole: a plain tensor or a replicated DTensor
                assert not isinstance(param, DTensor) or param.placements == (Replicate(),), (name, key)


@pytest.mark.parametrize("name", [name for name, traits in STYLE_TRAITS.items() if traits.shardings])
def test_every_sharding_style_refuses_sizes_tp_does_not_divide_and_other_module_types(name: str) -> None:
    for sharding in STYLE_TRAITS[name].shardings:
        module = example(sharding.module, sharding.pieces)
        size = getattr(module, sharding.size)
        what = sharding.size_name if sharding.pieces == 1 else rf"{sharding.size_name} {size} = {sharding.pieces} x"
        refusal = rf"has {what} {size // sharding.pieces}, not divisible by tensor_parallel_size 4"
        with pytest.raises(ValueError, match=refusal):
            check_plan(nn.ModuleDict({"m": module}), {"m": name}, tensor_parallel_size=4, sequence_parallel=False)
    with pytest.raises(ValueError, match=rf"Identity, but style '{name}' applies to"):
        check_plan(nn.ModuleDict({"m": nn.Identity()}), {"m": name}, tensor_parallel_size=2, sequence_parallel=False)


def test_sequence_styles_act_only_under_sequence_parallelism() -> None:
    for name, traits in STYLE_TRAITS.items():
        if traits.sequence_only:
            assert make_style(name, sequence_parallel=False) is None
            assert make_style(name, sequence_parallel=True) is not None


def test_the_planner_counts_what_the_style_table_shards() -> None:
    """conv_colwise -> flatten -> rowwise_from_channels: the planner's sharded parameters and collectives are the
    table's (rowwise_from_channels was missing from the planner's own copy of the style sets)."""
    model = nn.Sequential(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 6)))
    plan = {"0.0": "conv_colwise", "0.3": "rowwise_from_channels"}
    block = workload_from_module(model, torch.zeros(2, 1, 4, 4), plan=plan).blocks[0]
    conv, linear = model[0][0], model[0][3]
    assert block.tp_params == conv.weight.numel() + conv.bias.numel() + linear.weight.numel()
    assert [kind for kind, _ in block.collectives] == ["all_reduce"]  # the Linear's partial outputs summed
    assert block.collectives[0][1] == 6  # per sample: the Linear's output; the conv's input needs no gradient here
