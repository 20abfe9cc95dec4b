"""Fault-tolerant replica groups over torchft: one group's `Manager` (a quorum with the other groups through the
lighthouse, a process group formed anew whenever the quorum changes, the live state a rejoining group receives) and
the gradient average over the groups of the current quorum. Torch and torchft only; torchft is imported on first use,
never at package import. When a step commits and what Lightning counts is `strategies/fault_tolerant.py`'s."""

from __future__ import annotations

import copy
import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.replicas import reduce_as_one_

__all__ = ["GroupSpec", "LIGHTHOUSE_ENV", "average_gradients_", "join", "lighthouse_address", "require_torchft"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse address
INSTALL_HINT = "pip install 'lightning_parallel[ft]' (torchft>=0.2)"
LIGHTHOUSE_HINT = "start one with `torchft_lighthouse --min_replicas 1` and pass lighthouse=http://HOST:29510"


def require_torchft(module: str = "torchft") -> ModuleType:
    """torchft (or one of its modules, "torchft.local_sgd"), or one line saying how to install it."""
    # torchft logs a few INFO lines per step (the quorum, the vote) from Rust, whose logger reads RUST_LOG once at
    # import, and from Python; keep them out of the run's output unless asked for (RUST_LOG=info, and a level set
    # on the "torchft" logger).
    os.environ.setdefault("RUST_LOG", "warn")
    if logging.getLogger("torchft").level == logging.NOTSET:
        logging.getLogger("torchft").setLevel(logging.WARNING)
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"fault-tolerant replica groups need torchft, which does not import here ({error}). HINT: {INSTALL_HINT}"
        ) from None


def lighthouse_address(given: str | None) -> str:
    """The lighthouse to ask for quorums: `given`, else $TORCHFT_LIGHTHOUSE, else one line saying how to start one."""
    address = given or os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise ValueError(
            f"no torchft lighthouse: lighthouse=None and ${LIGHTHOUSE_ENV} is unset. HINT: {LIGHTHOUSE_HINT}"
        )
    return address


@dataclass(frozen=True)
class GroupSpec:
    """What one replica group tells torchft.

    Args:
        replica_group: this group's number (0 .. groups - 1); a restarted group takes its old number.
        min_replicas: a step commits only when at least this many groups took part in it.
        lighthouse: the lighthouse's address, e.g. "http://host:29510".
        timeout: one collective across groups, the commit vote or a state transfer gives up after this.
        quorum_timeout: how long a group waits for a quorum (a joining DiLoCo group waits for the others' next sync).
    """

    replica_group: int
    min_replicas: int
    lighthouse: str
    timeout: timedelta
    quorum_timeout: timedelta


def join(
    spec: GroupSpec,
    *,
    rank: int,
    world_size: int,
    store: tuple[str, int],
    device: torch.device,
    state: Callable[[], dict[str, Any]],
    load_state: Callable[[dict[str, Any]], None],
) -> Any:
    """This process's torchft `Manager` for its group (`rank` of `world_size` inside it; the group's TCP store at
    `store`, which rank 0 of the group already serves). `state()` is what a rejoining group receives; it is copied
    when taken, since the sender keeps training (BatchNorm statistics change in its forward) while a peer downloads."""
    torchft = require_torchft()
    process_group = torchft.ProcessGroupNCCL if device.type == "cuda" else torchft.ProcessGroupGloo
    manager = torchft.Manager(
        pg=process_group(timeout=spec.timeout),
        load_state_dict=load_state,
        state_dict=lambda: copy.deepcopy(state()),
        min_replica_size=spec.min_replicas,
        # The quorum is awaited before the step's forward: a group that heals takes the weights before computing on
        # them, and no state is read by the transfer thread while the step changes it (DiLoCo needs this anyway).
        use_async_quorum=False,
        timeout=spec.timeout,
        quorum_timeout=spec.quorum_timeout,
        connect_timeout=spec.timeout,
        rank=rank,
        world_size=world_size,
        store_addr=store[0],
        store_port=store[1],
        lighthouse_addr=spec.lighthouse,
        replica_id=f"group{spec.replica_group}",  # torchft appends a fresh uuid per start
    )
    quorums_on_daemon_threads(manager)
    return manager


def quorums_on_daemon_threads(manager: Any) -> None:
    """Run `manager`'s quorums on daemon threads. torchft (0.2) runs each on a `ThreadPoolExecutor`'s thread
    (`Manager._executor`), which Python joins at exit: a process whose group peer died, its quorum waiting for that
    peer until `quorum_timeout`, outlived its own failure by that long, and torchrun's SIGTERM by its 30 s grace (each
    restart waited for the SIGKILL). A torchft without that executor is left as it is."""
    executor = getattr(manager, "_executor", None)
    if isinstance(executor, ThreadPoolExecutor):
        executor.shutdown(wait=False)  # it has run nothing yet: no thread was started
        manager._executor = DaemonCalls()


class DaemonCalls(Executor):
    """An executor running each call on a daemon thread of its own (torchft submits one quorum at a time, each after
    the one before has ended), so a call still waiting at exit does not hold the process."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # as concurrent.futures' own workers: the waiter gets it
                future.set_exception(error)

        threading.Thread(target=run, name="async_quorum", daemon=True).start()
        return future


@torch.no_grad()
def average_gradients_(manager: Any, parameters: Iterable[Tensor]) -> None:
    """Replace each gradient by its mean over the groups of the current quorum: one float32 all-reduce through the
    manager per device. Every group sends the same buffer: its gradients (a missing one as zeros) and one flag per
    parameter saying whether it had one. A gradient missing on every group stays None, as one process training on
    all the groups' batches would leave it (torch's optimizers then leave the parameter, its moments and its weight
    decay alone); one missing on some groups only gets the quorum's mean, its own part zero. After a failed collective
    the values are garbage, and the manager's commit vote says no."""
    parameters = list(parameters)
    devices = {p.device for p in parameters}
    # per device, one flag per parameter on it (1: it has a gradient), read back in one copy afterwards
    flags = {d: torch.tensor([float(p.grad is not None) for p in parameters if p.device == d]).to(d) for d in devices}
    views = {d: iter(flags[d].split(1)) for d in devices}
    present = [next(views[p.device]) for p in parameters]
    gradients = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    reduce_as_one_([*gradients, *present], lambda flat: manager.allreduce(flat).wait())
    kept = {d: iter(f.tolist()) for d, f in flags.items()}
    for p, gradient in zip(parameters, gradients, strict=True):
        p.grad = gradient if next(kept[p.device]) > 0 else None
