"""One optimizer over plain and DTensor parameters: the update runs each param group one kind at a time, and the
optimizer holds the user's own groups before and after it (`parameter_kinds.py`); fused SGD steps DTensors
(`seams.fused_steps_on_dtensor`). In one process over a one-rank mesh; the layouts themselves are in
test_default_optimizers.py, every optimizer over real (uneven) shards of 4 simulated ranks in
test_optimizers_on_shards.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_parallel.parameter_kinds import (
    groups_by_kind,
    mixes_kinds,
    refuse_unsteppable,
    then_by_kind,
)
from lightning_parallel.seams import fused_steps_on_dtensor


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def parameters(mesh: Any, kinds: str) -> list[torch.nn.Parameter]:
    """One parameter per letter: "p" plain, "s" sharded DTensor, "i" an interleaved shard (a packed q | k | v's
    `_StridedShard`), "r" replicated DTensor; each with a gradient."""
    torch.manual_seed(0)
    made = []
    for letter in kinds:
        value = torch.randn(4, 3)
        if letter != "p":
            placement = {"s": Shard(0), "i": _StridedShard(0, split_factor=2), "r": Replicate()}[letter]
            value = distribute_tensor(value, mesh, [placement])
        param = torch.nn.Parameter(value)
        param.grad = torch.ones_like(param)
        made.append(param)
    return made


def test_split_inside_the_block_and_the_users_groups_after(mesh: Any) -> None:
    mixed, plain = parameters(mesh, "psrp"), parameters(mesh, "pp")
    optimizer = torch.optim.AdamW([{"params": mixed, "lr": 0.1}, {"params": plain}], lr=0.2)
    groups = optimizer.param_groups
    assert mixes_kinds(optimizer)
    with groups_by_kind(optimizer):
        inside = optimizer.param_groups
        assert [[type(p) for p in g["params"]] for g in inside] == [
            [torch.nn.Parameter, torch.nn.Parameter],
            [DTensor, DTensor],
            [torch.nn.Parameter, torch.nn.Parameter],
        ]
        assert [g["lr"] for g in inside] == [0.1, 0.1, 0.2]
        assert inside[2] is groups[1]  # a group of one kind stays the user's own dict
        inside[1]["lr"] = 0.05  # a hyperparameter rebound during the update is kept
    assert optimizer.param_groups is groups
    assert groups[0]["params"] == mixed and groups[0]["lr"] == 0.05


@pytest.mark.parametrize("kernel", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_each_kernel_steps_mixed_kinds_like_the_plain_loop(mesh: Any, name: str, kernel: dict[str, bool]) -> None:
    fused_steps_on_dtensor()
    arguments: dict[str, Any] = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    state = {"SGD": "momentum_buffer", "Adagrad": "sum"}.get(name, "exp_avg")
    mixed, reference = parameters(mesh, "psrp"), parameters(mesh, "pppp")
    optimizer = getattr(torch.optim, name)(mixed, **arguments, **kernel)
    plain = getattr(torch.optim, name)(reference, **arguments, foreach=False)
    unsplit = getattr(torch.optim, name)(parameters(mesh, "psrp"), **arguments, **kernel)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        unsplit.step()  # what CUDA users met: one kernel call over both kinds
    for _ in range(3):
        with ExitStack() as stack:
            optimizer.step(then_by_kind(lambda: None, optimizer, stack))
        plain.step()
    for p, q in zip(mixed, reference, strict=True):
        value = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(value, q, rtol=0, atol=1e-6)
    assert optimizer.state[mixed[1]][state].__class__ is DTensor


def test_fused_sgd_steps_dtensors_once_registered(mesh: Any) -> None:
    fused_steps_on_dtensor()
    fused_steps_on_dtensor()  # idempotent
    params = parameters(mesh, "sr")
    optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9, fused=True)
    optimizer.step()
    assert torch.allclose(params[1].full_tensor(), parameters(mesh, "sr")[1].full_tensor() - 0.5)


# Every torch.optim optimizer that steps without a closure. Which of them DTensor can step on a shard is found by
# trying it here, on this torch, never read from the library's own table: the table must agree with what happens.
OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop"]
OPTIMIZERS += ["Adafactor"] if hasattr(torch.optim, "Adafactor") else []


def steps_like_plain_tensors(mesh: Any, name: str, foreach: bool) -> bool:
    """Whether `name` updates sharded and replicated DTensors exactly as the same optimizer updates plain tensors
    (three steps, gradients changing between them); False when DTensor stops it mid-step. A wrong or missing update
    fails the test here rather than returning False."""
    sharded, reference = parameters(mesh, "psr"), parameters(mesh, "ppp")
    optimizer = getattr(torch.optim, name)(sharded, lr=0.1, foreach=foreach)
    plain = getattr(torch.optim, name)(reference, lr=0.1, foreach=False)
    for step in range(3):
        for p, q in zip(sharded, reference, strict=True):
            grad = torch.full((4, 3), 1.0 + step) - torch.arange(12.0).view(4, 3) / 7
            p.grad = distribute_tensor(grad, mesh, p.placements) if isinstance(p, DTensor) else grad.clone()
            q.grad = grad.clone()
        try:
            with ExitStack() as stack:
                optimizer.step(then_by_kind(lambda: None, optimizer, stack))
        except RuntimeError as error:
            assert step == 0, error  # DTensor has no rule for one of its ops: it stops at once, or never
            return False
        plain.step()
    for p, q, before in zip(sharded, reference, parameters(mesh, "ppp"), strict=True):
        value = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(value, q, rtol=0, atol=1e-6)
        assert not torch.equal(q, before), f"{name} left a parameter unchanged: the comparison would prove nothing"
    return True


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_steps_shards_exactly_or_is_refused_in_one_line(mesh: Any, name: str, foreach: bool) -> None:
    if steps_like_plain_tensors(mesh, name, foreach):
        refuse_unsteppable(getattr(torch.optim, name)(parameters(mesh, "psr"), lr=0.1))  # steps: nothing refused
        return
    with pytest.raises(ValueError, match=f"torch.optim.{name} cannot update tensor-parallel") as error:
        refuse_unsteppable(getattr(torch.optim, name)(parameters(mesh, "psr"), lr=0.1))
    assert "\n" not in str(error.value) and "HINT: use Adam" in str(error.value)
    with pytest.raises(ValueError, match=f"torch.optim.{name} cannot update"):  # only an interleaved shard
        refuse_unsteppable(getattr(torch.optim, name)(parameters(mesh, "pir"), lr=0.1))
    if name == "Rprop" and torch.__version__ < "2.13":  # 2.11's DTensor has no index_put_ rule even for replicas
        with pytest.raises(ValueError, match=f"torch.optim.{name} cannot update"):
            refuse_unsteppable(getattr(torch.optim, name)(parameters(mesh, "pr"), lr=0.1))
        return
    refuse_unsteppable(getattr(torch.optim, name)(parameters(mesh, "pr"), lr=0.1))  # nothing sharded: it steps
    getattr(torch.optim, name)(parameters(mesh, "pr"), lr=0.1).step()


def test_a_split_dimension_is_a_shard_or_an_interleaved_shard() -> None:
    """One predicate for "ranks hold different parts": `_StridedShard` is no `Shard` subclass in torch 2.13."""
    from torch.distributed.tensor import Partial

    from lightning_parallel.tensor.packed import splits_a_dimension

    assert splits_a_dimension(Shard(1)) and splits_a_dimension(_StridedShard(0, split_factor=3))
    assert not splits_a_dimension(Replicate()) and not splits_a_dimension(Partial())
