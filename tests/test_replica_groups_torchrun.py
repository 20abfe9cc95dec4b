"""Fault-tolerant replica groups under torchrun: 2 groups of 2 processes (`torchrun --nproc-per-node=2 train.py
strategy=ft_ddp ...`), one group SIGKILLed mid-run and restarted by torchrun, rejoining the other with its weights.
Skipped without torchft. The three one-process groups: test_replica_groups.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from distributed import WORKERS, end_session, start_script
from lighthouse import started_lighthouse


@pytest.fixture(scope="module")
def lighthouse_of_one() -> Iterator[str]:
    """A lighthouse that lets one group train alone (min_replicas 1), for two groups of which one restarts."""
    with started_lighthouse(min_replicas=1) as address:
        yield address


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
    Both groups end at max_steps, past their max_epochs, with the same weights on all four ranks, and the survivor of
    group 1 left at torchrun's SIGTERM."""
    from test_restarts import env  # the clean environment of a launch under torchrun

    elastic = WORKERS / "elastic.py"  # torchrun's launcher with forked workers, itself forked from the tests' server

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
        args = [str(restarts), *RESTART_RUN, f"strategy.replica_group={group}"]
        args += [f"strategy.lighthouse={lighthouse_of_one}", f"hydra.run.dir={out}", *extra]
        procs[group] = start_script(elastic, args, cwd=out, env=env(), log=out / "log.txt")
    try:
        for proc in procs.values():
            proc.join(360)
    finally:
        for proc in procs.values():
            end_session(proc)  # torchrun's workers share its session
    for group, proc in procs.items():
        assert proc.exitcode == 0, (tmp_path / f"group{group}" / "log.txt").read_text()[-4000:]
    log = (tmp_path / "group1" / "log.txt").read_text()
    assert (tmp_path / "group1" / "failed_at").exists() and restarted.exists()  # the kill came, then the restart
    results = [torch.load(tmp_path / f"group{g}" / f"rank{r}.pt") for g in (0, 1) for r in (0, 1)]
    assert [result["step"] for result in results] == [RESTART_STEPS] * 4
    assert results[0]["epoch"] >= 2  # group 0 trained past its max_epochs to reach max_steps
    for result in results[1:]:
        torch.testing.assert_close(result["state"], results[0]["state"], rtol=0, atol=0)
    assert "max_epochs=2 lifted" in log
    # group 1's rank 0, its peer dead, left at torchrun's SIGTERM: not held by its quorum's thread until SIGKILL 30 s on
    assert "forcefully exiting" not in log, log[-4000:]
