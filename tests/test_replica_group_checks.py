"""Fault-tolerant replica groups (`strategy=ft_ddp`, `ft_local_sgd`, `ft_diloco`) checked in this process: the
one-line refusals (which need no torchft), the epoch limit lifted, the Manager's store per use, its quorums on daemon
threads, and ft_ddp's gradient exchange against one process with two groups simulated as threads. The live groups
are in test_replica_groups.py.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import re
import sys
import threading
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from lightning_parallel.rendezvous import bound_store, store_beside
from lightning_parallel.replica_groups import average_gradients_, lighthouse_address, require_torchft
from lightning_parallel.strategies.fault_tolerant import FaultTolerantStrategy, check_fit, lift_epoch_limit
from lightning_parallel.strategies.group_sync import EveryStep
from lightning_parallel.token_mean import TokenMean

ROOT = Path(__file__).resolve().parents[1]


def test_only_replica_groups_imports_torchft_and_only_when_asked() -> None:
    """torchft is an optional extra: no module of the package imports it at import time; `replica_groups.py` does,
    through `require_torchft`, when a fault-tolerant fit starts."""
    offenders = []
    for path in sorted((ROOT / "lightning_parallel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "torchft" for name in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


BASE = {"replica_group": 0, "replica_groups": 2}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"replica_group": 3, "replica_groups": 3}, "replica_group must be below replica_groups=3"),
        ({**BASE, "min_replicas": 3}, "min_replicas must be at most replica_groups=2"),
        ({**BASE, "sync": "gossip"}, "sync must be one of ddp, local_sgd, diloco"),
        ({**BASE, "period": 4}, "period must be None with sync='ddp'"),
        ({**BASE, "sync": "diloco"}, "period must be an integer >= 1"),
        ({**BASE, "sync": "local_sgd", "period": 4, "outer_optimizer": partial(torch.optim.SGD, lr=0.7)}, "unless"),
        ({**BASE, "replica_timeout": 0}, "replica_timeout must be a positive number of seconds"),
    ],
)
def test_bad_arguments_are_one_line(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        FaultTolerantStrategy(**arguments)
    assert "\n" not in str(error.value) and "HINT: " in str(error.value)


def test_no_lighthouse_and_no_torchft_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=r"TORCHFT_LIGHTHOUSE is unset\. HINT: start one with `torchft_lighthouse"):
        lighthouse_address(None)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://here:29510")
    assert lighthouse_address(None) == "http://here:29510" and lighthouse_address("http://there:1") == "http://there:1"
    monkeypatch.setenv("RUST_LOG", "warn")  # restored afterwards
    monkeypatch.setitem(sys.modules, "torchft", None)  # what `import torchft` meets when it is not installed
    with pytest.raises(ImportError, match=r"HINT: pip install 'lightning_parallel\[ft\]'"):
        require_torchft()


def test_a_fit_needs_max_steps_automatic_optimization_one_optimizer_and_no_grad_scaler() -> None:
    module, plugin, one = SimpleNamespace(automatic_optimization=True), SimpleNamespace(scaler=None), [object()]
    good = {"max_steps": 10, "lightning_module": module, "optimizers": one, "precision_plugin": plugin}
    strategy = FaultTolerantStrategy(**BASE)
    check_fit(strategy, SimpleNamespace(**good), per_step=True)  # type: ignore[arg-type]
    fp16 = {"precision_plugin": SimpleNamespace(scaler=object()), "precision": "16-mixed"}
    check_fit(strategy, SimpleNamespace(**{**good, **fp16}), per_step=False)  # type: ignore[arg-type]  # DiLoCo
    for changed, message in [
        ({"max_steps": -1}, "set trainer.max_steps=N"),
        ({"lightning_module": SimpleNamespace(automatic_optimization=False)}, "manual optimization"),
        ({"optimizers": [object(), object()]}, "return one optimizer"),
        (fp16, "HINT: precision=bf16-mixed"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_fit(strategy, SimpleNamespace(**{**good, **changed}), per_step=True)  # type: ignore[arg-type]


class Quorum:
    """`groups` replica groups of one process each, as threads of this one: each holds a `member(g)` with the
    Manager methods the gradient exchange uses (`allreduce`, `num_participants`), reducing over all the threads."""

    def __init__(self, groups: int) -> None:
        self.groups, self.sent = groups, [torch.empty(0)] * groups
        self.barrier = threading.Barrier(groups, timeout=30)

    def member(self, group: int) -> Any:
        def allreduce(tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG) -> Any:
            self.sent[group] = tensor.clone()
            self.barrier.wait()
            total = torch.stack(self.sent).sum(0)
            self.barrier.wait()
            tensor.copy_(total / self.groups if reduce_op == ReduceOp.AVG else total)
            return SimpleNamespace(wait=lambda: tensor)

        return SimpleNamespace(allreduce=allreduce, num_participants=lambda: self.groups)


class Branching(torch.nn.Module):
    """A token network with a branch taken only by rows that start with token 0 (group 0's batch has one, group 1's
    none: its `extra` has no gradient) and a layer no row uses (no gradient anywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)
        self.extra, self.unused = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)  # (B, T, 4)
        logits = self.head(hidden)
        rows = x[:, 0] == 0
        if rows.any():
            logits = logits + self.extra(hidden) * rows[:, None, None]
        return logits


def step_on(network: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, divisor: Any = None) -> tuple[float, Any]:
    """The mean cross-entropy over the valid (not -100) targets, its backward, and an AdamW (weight decay on) to step
    with afterwards."""
    optimizer = torch.optim.AdamW(network.parameters(), lr=0.1, weight_decay=0.5)
    with TokenMean(divisor) if divisor is not None else contextlib.nullcontext():
        loss = torch.nn.functional.cross_entropy(network(x).flatten(0, 1), y.flatten())
    loss.backward()
    return float(loss), optimizer


def test_ft_ddp_exchange_is_one_process_on_padded_text_and_leaves_missing_gradients_none() -> None:
    """ft_ddp's arithmetic with 2 groups simulated as threads: each step's token mean is divided by the valid tokens
    of both groups' batches (counted through the manager) and the gradients averaged over the groups; a gradient no
    group has stays None. Equals one process on both batches together, AdamW with weight decay (1e-6)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(1, 8, (8, 6), generator=generator)
    x[1, 0] = 0  # group 0's batch (rows 0-3) takes the branch; group 1's (rows 4-7) does not
    y = torch.randint(0, 8, (8, 6), generator=generator)
    for row, valid in enumerate([6, 1, 2, 3, 6, 6, 5, 6]):  # group 0: 12 valid targets, group 1: 23
        y[row, valid:] = -100
    torch.manual_seed(0)
    reference = Branching()
    groups = [copy.deepcopy(reference) for _ in range(2)]
    loss, optimizer = step_on(reference, x, y)
    optimizer.step()
    quorum, losses, errors = Quorum(2), [0.0, 0.0], []

    def group(g: int) -> None:
        try:
            agreement = EveryStep(quorum.member(g))
            rows = slice(4 * g, 4 * g + 4)
            losses[g], inner = step_on(groups[g], x[rows], y[rows], agreement.token_divisor(1))
            average_gradients_(agreement.manager, list(groups[g].parameters()))
            inner.step()
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    threads = [threading.Thread(target=group, args=(g,)) for g in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert groups[0].extra.weight.grad is not None and groups[1].extra.weight.grad is not None
    assert groups[0].unused.weight.grad is None and groups[1].unused.weight.grad is None
    assert abs(sum(losses) / 2 - loss) < 1e-6, (losses, loss)
    for network in groups:
        for (name, p), q in zip(network.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_an_epoch_limit_is_lifted_in_one_line() -> None:
    """Groups end at max_steps: a finite max_epochs is lifted (a rejoined group would end at an epoch of its own)."""
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(max_epochs=15), max_steps=400)
    with pytest.warns(UserWarning, match=r"trainer\.max_epochs=15 lifted; .* at trainer\.max_steps=400") as caught:
        lift_epoch_limit(FaultTolerantStrategy(**BASE), trainer)  # type: ignore[arg-type]
    assert trainer.fit_loop.max_epochs == -1 and "\n" not in str(caught[0].message)
    lift_epoch_limit(FaultTolerantStrategy(**BASE), trainer)  # type: ignore[arg-type]  # nothing left to lift, no line


def test_the_managers_store_is_new_for_each_use() -> None:
    """The Manager's keys go to a store beside this attempt's, one per use, so a restarted rank never reads the
    address of a Manager of an earlier attempt (torchrun's own store keeps keys across restarts)."""
    timeout = timedelta(seconds=10)
    main = bound_store("127.0.0.1", 0, rank=0, world_size=2, timeout=timeout)
    other = torch.distributed.TCPStore("127.0.0.1", main.port, 2, is_master=False, timeout=timeout)
    places = []
    for use in range(2):
        key = f"manager/{use}"
        here = store_beside(main, "127.0.0.1", key=key, rank=0, world_size=2, timeout=timeout)
        assert store_beside(other, "127.0.0.1", key=key, rank=1, world_size=2, timeout=timeout) == here
        client = torch.distributed.TCPStore(*here, 2, is_master=False, timeout=timeout)
        assert not client.check(["manager_addr"])  # empty: nothing of an earlier Manager
        client.set("manager_addr", f"use {use}")
        places.append(here)
    assert places[0] != places[1] and main.port not in {port for _, port in places}


def test_a_quorum_still_waiting_at_exit_does_not_hold_the_process() -> None:
    """torchft's Manager runs quorums on a ThreadPoolExecutor, whose threads Python joins at exit: a survivor whose
    group peer died waited there for its quorum's timeout, past torchrun's SIGTERM grace (tests/test_replica_groups.py
    times the restart). Its quorums go to daemon threads instead, each result or error handed to the waiter."""
    import inspect
    from concurrent.futures import ThreadPoolExecutor

    from lightning_parallel.replica_groups import quorums_on_daemon_threads

    torchft = pytest.importorskip("torchft")
    assert "self._executor = ThreadPoolExecutor(" in inspect.getsource(torchft.Manager.__init__)  # where it looks
    manager = SimpleNamespace(_executor=ThreadPoolExecutor(max_workers=1))
    quorums_on_daemon_threads(manager)
    release = threading.Event()
    waiting = manager._executor.submit(lambda: release.wait(60) and threading.current_thread().daemon)
    names = {thread.name: thread.daemon for thread in threading.enumerate()}
    release.set()
    assert names["async_quorum"] and waiting.result(10) is True
    assert isinstance(manager._executor.submit(lambda: 1 / 0).exception(10), ZeroDivisionError)
    manager._executor.shutdown(wait=True)  # as torchft's Manager.shutdown calls it
