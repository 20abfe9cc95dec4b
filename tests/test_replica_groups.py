"""Fault-tolerant replica groups over torchft (`strategy=ft_ddp`, `ft_local_sgd`, `ft_diloco`), live: three groups of
one process each and a lighthouse started by the README's command. One group SIGKILLs itself mid-run; the other two
keep training while it is gone; the test restarts it (as torchrun or SLURM would) and it rejoins with the others'
weights, received live. (2 groups of 2 processes under torchrun, one restarted by it: test_replica_groups_torchrun.py.)

Each process logs every step as it ends (tests/workers/replica_group.py), so the test reads when each step happened,
in which quorum, with which weights. Skipped when torchft is not installed (the `ft` and `dev` extras install it);
the refusals and the exchange's arithmetic are in test_replica_group_checks.py.
"""

from __future__ import annotations

import json
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import free_port, start_worker
from lighthouse import started_lighthouse

GROUPS, BATCH, STEPS = 3, 4, 24
KILLED = 2


@pytest.fixture(scope="module")
def lighthouse() -> Iterator[str]:
    """A lighthouse for the three groups: a quorum needs two of them."""
    with started_lighthouse(min_replicas=2) as address:
        yield address


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
