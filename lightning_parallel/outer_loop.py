"""DiLoCo's outer loop over one process group: replicas step alone for `period` inner steps, then the average of
their parameter change since the last sync (the pseudo-gradient, old - new) goes through an outer optimizer and
every replica continues from the result. Torch only: it neither knows Lightning nor decides what a replica is."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.replicas import average_

__all__ = ["OuterLoop"]


class OuterLoop:
    """The synced copy of the parameters and the outer optimizer that moves it.

    Args:
        parameters: (name, parameter) pairs the inner optimizer trains; all replicas hold equal values at the start.
        outer_optimizer: builds the outer optimizer from a list of tensors (e.g. `partial(torch.optim.SGD, lr=0.7,
            momentum=0.9, nesterov=True)`, DiLoCo's choice).
        period: inner steps between syncs (H).
        buffers: (name, buffer) pairs averaged at each sync without an outer step (BatchNorm running statistics).
        group: the replicas averaged over (the data-parallel group; None: the default group).
    """

    def __init__(
        self,
        parameters: Iterable[tuple[str, Tensor]],
        *,
        outer_optimizer: Callable[[list[Tensor]], Optimizer],
        period: int,
        buffers: Iterable[tuple[str, Tensor]] = (),
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if period < 1:
            raise ValueError(f"OuterLoop(period={period}): period must be >= 1. HINT: period=500")
        self.parameters = dict(parameters)
        self.buffers = dict(buffers)
        self.synced = {name: p.detach().clone() for name, p in self.parameters.items()}
        self.optimizer = outer_optimizer(list(self.synced.values()))
        self.period = period
        self.group = group
        self.inner_steps = 0

    def step(self) -> bool:
        """Count one inner step; every `period`-th one syncs. Returns whether it synced."""
        self.inner_steps += 1
        if self.inner_steps % self.period:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients and buffers over the group, take one outer step, load it into the replica."""
        pseudo = [old - new for old, new in zip(self.synced.values(), self.parameters.values(), strict=True)]
        average_([*pseudo, *self.buffers.values()], self.group)
        for old, gradient in zip(self.synced.values(), pseudo, strict=True):
            old.grad = gradient
        self.optimizer.step()  # the same inputs on every replica: the same result everywhere
        self.optimizer.zero_grad(set_to_none=True)
        for old, new in zip(self.synced.values(), self.parameters.values(), strict=True):
            new.copy_(old)

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs besides each replica's own state: the synced copy, the outer optimizer, the count."""
        synced = {name: tensor.clone() for name, tensor in self.synced.items()}
        return {"synced": synced, "outer_optimizer": self.optimizer.state_dict(), "inner_steps": self.inner_steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["synced"].keys() != self.synced.keys():
            missing = sorted(self.synced.keys() - state["synced"].keys())
            extra = sorted(state["synced"].keys() - self.synced.keys())
            raise ValueError(
                f"OuterLoop state: parameters missing {missing[:5]}, unexpected {extra[:5]}. "
                "HINT: resume with the model that wrote the checkpoint"
            )
        for name, tensor in self.synced.items():
            tensor.copy_(state["synced"][name])
        self.optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_steps = int(state["inner_steps"])
