"""Every torch optimizer over real shards: parameters split unevenly over 4 simulated ranks (`simulated_ranks`)
by rows and by columns, and replicated, step exactly as plain tensors do (three steps, loop, foreach and, where torch
has them, fused kernels), or the optimizer is refused before its first step in one line (`parameter_kinds`). The
one-rank checks of the same, where a shard is the whole tensor, are in test_parameter_kinds.py.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_parallel.one_process_ranks import simulated_ranks
from lightning_parallel.parameter_kinds import refuse_unsteppable, then_by_kind
from lightning_parallel.seams import fused_steps_on_dtensor

RANKS, SHAPE = 4, (6, 5)  # 6 rows over 4 ranks: 2, 2, 1, 1; 5 columns: 2, 1, 1, 1
PLACEMENTS = {"p": None, "r": Replicate(), "s": Shard(0), "c": Shard(1)}
OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop"]
OPTIMIZERS += ["Adafactor"] if hasattr(torch.optim, "Adafactor") else []
FUSED = ["SGD", "Adam", "AdamW", "Adagrad"]


def values(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=generator) for _ in PLACEMENTS]


def gradient(step: int, index: int) -> torch.Tensor:
    """Different per step and per parameter, with entries of both signs and sizes."""
    return torch.sin(torch.arange(30.0).view(SHAPE) * (index + 1) + step) * (1.0 + step)


def run(name: str, kernel: dict[str, bool]) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
    """Three steps over DTensors on the simulated ranks (None when DTensor stops the first) and over plain tensors;
    the DTensors' whole values as each rank sees them, checked equal across ranks."""
    arguments: dict[str, Any] = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    plain = [torch.nn.Parameter(v) for v in values()]
    reference = getattr(torch.optim, name)(plain, **arguments, foreach=False)
    for step in range(3):  # one process, before the simulation: nothing here may become a simulated tensor
        for index, q in enumerate(plain):
            q.grad = gradient(step, index)
        reference.step()
    start = values()  # drawn outside: inside, a generator passed by hand serves the simulated ranks in turn
    with simulated_ranks(RANKS) as mode:
        mesh = init_device_mesh("cpu", (RANKS,), mesh_dim_names=("tp",))
        every = [mode.rank_map(lambda rank, v=v: v.clone()) for v in start]  # each rank's own copy
        placements = PLACEMENTS.values()
        made = [v if p is None else distribute_tensor(v, mesh, [p]) for v, p in zip(every, placements, strict=True)]
        params = [torch.nn.Parameter(v) for v in made]
        optimizer = getattr(torch.optim, name)(params, **arguments, **kernel)
        for step in range(3):
            for index, p in enumerate(params):
                grad = gradient(step, index)
                p.grad = distribute_tensor(grad, mesh, p.placements) if isinstance(p, DTensor) else grad
            try:
                with ExitStack() as stack:
                    optimizer.step(then_by_kind(lambda: None, optimizer, stack))
            except (RuntimeError, AssertionError) as error:  # AssertionError: the simulation's, for the same
                assert step == 0, error  # DTensor has no rule for one of its ops: it stops at once, or never
                refused(name, params)
                return None, []
        wholes = []
        for p in params:
            whole = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            ranks = list(whole._local_tensors.values())  # type: ignore[attr-defined]
            assert all(torch.equal(r, ranks[0]) for r in ranks), f"{name}: ranks disagree"
            wholes.append(ranks[0].clone())
    return wholes, [q.detach() for q in plain]


def refused(name: str, params: list[torch.nn.Parameter]) -> None:
    with pytest.raises(ValueError, match=f"torch.optim.{name} cannot update tensor-parallel") as error:
        refuse_unsteppable(getattr(torch.optim, name)(params, lr=0.1))
    assert "\n" not in str(error.value)


KERNELS = [(n, {"foreach": False}) for n in OPTIMIZERS] + [(n, {"foreach": True}) for n in OPTIMIZERS]
KERNELS += [(n, {"fused": True}) for n in FUSED]


@pytest.mark.parametrize(("name", "kernel"), KERNELS, ids=[f"{n}-{next(iter(k))}" for n, k in KERNELS])
def test_every_optimizer_steps_real_shards_exactly_or_is_refused(name: str, kernel: dict[str, bool]) -> None:
    fused_steps_on_dtensor()
    sharded, plain = run(name, kernel)
    if sharded is None:
        return
    refuse_unsteppable(getattr(torch.optim, name)([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    for letter, got, want, before in zip(PLACEMENTS, sharded, plain, values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{name} {kernel} placement {letter!r}")
        assert not torch.equal(want, before), f"{name} left a parameter unchanged: the comparison would prove nothing"
