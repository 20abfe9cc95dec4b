"""Fault-tolerant replica groups over torchft (`strategy=ft_ddp`, `ft_local_sgd`, `ft_diloco`): three groups of one
process each and a lighthouse started by the README's command. One group SIGKILLs itself mid-run; the other two keep
training while it is gone; the test restarts it (as torchrun or SLURM would) and it rejoins with the others' weights,
received live. Plus the one-line refusals, which need no torchft.

Each process logs every step as it ends (tests/workers/replica_group.py), so the test reads when each step happened,
in which quorum, with which weights. The runs are skipped when torchft is not installed (the `ft` and `dev` extras
install it).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from distributed import free_port, start_worker
from torch.distributed import ReduceOp

from lightning_parallel.rendezvous import bound_store, store_beside
from lightning_parallel.replica_groups import average_gradients_, lighthouse_address, require_torchft
from lightning_parallel.strategies.fault_tolerant import FaultTolerantStrategy, check_fit, lift_epoch_limit
from lightning_parallel.strategies.group_sync import EveryStep
from lightning_parallel.token_mean import TokenMean

GROUPS, BATCH, STEPS = 3, 4, 24
KILLED = 2


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


@pytest.fixture(scope="module")
def lighthouse() -> Iterator[str]:
    """torchft's lighthouse, started the way the README says; quick death detection for a short test."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install 'lightning_parallel[ft]'")
    # pip puts it beside this interpreter (a venv's bin/, which need not be on PATH)
    command = shutil.which("torchft_lighthouse", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if command is None:
        pytest.skip("torchft_lighthouse is not installed (it comes with torchft)")
    port = free_port()
    args = ["--bind", f"[::]:{port}", "--min_replicas", "2", "--join_timeout_ms", "3000"]
    args += ["--heartbeat_timeout_ms", "2000", "--quorum_tick_ms", "50"]
    server = subprocess.Popen([command, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("torchft_lighthouse did not start")
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.kill()
    server.wait()


def launch(out: Path, config: dict[str, Any]) -> Any:
    """One replica group: a process with a world of its own (its own store port), as `python train.py` gives it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "payload.json").write_text(json.dumps(config))
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "RANK": "0"}
    return start_worker("replica_group", out, {**world, "LOCAL_RANK": "0", "NODE_RANK": "0"})


def steps(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition: Any, what: str, procs: list[Any], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        failed = [proc for proc in procs if proc.exitcode not in (None, 0)]
        assert not failed and time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def last_step(out: Path) -> int:
    run = steps(out)
    return run[-1]["step"] if run else 0


def run_with_a_kill(tmp_path: Path, lighthouse: str, sync: str, *, kill_at: int, hold_at: int, **extra: Any) -> dict:
    """Groups 0 and 1 train throughout; group 2 kills itself in step `kill_at`. The survivors hold after step
    `hold_at` until group 2's restart has joined the lighthouse (so the test knows the restart comes mid-run)."""
    restarted = tmp_path / "restarted"
    base = {"steps": STEPS, "batch": BATCH, "lighthouse": lighthouse, "replica_groups": GROUPS, "sync": sync, **extra}
    procs = {}
    if sync == "ddp":  # one process with the three groups' batches together
        reference = {"reference": True, "steps": STEPS, "batch": BATCH * GROUPS, "save_at": extra.get("save_at")}
        procs["reference"] = launch(tmp_path / "reference", reference)
    for group in range(GROUPS):
        config = {**base, "replica_group": group, "start_together": [str(tmp_path), GROUPS]}
        config.update({"kill_at": kill_at} if group == KILLED else {"hold_at": [hold_at, str(restarted)]})
        procs[f"group{group}"] = launch(tmp_path / f"group{group}", config)
    survivors = ["group0", "group1"]
    try:
        procs[f"group{KILLED}"].join(120)
        assert procs[f"group{KILLED}"].exitcode == -signal.SIGKILL, f"group{KILLED} was not killed"
        killed_at = time.time()
        reached = lambda: all(last_step(tmp_path / name) >= hold_at for name in survivors)  # noqa: E731
        wait_for(reached, f"the survivors' step {hold_at}", [procs[name] for name in survivors])
        restarted_at = time.time()
        config = {**base, "replica_group": KILLED, "announce": str(restarted)}
        procs["restarted_group"] = launch(tmp_path / "restarted_group", config)
        for proc in procs.values():
            proc.join(180)
    finally:
        for proc in procs.values():
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    for name in [name for name in procs if name != f"group{KILLED}"]:
        assert procs[name].exitcode == 0, f"{name} failed:\n" + (tmp_path / name / "log.txt").read_text()[-4000:]
    return {
        "runs": {name: steps(tmp_path / name) for name in [*survivors, f"group{KILLED}", "restarted_group"]},
        "reference": steps(tmp_path / "reference"),
        "results": {name: torch.load(tmp_path / name / "result.pt") for name in [*survivors, "restarted_group"]},
        "killed_at": killed_at,
        "restarted_at": restarted_at,
    }


def assert_steps_counted_once(run: list[dict[str, Any]], first: int, refused_step_stays: bool = True) -> None:
    """Within one process the step count rises by one per step in effect; a step the groups did not commit repeats
    the count (a local SGD sync that did not commit leaves its inner step in effect) and is counted in
    `not_committed`, never silently; a heal jumps to the sender's count."""
    assert run[0]["step"] == first
    for before, after in zip(run, run[1:], strict=False):
        if after["heals"] > before["heals"]:
            assert after["step"] > before["step"]
        elif after["not_committed"] > before["not_committed"]:
            assert after["step"] == before["step"] + (0 if refused_step_stays else 1), (before, after)
        else:
            assert after["step"] == before["step"] + 1, (before, after)


def assert_groups_agree(runs: dict[str, list[dict[str, Any]]], at: Any) -> dict[int, float]:
    """At every step `at` selects, every process that logged it holds the same weights (their checksums)."""
    sums: dict[int, set[float]] = defaultdict(set)
    for run in runs.values():
        for record in run:
            if at(record):
                sums[record["step"]].add(record["sum"])
    assert all(len(values) == 1 for values in sums.values()), {s: v for s, v in sums.items() if len(v) > 1}
    return {step: values.pop() for step, values in sums.items()}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory, lighthouse: str) -> dict:
    out = tmp_path_factory.mktemp("ft_ddp")
    return {**run_with_a_kill(out, lighthouse, "ddp", kill_at=5, hold_at=12, save_at=4), "out": out}


@pytest.mark.slow
def test_ddp_groups_train_on_while_one_is_dead_and_it_rejoins_with_the_current_weights(ddp_run: dict) -> None:
    runs, killed_at, restarted_at = ddp_run["runs"], ddp_run["killed_at"], ddp_run["restarted_at"]
    # the killed group's first life: steps 1..4, then it died inside step 5
    assert [r["step"] for r in runs[f"group{KILLED}"]] == [1, 2, 3, 4]
    for survivor in ("group0", "group1"):
        run = runs[survivor]
        assert_steps_counted_once(run, first=1)
        assert run[-1]["step"] == STEPS
        alone = [r for r in run if killed_at < r["t"] < restarted_at and r["step"] >= 5]  # steps after the kill
        assert len(alone) >= 5 and all(r["groups"] == 2 for r in alone)
        assert run[-1]["not_committed"] >= 1  # the step group 2 died in: refused, counted, nothing applied
    rejoined = runs["restarted_group"]
    assert rejoined[0]["heals"] == 1 and rejoined[0]["step"] > 12 and rejoined[0]["groups"] == GROUPS
    assert_steps_counted_once(rejoined, first=rejoined[0]["step"])
    assert rejoined[-1]["step"] == STEPS
    # every process holds the same weights after every step, the rejoined group from its first step on
    assert_groups_agree(runs, at=lambda record: True)
    final = [result["state"] for result in ddp_run["results"].values()]
    for state in final[1:]:
        torch.testing.assert_close(state, final[0], rtol=0, atol=0)
    assert all(result["describe"]["steps"]["applied"] == STEPS for result in ddp_run["results"].values())
    # each group evaluates the whole validation set: equal weights give equal metrics
    assert len({result["val_loss"] for result in ddp_run["results"].values()}) == 1


@pytest.mark.slow
def test_ddp_groups_equal_one_process_while_all_take_part(ddp_run: dict) -> None:
    """Before the kill all three groups average their gradients: one process with the three batches together."""
    reference = {r["step"]: r for r in ddp_run["reference"]}
    together = [ddp_run["runs"][name][:4] for name in ("group0", "group1", f"group{KILLED}")]
    for records in zip(*together, strict=True):
        step = records[0]["step"]
        assert [(r["step"], r["groups"], r["not_committed"]) for r in records] == [(step, GROUPS, 0)] * GROUPS
        assert abs(sum(r["loss"] for r in records) / GROUPS - reference[step]["loss"]) < 1e-5
        assert abs(records[0]["sum"] - reference[step]["sum"]) < 1e-5
    expected = torch.load(ddp_run["out"] / "reference" / "state4.pt")
    for name in ("group0", "group1", f"group{KILLED}"):  # the weights after step 4, the last before the kill
        torch.testing.assert_close(torch.load(ddp_run["out"] / name / "state4.pt"), expected, rtol=0, atol=1e-5)


PERIOD = 4


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory: pytest.TempPathFactory, lighthouse: str) -> dict:
    return run_with_a_kill(
        tmp_path_factory.mktemp("ft_diloco"), lighthouse, "diloco", kill_at=6, hold_at=12, period=PERIOD
    )


@pytest.mark.slow
def test_diloco_groups_sync_on_while_one_is_dead_and_it_rejoins_at_a_sync(diloco_run: dict) -> None:
    """torchft's DiLoCo: a quorum at every `period`-th step only. The killed group dies between syncs; the
    survivors' next syncs go on without it; restarted, it trains alone up to its first sync and receives the others'
    state there (weights, inner and outer optimizer, synced copy, step count)."""
    runs, killed_at, restarted_at = diloco_run["runs"], diloco_run["killed_at"], diloco_run["restarted_at"]
    assert [r["step"] for r in runs[f"group{KILLED}"]] == [1, 2, 3, 4, 5]
    for survivor in ("group0", "group1"):
        run = runs[survivor]
        assert_steps_counted_once(run, first=1)
        assert run[-1]["step"] == STEPS and run[-1]["not_committed"] == 0 and run[-1]["discarded"] == 0
        syncs_alone = [r for r in run if killed_at < r["t"] < restarted_at and r["step"] % PERIOD == 0]
        assert [r["step"] for r in syncs_alone] == [8, 12] and all(r["groups"] == 2 for r in syncs_alone)
    rejoined = runs["restarted_group"]
    assert_steps_counted_once(rejoined, first=1)
    healed = next(r for r in rejoined if r["heals"] == 1)
    assert healed["step"] > 12 and healed["step"] % PERIOD == 0 and healed["groups"] == GROUPS
    assert rejoined[-1]["step"] == STEPS
    # after every sync every process holds the same weights (between syncs each group has its own)
    assert_groups_agree(runs, at=lambda record: record["step"] % PERIOD == 0)
    final = [result["state"] for result in diloco_run["results"].values()]
    for state in final[1:]:
        torch.testing.assert_close(state, final[0], rtol=0, atol=0)


@pytest.fixture(scope="module")
def local_sgd_run(tmp_path_factory: pytest.TempPathFactory, lighthouse: str) -> dict:
    return run_with_a_kill(
        tmp_path_factory.mktemp("ft_local_sgd"),
        lighthouse,
        "local_sgd",
        kill_at=8,
        hold_at=12,
        period=PERIOD,
        kill_in="exchange",
    )


@pytest.mark.slow
def test_local_sgd_groups_survive_a_group_lost_inside_a_sync(local_sgd_run: dict) -> None:
    """torchft's LocalSGD: the killed group dies inside the sync of step 8, which the survivors then cannot finish: it
    is refused and counted (their parameters stay unaveraged, the inner step stays in effect) and the next one,
    without the dead group, averages them again. Restarted, the group heals at a later sync."""
    runs, killed_at, restarted_at = local_sgd_run["runs"], local_sgd_run["killed_at"], local_sgd_run["restarted_at"]
    assert [r["step"] for r in runs[f"group{KILLED}"]] == list(range(1, 8))
    for survivor in ("group0", "group1"):
        run = runs[survivor]
        assert_steps_counted_once(run, first=1, refused_step_stays=False)
        assert run[-1]["step"] == STEPS and run[-1]["not_committed"] == 1
        assert next(r for r in run if r["step"] == 8)["not_committed"] == 1
        syncs_alone = [r for r in run if killed_at < r["t"] < restarted_at and r["step"] in (12,)]
        assert syncs_alone and all(r["groups"] == 2 for r in syncs_alone)
    rejoined = runs["restarted_group"]
    assert_steps_counted_once(rejoined, first=1)
    healed = next(r for r in rejoined if r["heals"] == 1)
    assert healed["step"] > 12 and healed["step"] % PERIOD == 0 and healed["groups"] == GROUPS
    # after every committed sync every process holds the same weights; after the refused one (step 8) the survivors
    # differ (each kept its own)
    assert_groups_agree(runs, at=lambda record: record["step"] % PERIOD == 0 and record["step"] != 8)
    step8 = {next(r["sum"] for r in runs[name] if r["step"] == 8) for name in ("group0", "group1")}
    assert len(step8) == 2
    final = [result["state"] for result in local_sgd_run["results"].values()]
    for state in final[1:]:
        torch.testing.assert_close(state, final[0], rtol=0, atol=0)


@pytest.fixture(scope="module")
def lighthouse_of_one() -> Iterator[str]:
    """A lighthouse that lets one group train alone (min_replicas 1), for two groups of which one restarts."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install 'lightning_parallel[ft]'")
    command = shutil.which("torchft_lighthouse", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if command is None:
        pytest.skip("torchft_lighthouse is not installed (it comes with torchft)")
    port = free_port()
    args = ["--bind", f"[::]:{port}", "--min_replicas", "1", "--join_timeout_ms", "3000"]
    args += ["--heartbeat_timeout_ms", "2000", "--quorum_tick_ms", "50"]
    server = subprocess.Popen([command, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "torchft_lighthouse did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


RESTART_STEPS, KILL_STEP, HOLD_STEP = 8, 3, 5
# A one-block transformer on the copy task; 48 training samples: 3 batches of 4 per rank a group of 2 reads in an
# epoch (2 groups x 2 ranks), so max_epochs=2 (6 steps) would end a group before max_steps unless it is lifted.
RESTART_RUN = ["model=transformer", "data=synthetic_tokens", "model.depth=1", "model.width=16", "model.heads=2"]
RESTART_RUN += ["data.vocab_size=8", "data.seq_len=8", "data.num_samples=54", "data.batch_size=4", "trainer=cpu"]
RESTART_RUN += ["trainer.devices=2", f"trainer.max_steps={RESTART_STEPS}", "trainer.max_epochs=2", "callbacks=none"]
RESTART_RUN += ["+trainer.enable_checkpointing=false", "trainer.check_val_every_n_epoch=100", "logger=csv"]
RESTART_RUN += ["strategy=ft_ddp", "strategy.replica_groups=2", "strategy.replica_timeout=10"]
RESTART_RUN += ["strategy.quorum_timeout=60", "strategy.timeout.minutes=1"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_groups_of_two_processes_survive_a_sigkill_under_torchrun(tmp_path: Path, lighthouse_of_one: str) -> None:
    """Each group is `torchrun --nproc-per-node=2 train.py strategy=ft_ddp ...` (tests/workers/elastic.py). Rank 1 of
    group 1 SIGKILLs itself in step 3; torchrun restarts both of group 1's ranks (the same command, the agent's store
    kept: the Manager's keys live in a store of each attempt's own), which rejoin group 0 mid-run with its weights.
    Both groups end at max_steps, past their max_epochs, with the same weights on all four ranks."""
    from test_restarts import ELASTIC, env  # torchrun's launcher with forked workers, and its clean environment

    restarted = tmp_path / "restarted"
    procs = {}
    for group, restarts in ((0, 0), (1, 1)):
        out = tmp_path / f"group{group}"
        out.mkdir()
        extra = [f"+callbacks.save={{_target_:replica_restart.SaveWeights,directory:{out}}}"]
        start = f"{{_target_:replica_restart.StartTogether,directory:{tmp_path},ranks:4,name:group{group}}}"
        extra += [f"+callbacks.start={start}"]
        if group == 0:
            extra += [f"+callbacks.hold={{_target_:replica_restart.HoldAt,step:{HOLD_STEP},file:{restarted}}}"]
        else:
            extra += [f"+callbacks.kill={{_target_:failing.FailAt,rank:1,step:{KILL_STEP - 1},mode:kill,attempt:0}}"]
            extra += [f"+callbacks.announce={{_target_:replica_restart.AnnounceAt,attempt:1,file:{restarted}}}"]
        command = [*ELASTIC, str(restarts), *RESTART_RUN, f"strategy.replica_group={group}"]
        command += [f"strategy.lighthouse={lighthouse_of_one}", f"hydra.run.dir={out}", *extra]
        log = (out / "log.txt").open("w")
        procs[group] = subprocess.Popen(command, cwd=out, env=env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        for proc in procs.values():
            proc.wait(timeout=360)
    finally:
        for proc in procs.values():
            subprocess.run(["pkill", "-9", "-s", str(proc.pid)], check=False)  # torchrun's workers share its session
    for group, proc in procs.items():
        assert proc.returncode == 0, (tmp_path / f"group{group}" / "log.txt").read_text()[-4000:]
    log = (tmp_path / "group1" / "log.txt").read_text()
    assert (tmp_path / "group1" / "failed_at").exists() and restarted.exists()  # the kill came, then the restart
    results = [torch.load(tmp_path / f"group{g}" / f"rank{r}.pt") for g in (0, 1) for r in (0, 1)]
    assert [result["step"] for result in results] == [RESTART_STEPS] * 4
    assert results[0]["epoch"] >= 2  # group 0 trained past its max_epochs to reach max_steps
    for result in results[1:]:
        torch.testing.assert_close(result["state"], results[0]["state"], rtol=0, atol=0)
    assert "max_epochs=2 lifted" in log


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
