"""Optimizer steps over parameters of several kinds. torch's foreach and fused kernels (foreach is the default for
CUDA tensors) take plain tensors or DTensors in one call, never both, and a tensor-parallel model keeps the layers its
plan leaves whole as plain tensors. So the update runs each param group one kind at a time; outside the update the
optimizer holds exactly the groups the user built (what checkpoints, LR schedulers and `training_step` see).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_parallel.seams import torch_at_least
from lightning_parallel.tensor.packed import splits_a_dimension

# torch optimizers whose update DTensor cannot run on a sharded parameter, why, and the first torch that can (None:
# none of 2.11 to 2.15). Rprop's masked write (index_put_) runs on shards from torch 2.15 on.
CANNOT_STEP_SHARDS: dict[str, tuple[str, tuple[int, int] | None]] = {
    "Rprop": ("its update writes into the parameter through a mask (index_put_)", (2, 15)),
    "Adafactor": ("its update factors each gradient into row and column norms in place", None),
}


# ... and those DTensor cannot step even on replicated parameters before a torch version: torch 2.11's DTensor has no
# rule for index_put_ at all ("does not have a sharding strategy registered"); 2.13's has one (2.12 not measured).
CANNOT_STEP_REPLICAS: dict[str, tuple[int, int]] = {"Rprop": (2, 13)}


def _refused_here(name: str) -> bool:
    fixed_in = CANNOT_STEP_SHARDS[name][1]
    return fixed_in is None or not torch_at_least(fixed_in)


def kind(tensor: torch.Tensor) -> Hashable:
    """What a foreach or fused kernel can take together with `tensor`: plain tensors, or DTensors on one mesh."""
    if isinstance(tensor, DTensor):
        return ("dtensor", tensor.device_mesh)
    return ("tensor",)


def mixes_kinds(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any param group of `optimizer` holds parameters of more than one kind."""
    return any(len({kind(p) for p in group["params"]}) > 1 for group in optimizer.param_groups)


@contextmanager
def groups_by_kind(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block each param group that mixes kinds is one group per kind, with the same hyperparameters;
    afterwards the user's groups are back, with any hyperparameter the block rebound copied into them."""
    original = optimizer.param_groups
    parts: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for group in original:
        by_kind = _split(group["params"])
        if len(by_kind) <= 1:
            parts.append((group, group))  # one kind: the user's own dict, so in-place changes land directly
        else:
            parts.extend((group, {**group, "params": params}) for params in by_kind)
    optimizer.param_groups = [part for _, part in parts]
    try:
        yield
    finally:
        optimizer.param_groups = original
        for group, part in parts:
            for key, value in part.items():
                if key != "params" and value is not group[key]:
                    group[key] = value


def _split(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` in groups of one kind, each in the order given (the first of each kind decides the group order)."""
    groups: dict[Hashable, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(kind(p), []).append(p)
    return list(groups.values())


def then_by_kind(closure: Callable[[], Any], optimizer: Any, stack: ExitStack) -> Callable[[], Any]:
    """`closure` (the forward and backward Lightning hands the optimizer), after which `optimizer`'s groups stay split
    by kind until `stack` closes, so only the update sees the split. `optimizer` may be a LightningOptimizer."""
    inner: torch.optim.Optimizer = getattr(optimizer, "_optimizer", optimizer)

    def closure_then_split() -> Any:
        result = closure()
        if mixes_kinds(inner):
            stack.enter_context(groups_by_kind(inner))
        return result

    return closure_then_split


class OptimizerRefused(ValueError):
    """An optimizer that cannot update this layout's parameters; every rank raises the same one line (so a caller
    prints it once)."""

    same_on_every_rank = True


def refuse_unsteppable(optimizer: torch.optim.Optimizer) -> None:
    """One line, before the first step, for an optimizer listed in CANNOT_STEP_SHARDS over sharded parameters
    (DTensor would stop it mid-step, on every rank, with an error about placements)."""
    listed = (n for n in CANNOT_STEP_SHARDS if _refused_here(n))
    name = next((n for n in listed if isinstance(optimizer, getattr(torch.optim, n, ()))), None)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    everywhere = name in CANNOT_STEP_REPLICAS and not torch_at_least(CANNOT_STEP_REPLICAS[name])
    dtensors = [p for p in params if isinstance(p, DTensor)]
    refused = [p for p in dtensors if everywhere or any(splits_a_dimension(s) for s in p.placements)]
    if name is not None and refused:
        on = "any DTensor, a replicated one too," if everywhere else "a shard"
        raise OptimizerRefused(
            f"torch.optim.{name} cannot update tensor-parallel {'' if everywhere else '(sharded) '}parameters: "
            f"{CANNOT_STEP_SHARDS[name][0]}, which DTensor cannot do on {on} in torch {torch.__version__}. "
            "HINT: use Adam, AdamW, SGD, Adagrad, RMSprop, NAdam or RAdam (foreach and fused work), or train without "
            "tensor parallelism"
        )
