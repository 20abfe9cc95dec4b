"""Set-up step "materialise and shard": the parameters this rank keeps get storage and the values one process would
give them (`weights.py`), a planned layer at a time, each sharded over "tp" as soon as it has them, so no rank ever
holds even its own part unsharded. At tp=1 (or without a plan) the part is materialised whole. A network built for
real is moved instead, sharded from its first peer's values. Which layers and styles: `plan.py`; DTensor: `tensor/`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.parallelize.plan import CONFIGURED, Plan
from lightning_parallel.parallelize.split import Stages
from lightning_parallel.replicas import broadcast_module
from lightning_parallel.tensor.plans import apply_plan, retie, sharding_first, tied_groups
from lightning_parallel.tensor.traced_stages import distribute_planned
from lightning_parallel.weights import materialize, materialize_in_parts, parameter_bytes


def materialize_stages(
    network: nn.Module, plan: Plan | None, stages: Stages | None, mesh: DeviceMesh | None, device: torch.device
) -> int:
    """This pipeline rank's blocks (the whole network at pp=1), sharded over the "tp" dimension of `mesh` as `plan`
    says; returns the most parameter bytes held on the way. Stages split by tracing: the planned layers only hold
    DTensor shards, which traced stages compute on (`tensor/traced_stages.run_on_mesh`); otherwise torch's styles
    wrap their forwards. At tp > 1 a network built for real starts from its first tensor peer's values."""
    if plan is None:
        materialize(network, device)
        return parameter_bytes(network)
    assert mesh is not None  # a plan exists at tp > 1 only
    tp_mesh = mesh["tp"]
    if not any(p.is_meta for p in network.parameters()):
        network.to(device)
        broadcast_module(network, mesh.get_group("tp"))
    held = {name for name, mod in network.named_modules() if any(True for _ in mod.parameters())}
    local = {name: style for name, style in plan[1].items() if name in held}  # pruned blocks are Identity
    traced = stages is not None and stages.traced

    def shard(name: str) -> None:
        if traced:
            distribute_planned(network.get_submodule(name), local[name], tp_mesh)
        else:
            apply_plan(network, {name: local[name]}, tp_mesh, sequence_parallel=False)

    return _in_parts(network, device, sharding_first(local), shard)


def materialize_layers(
    network: nn.Module,
    plan: Plan,
    mesh: DeviceMesh | None,
    device: torch.device,
    *,
    tp: int,
    sequence_parallel: bool,
) -> int:
    """The tensor strategy's whole network, each planned layer sharded over the "tp" dimension of `mesh` at once;
    returns the most parameter bytes held on the way (0 when `configure_model()` sharded it instead). At tp=1 the
    plan is not applied: a one-rank DTensor's eager dispatch costs 3-4x a step on a GPU, so the network stays plain,
    as on one device. A network built for real starts from rank 0's values, on its peers and replicas alike."""
    source, layers, _ = plan
    if source == CONFIGURED:
        return 0
    if not any(p.is_meta for p in network.parameters()):
        network.to(device)
        broadcast_module(network)
    tp_mesh = mesh["tp"] if mesh is not None and tp > 1 else None

    def shard(name: str) -> None:
        assert tp_mesh is not None  # parts are sharded at tp > 1 only
        apply_plan(network, {name: layers[name]}, tp_mesh, sequence_parallel=sequence_parallel)

    return _in_parts(network, device, sharding_first(layers) if tp > 1 else [], shard)


def _in_parts(network: nn.Module, device: torch.device, parts: list[str], shard: Callable[[str], None]) -> int:
    """`weights.materialize_in_parts`, `shard` after each part; a parameter tied under several names (an embedding
    and its head, each planned module sharding its own copy, alike by `check_plan`) is made one parameter again."""
    tied = tied_groups(network)
    peak = materialize_in_parts(network, device, parts, shard)
    retie(network, tied)
    return peak
