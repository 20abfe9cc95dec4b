"""When one launched rank dies, the launching process names it in one line and stops every other rank;
our DDP does the same as the mesh strategies (Lightning's own leaves a hung rank running)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_parallel.strategies.ddp import DDPStrategy
from lightning_parallel.strategies.peers import PeerFailure, lost_a_peer, stop_peers

LOST = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35725")


def launcher_with(*codes: str) -> _SubprocessScriptLauncher:
    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=len(codes) + 1, num_nodes=1)
    launcher.procs = [subprocess.Popen([sys.executable, "-c", code]) for code in codes]
    return launcher


HANG = "import time; time.sleep(120)"


def test_the_rank_that_exited_is_named_and_the_others_are_killed(capsys: pytest.CaptureFixture[str]) -> None:
    launcher = launcher_with(HANG, "import sys; sys.exit(3)", HANG)
    launcher.procs[1].wait(timeout=60)  # it died, then its peer saw it lost (stop_peers gives it 5 s, not a start-up)
    failure = stop_peers(launcher, LOST, node_rank=0, num_processes=4)
    assert failure == PeerFailure(rank=2, returncode=3)
    line = "rank 2 died first: it exited with code 3; its own error is printed above"
    assert capsys.readouterr().err == f"error: {line}\n"
    assert LOST.__notes__ == [f"caused by: {line}"]
    assert [proc.wait(timeout=60) for proc in launcher.procs] == [-signal.SIGKILL, 3, -signal.SIGKILL]  # HANG: 120 s


def test_a_rank_of_the_second_node_killed_by_a_signal() -> None:
    launcher = launcher_with("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    launcher.procs[0].wait(timeout=60)  # it died, then its peer saw it lost
    failure = stop_peers(launcher, RuntimeError("Connection reset by peer"), node_rank=1, num_processes=2)
    assert str(failure) == (
        "rank 3 died first: it was killed by SIGKILL from outside, e.g. the out-of-memory killer; it printed no error"
    )


def test_our_own_error_stops_hung_peers_without_waiting() -> None:
    """Rank 0 failed itself (not a lost peer): nobody is blamed, the hung ranks are killed at once."""
    strategy = DDPStrategy()
    strategy._launcher = launcher_with(HANG)
    error = ValueError("a bug in training_step")
    assert not lost_a_peer(error)
    strategy.on_exception(error)
    assert strategy.peer_failure is None
    assert strategy.launcher.procs[0].wait(timeout=60) == -signal.SIGKILL  # HANG sleeps 120 s unless killed


def test_more_nodes_than_a_launcher_provides_is_refused_before_launch() -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    from lightning_parallel.strategies.peers import check_nodes

    with pytest.raises(ValueError, match=r"num_nodes=2, but this process was not started by a multi-node launcher"):
        check_nodes(2, LightningEnvironment(), environ={})
    check_nodes(1, LightningEnvironment(), environ={})
    check_nodes(2, LightningEnvironment(), environ={"NODE_RANK": "1"})  # launched by hand on each node
    check_nodes(2, TorchElasticEnvironment(), environ={})  # torchrun tells each process its node
    check_nodes(2, SLURMEnvironment(), environ={})  # so does srun


@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_train_py_refuses_two_nodes_on_one_machine(compose_cfg, strategy: str) -> None:
    from train import ConfigError, build

    cfg = compose_cfg(f"strategy={strategy}", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.num_nodes=2")
    with pytest.raises(ConfigError, match=r"num_nodes=2, but .* HINT: on one machine use num_nodes=1"):
        build(cfg)


TORCHRUN_RANK_1_OF_4 = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"}


@pytest.mark.parametrize(("strategy", "started", "devices"), [("pipeline", 4, 1), ("fsdp", 4, 1), ("pipeline", 2, 4)])
def test_train_py_refuses_torchrun_processes_that_are_not_the_devices(
    compose_cfg, monkeypatch: pytest.MonkeyPatch, strategy: str, started: int, devices: int
) -> None:
    """`torchrun --nproc-per-node=4 train.py strategy=pipeline` with trainer.devices left at 1 died on rank 1 with
    Lightning's IndexError in root_device (its one device indexed by local rank 1); fewer processes than devices
    would wait for ranks that never come. Each rank refuses it in one line when the Trainer is built."""
    from train import ConfigError, build

    for name, value in {**TORCHRUN_RANK_1_OF_4, "WORLD_SIZE": str(started), "LOCAL_WORLD_SIZE": str(started)}.items():
        monkeypatch.setenv(name, value)
    cfg = compose_cfg(f"strategy={strategy}", f"trainer.devices={devices}", "trainer.accelerator=cpu")
    line = (
        f"^torchrun started {started} processes per node \\(--nproc-per-node={started}\\), but trainer.devices="
        f"{devices}: .* HINT: trainer.devices={started} \\(or torchrun --nproc-per-node={devices}\\)$"
    )
    with pytest.raises(ConfigError, match=line):
        build(cfg)


@pytest.mark.parametrize("strategy", ["pipeline", "ddp"])
def test_a_strategy_refuses_torchrun_processes_that_are_not_the_devices(
    monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Without train.py: our strategies refuse it as the Trainer is built (Lightning's DDP raised IndexError)."""
    import lightning.pytorch as pl

    import lightning_parallel as lp

    for name, value in {**TORCHRUN_RANK_1_OF_4, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    made = lp.PipelineParallelStrategy(pipeline_parallel_size=1) if strategy == "pipeline" else DDPStrategy()
    with pytest.raises(ValueError, match=r"^torchrun started 4 processes per node .* HINT: trainer.devices=4 "):
        pl.Trainer(strategy=made, devices=1, accelerator="cpu", logger=False)


def test_srun_tasks_per_node_that_are_not_the_devices_are_refused() -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    from lightning_parallel.strategies.peers import check_launched

    with pytest.raises(ValueError, match=r"^srun started 2 processes per node .* HINT: trainer.devices=2 \(or srun"):
        check_launched(4, SLURMEnvironment(), environ={"SLURM_NTASKS_PER_NODE": "2"})
    check_launched(2, SLURMEnvironment(), environ={"SLURM_NTASKS_PER_NODE": "2"})
    check_launched(2, TorchElasticEnvironment(), environ={"LOCAL_WORLD_SIZE": "2"})
    check_launched(2, LightningEnvironment(), environ={"LOCAL_WORLD_SIZE": "4"})  # Lightning launches its own
