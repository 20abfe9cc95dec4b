"""Asynchronous SGD over torch.distributed point-to-point: a parameter server that applies each worker's gradient as
it arrives, the worker's side of the exchange, and staleness accounting. Torch only; no Lightning, no process launch.

Protocol. Rank 0 hosts the server beside its own worker. Every other rank r talks to it over its own two-rank gloo
group {0, r}, served on rank 0 by one thread that alone drives that group (a gloo group is not to be driven from
two threads at once, and a dead worker then breaks only its own pair, which its thread sees at once):

    worker r -> server:  int64 [PUSH, version] then the flat gradient   (or [STOP, version]: r has finished)
    server -> worker r:  int64 [version', applied] then the flat weights after the update

`version` counts the updates the server has applied; a worker sends the version of the weights its gradient was
computed on. Staleness = the server's version when the gradient arrives minus that version: how many updates (by
other workers) landed while it was being computed; 0 with one worker. Rank 0's own worker calls
`ParameterServer.push` in-process (gloo cannot send to its own rank). All updates go through one lock, so they
are applied one at a time, in arrival order.

Staleness bound: a gradient more than `max_staleness` versions old is dropped, not applied; the worker gets the
current weights back at once and its next gradient is fresh. Dropping keeps the one promise of asynchronous SGD
(no worker ever waits for another); making it wait would turn a slow worker's lag into everyone's. The cost is
the dropped gradient's computation, which `staleness()` reports per worker.

Async SGD is not deterministic: the order in which gradients arrive depends on timing. With one worker it is
exactly plain SGD with the same optimizer.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

SERVER_RANK = 0
STOP, PUSH = 0, 1


class WorkerLost(RuntimeError):
    """A remote worker's connection to the parameter server broke (the worker died)."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"worker rank {rank} was lost by the parameter server on rank {SERVER_RANK}: {error}")
        self.rank = rank


class Reply(NamedTuple):
    weights: torch.Tensor  # flat, after the update
    version: int
    applied: bool


@dataclass
class Staleness:
    """What the server saw of one worker's gradients: how many, how many applied, how far behind."""

    pushes: int = 0
    dropped: int = 0
    total_behind: int = 0
    max_behind: int = 0

    def record(self, behind: int, *, dropped: bool) -> None:
        self.pushes += 1
        self.dropped += dropped
        self.total_behind += behind
        self.max_behind = max(self.max_behind, behind)

    def as_dict(self) -> dict[str, float | int]:
        mean = self.total_behind / self.pushes if self.pushes else 0.0
        return {"pushes": self.pushes, "dropped": self.dropped, "mean": mean, "max": self.max_behind}


def flat_gradient(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The gradients of `params` as one vector; a parameter without a gradient contributes zeros."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def load_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        vector_to_parameters(flat.to(params[0].device), params)


class ParameterServer:
    """Steps `optimizer` (the server's own copy of the parameters and optimizer state) on pushed gradients.

    Args:
        optimizer: An optimizer over the server's copies; its parameter order is the order of every flat vector.
        max_staleness: Drop gradients computed on weights more than this many versions old; None keeps all.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, max_staleness: int | None = None) -> None:
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.max_staleness = max_staleness
        self.version = 0
        self._lock = threading.Lock()
        self._seen: dict[int, Staleness] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._lost: list[WorkerLost] = []

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def push(self, worker: int, grad: torch.Tensor, version: int) -> Reply:
        """Apply (or drop, when too stale) one gradient computed on weights of `version`; return the weights now."""
        with self._lock:
            behind = self.version - version
            dropped = self.max_staleness is not None and behind > self.max_staleness
            self._seen.setdefault(worker, Staleness()).record(behind, dropped=dropped)
            if not dropped:
                offset = 0
                for p in self.params:
                    p.grad = grad[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
                    offset += p.numel()
                self.optimizer.step()
                self.version += 1
            return Reply(parameters_to_vector(self.params).detach().clone(), self.version, not dropped)

    def snapshot(self) -> tuple[torch.Tensor, int]:
        """The current weights (flat) and their version."""
        with self._lock:
            return parameters_to_vector(self.params).detach().clone(), self.version

    def follow(self, param_groups: Sequence[Mapping[str, object]]) -> None:
        """Take every hyperparameter but the parameters from `param_groups` (a worker's optimizer, stepped by its
        LR scheduler), so the server's learning rate follows the schedule."""
        with self._lock:
            for mine, theirs in zip(self.optimizer.param_groups, param_groups, strict=True):
                mine.update({key: value for key, value in theirs.items() if key != "params"})

    def optimizer_state(self) -> dict[str, object]:
        with self._lock:
            return self.optimizer.state_dict()

    def load_optimizer_state(self, state: Mapping[str, object]) -> None:
        with self._lock:
            self.optimizer.load_state_dict(dict(state))

    def staleness(self) -> dict[int, dict[str, float | int]]:
        """Per worker rank: pushes, dropped, mean and max versions behind."""
        with self._lock:
            return {rank: seen.as_dict() for rank, seen in sorted(self._seen.items())}

    def serve(self, groups: Mapping[int, dist.ProcessGroup]) -> None:
        """Start one daemon thread per remote worker rank, each the only user of that worker's pair group."""
        for rank, group in groups.items():
            thread = threading.Thread(target=self._serve, args=(rank, group), name=f"ps-rank{rank}", daemon=True)
            self._threads[rank] = thread
            thread.start()

    def _serve(self, rank: int, group: dist.ProcessGroup) -> None:
        header = torch.empty(2, dtype=torch.int64)
        grad = torch.empty(self.numel, dtype=self.params[0].dtype)
        try:
            while True:
                dist.recv(header, src=rank, group=group)
                kind, version = header.tolist()
                if kind == STOP:
                    return
                dist.recv(grad, src=rank, group=group)
                reply = self.push(rank, grad, version)
                dist.send(torch.tensor([reply.version, int(reply.applied)]), dst=rank, group=group)
                dist.send(reply.weights.cpu(), dst=rank, group=group)
        except Exception as error:  # the training thread raises it (`check`): a thread cannot stop the run
            self._lost.append(WorkerLost(rank, error))

    def check(self) -> None:
        """Raise the first lost worker, if any."""
        if self._lost:
            raise self._lost[0]

    def wait_for_workers(self, timeout: float) -> None:
        """Until every remote worker has said STOP (or one is lost: raised); a worker still busy after `timeout`
        seconds raises TimeoutError."""
        for rank, thread in self._threads.items():
            thread.join(timeout)
            self.check()
            if thread.is_alive():
                raise TimeoutError(
                    f"worker rank {rank} did not finish within {timeout:.0f} s of rank {SERVER_RANK}: it is alive "
                    "but stuck. HINT: if its steps legitimately take that long, raise the strategy's timeout"
                )


class ServerClient:
    """A remote worker's side: push a flat gradient, get the server's weights back."""

    def __init__(self, group: dist.ProcessGroup, *, numel: int, dtype: torch.dtype) -> None:
        self.group = group
        self._weights = torch.empty(numel, dtype=dtype)
        self._reply = torch.empty(2, dtype=torch.int64)

    def exchange(self, grad: torch.Tensor, version: int) -> Reply:
        dist.send(torch.tensor([PUSH, version]), dst=SERVER_RANK, group=self.group)
        dist.send(grad.detach().cpu().to(self._weights.dtype), dst=SERVER_RANK, group=self.group)
        dist.recv(self._reply, src=SERVER_RANK, group=self.group)
        dist.recv(self._weights, src=SERVER_RANK, group=self.group)
        new_version, applied = self._reply.tolist()
        return Reply(self._weights, new_version, bool(applied))

    def leave(self, version: int) -> None:
        dist.send(torch.tensor([STOP, version]), dst=SERVER_RANK, group=self.group)
