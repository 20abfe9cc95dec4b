"""The set-up order (`parallelize/order.py`): at dp = pp = tp = 1 every step returns at once, so a network comes out
as one process builds it: plain parameters with one process's values, no inputs asked for, no mesh touched, no FSDP2
and no deferred BatchNorm. At dp2 x pp2 x tp2 (rank 0 on the fake process group) torch.compile and fully_shard are
watched as set-up calls them, so a step moved out of its place fails. (Numbers at larger sizes: the parity tests.)"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.dims import ParallelDims
from lightning_parallel.parallelize import parallelize_pipeline, parallelize_tensor
from lightning_parallel.weights import materialize


def size_one() -> SimpleNamespace:
    """A strategy's settings at size 1 everywhere, with every option that acts at a larger size switched on, and
    no mesh: a step that touched it would fail."""
    return SimpleNamespace(
        dims=ParallelDims(dp=1, pp=1, tp=1),
        device_mesh=None,
        root_device=torch.device("cpu"),
        plan=None,
        spec=None,
        balance="time",
        replicas="fsdp",
        deferred_batchnorm=True,
        activation_checkpointing="none",
        compile_options=None,
        sequence_parallel=False,
        microbatches_for=lambda pp: 2 * pp,
    )


def meta_network() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def assert_as_one_process_builds_it(network: nn.Module) -> None:
    reference = meta_network()
    materialize(reference, torch.device("cpu"))
    for (name, param), (_, expected) in zip(network.named_parameters(), reference.named_parameters(), strict=True):
        assert type(param) is nn.Parameter and torch.equal(param, expected), name
    assert not any(isinstance(m, FSDPModule) for m in network.modules())


def test_the_pipeline_order_at_size_one_places_the_network_whole() -> None:
    network = meta_network()
    done = parallelize_pipeline(network, size_one(), lambda: pytest.fail("inputs asked for with nothing to split"))
    assert done.stages is None and done.plan is None and done.batchnorms == [] and done.compiled_blocks == 0
    assert network[1].track_running_stats  # BatchNorm statistics are not deferred: there are no micro-batches
    assert_as_one_process_builds_it(network)


def test_the_tensor_order_at_tp1_reports_its_plan_and_leaves_the_network_plain() -> None:
    network = meta_network()
    done = parallelize_tensor(network, network, size_one(), configured=False)
    assert done.plan[0] == "auto" and done.plan[1], done.plan  # resolved for summary.json, not applied
    assert_as_one_process_builds_it(network)
    configured = copy.deepcopy(network)
    done = parallelize_tensor(configured, configured, size_one(), configured=True)
    assert done.plan == ("configure_model", {}, {}) and done.peak_parameter_bytes == 0


# ---- the order at dp2 x pp2 x tp2 (rank 0 of 8 on torch's fake process group; values are not checked) ----------------
def three_d(dims: ParallelDims, mesh: object) -> SimpleNamespace:
    """Every option that adds a step switched on: FSDP2 replicas, full activation checkpointing, compile (lazy: its
    eager backend never runs here), the model's own tensor plan, a split by parameters."""
    from lightning_parallel.pipeline.schedule_plan import resolve_schedule

    return SimpleNamespace(
        dims=dims,
        device_mesh=mesh,
        root_device=torch.device("cpu"),
        plan=None,
        spec=resolve_schedule("1f1b", pp=dims.pp, microbatches=4),
        balance="parameters",
        replicas="fsdp",
        deferred_batchnorm=False,
        activation_checkpointing="full",
        compile_options={"backend": "eager"},
        sequence_parallel=False,
        microbatches_for=lambda pp: 2 * pp,
    )


def test_the_pipeline_order_at_dp2_pp2_tp2_shards_checkpoints_compiles_then_wraps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.compile and FSDP2's fully_shard are watched as the set-up calls them: compile must find every block
    held real (materialised), its planned layers sharded over "tp" and its forward already checkpointed; fully_shard
    must find each block compiled (so FSDP2 wraps the compiled, checkpointed block, as torchtitan orders it)."""
    import functools

    from conftest import fake_world
    from torch.distributed.tensor import DTensor
    from torch.utils.checkpoint import checkpoint

    from lightning_parallel.models.transformer import GPT, Block
    from lightning_parallel.parallelize import replicas

    dims = ParallelDims(dp=2, pp=2, tp=2)
    with fake_world(dims.world_size):
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            network = GPT(vocab_size=64, context_length=16, depth=4, width=32, heads=4, dropout=0.0)
        compiled: list[object] = []
        wrapped: list[nn.Module] = []
        real_compile, real_fully_shard = torch.compile, replicas.fully_shard

        def watched_compile(forward: object, **options: object) -> object:
            held = [b for b in network.children() if next(b.parameters(), None) is not None]
            assert not any(p.is_meta for b in held for p in b.parameters()), "compiled before materialisation"
            assert any(isinstance(p, DTensor) for p in network.parameters()), "compiled before the tp plan"
            blocks = [b for b in held if isinstance(b, Block)]
            assert all(isinstance(b.forward, functools.partial) and b.forward.func is checkpoint for b in blocks) or (
                compiled
            ), "compiled before activation checkpointing"
            assert not wrapped, "compiled after FSDP2"
            compiled.append(real_compile(forward, **options))
            return compiled[-1]

        def watched_fully_shard(module: nn.Module, **options: object) -> object:
            if module is network:  # the root the blocks share, last
                assert len(wrapped) == 3, "FSDP2 wrapped the network before its blocks"
                return real_fully_shard(module, **options)
            assert any(module.forward is c for c in compiled), f"FSDP2 wrapped {type(module).__name__} before compile"
            wrapped.append(module)
            return real_fully_shard(module, **options)

        monkeypatch.setattr(torch, "compile", watched_compile)
        monkeypatch.setattr(replicas, "fully_shard", watched_fully_shard)
        done = parallelize_pipeline(
            network, three_d(dims, mesh), lambda: (None, (torch.zeros(2, 16, dtype=torch.long),))
        )
        held = [b for b in network.children() if next(b.parameters(), None) is not None]
        assert done.compiled_blocks == len(held) == len(compiled) == len(wrapped) == 3  # embed + 2 of 4 blocks
        assert done.plan is not None and done.stages is not None
        assert [type(c).__name__ for c in network.children()][3:] == ["Identity"] * 3  # the other stage's, pruned
        for name, param in network.named_parameters():  # planned layers over ("dp", "tp"), the rest over "dp"
            assert isinstance(param, DTensor) and "dp" in (param.device_mesh.mesh_dim_names or ()), name
