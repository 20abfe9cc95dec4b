"""Across nodes on the launchers users already have: two torchrun launches and four SLURM-style tasks on this
machine act as 2 nodes x 2 processes, run train.py, and must end exactly where one 4-process launch does. Plus
the checks that need no processes: tp kept inside a node, the store bound to the address given."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONF, ROOT
from distributed import WORKERS, end_session, free_port, run_script, start_script
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from lightning_parallel import rendezvous
from lightning_parallel.checkpoint import export
from lightning_parallel.dims import ParallelDims, PlacementError
from lightning_parallel.rendezvous import bound_store, listen_address, store_for
from lightning_parallel.strategies.process_group import JOIN_TIMEOUT

# 3 steps of SimpleCNN on digits; Lightning's own ModelCheckpoint writes the final weights at the end.
TINY = ["trainer=cpu", "trainer.max_steps=3", "callbacks=none"]
# pp(2) across the nodes, tp(2) inside each (channel-parallel convs inside pipeline stages): the 3D placement. One
# layout for both launchers, so one 4-process reference serves both tests. (Lightning's own DDP behaves the same
# across torchrun nodes, checked by hand.)
LAYOUT = ["strategy=pipeline", "strategy.tensor_parallel_size=2"]
TWO_NODES = ["trainer.devices=2", "trainer.num_nodes=2"]
# What a launcher tells its processes: none may leak in from the environment the tests run in.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR")
# A guard against a launch that never ends, not a bound on speed: beside a CPU hog (load 25) the 4-process reference
# took 104 s and the two node launches 69 s, the test 281 s in all (the fork server's start included) when this was 150
RUN_TIMEOUT = 240.0
# `torchrun <options> train.py ...` with torchrun's own parsing and launcher, its workers forked from a process that
# imported train.py (tests/workers/torchrun_forked.py: ~9 s of CPU less each); test_restarts runs `torchrun` itself
TORCHRUN = str(WORKERS / "torchrun_forked.py")


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", **extra}


def run_together(commands: list[tuple[list[str], dict[str, str]]], logs: Path) -> list[int]:
    """Start every command (`python <script> <args>`) at once, each in a fork of the tests' server and a session of its
    own (distributed.start_script: torchrun's workers go with their agent); return the exit codes. Whatever still runs
    after RUN_TIMEOUT, or after a failure, is killed."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = [
        start_script(Path(script), args, cwd=logs, env=env, log=logs / f"launch{i}.log")
        for i, ([script, *args], env) in enumerate(commands)
    ]
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(10)  # give the others the chance to exit on their own, then stop them
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            end_session(proc)  # torchrun's workers share the agent's session: none may outlive it
    return [p.exitcode for p in procs]


def tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(logs.glob("launch*.log")))


def final_state(run: Path) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    """(training loss per step, final weights, summary) of a train.py run directory."""
    summary = json.loads((run / "summary.json").read_text())
    (checkpoint,) = run.rglob("*.ckpt")
    if checkpoint.is_dir():  # a mesh strategy's sharded checkpoint
        checkpoint = export(checkpoint, run / "whole.pt")
    weights = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return summary["metrics"]["train/loss"]["history"], weights, summary


def assert_same_run(got: Path, want: Path) -> None:
    """The parity rule: the same losses and final weights within 1e-5, on 4 ranks."""
    got_loss, got_weights, summary = final_state(got)
    want_loss, want_weights, _ = final_state(want)
    assert summary["world_size"] == 4 and len(got_loss) == 3
    assert (summary["parallel"]["pipeline_size"], summary["parallel"]["tensor_parallel_size"]) == (2, 2)
    assert max(abs(a - b) for a, b in zip(got_loss, want_loss, strict=True)) < 1e-5, (got_loss, want_loss)
    assert got_weights.keys() == want_weights.keys()
    worst = max((got_weights[k] - want_weights[k]).abs().max().item() for k in want_weights)
    assert worst < 1e-5, worst


@pytest.fixture(scope="module")
def one_launch(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The reference: train.py launching 4 processes itself on one node (run once, on demand; its first process
    forked from the tests' server, the 3 it launches forks of it running the same command line: tests/forked_ranks.py,
    ~9 s of CPU less each than fresh interpreters; the node launches below keep fresh ones, as a user's are)."""
    runs: list[Path] = []

    def run() -> Path:
        if not runs:
            out = tmp_path_factory.mktemp("one_launch")
            args = [*TINY, *LAYOUT, "trainer.devices=4", f"hydra.run.dir={out / 'run'}"]
            done = run_script(ROOT / "train.py", args, cwd=out, env=clean_env(), timeout=RUN_TIMEOUT, fork_ranks=True)
            assert done.returncode == 0, done.stderr[-3000:]
            runs.append(out / "run")
        return runs[0]

    return run


@pytest.mark.slow
@pytest.mark.timeout(600)  # the reference and this test's launches, each up to RUN_TIMEOUT
def test_two_torchrun_nodes_equal_one_launch(tmp_path: Path, one_launch: Any) -> None:
    """`torchrun --nnodes=2` once per "node", one static rendezvous at node 0 (as on a cluster, with
    --master-addr=<node 0>): both exit 0 and train exactly as train.py's own 4-process launch."""
    run, port = tmp_path / "run", free_port()
    node = f"--nnodes=2 --nproc-per-node=2 --master-addr=127.0.0.1 --master-port={port}"
    args = [str(ROOT / "train.py"), *TINY, *LAYOUT, *TWO_NODES, f"hydra.run.dir={run}"]
    env = clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(WORKERS)]))  # torchrun_forked imports train.py
    launches = [([TORCHRUN, *node.split(), f"--node-rank={n}", *args], env) for n in (0, 1)]
    codes = run_together(launches, tmp_path / "logs")
    assert codes == [0, 0], tails(tmp_path / "logs")
    assert_same_run(run, one_launch())


@pytest.mark.slow
def test_one_launch_equals_one_process(one_launch: Any, compose_cfg: Any, tmp_path: Path) -> None:
    """The 4-process reference the node launches are held to is itself one process's training (run here, in this
    process): neither launch test compares only with another run of the same strategy."""
    from train import train

    train(compose_cfg(*TINY, "strategy=single", "trainer.devices=1", "trainer.accelerator=cpu"))
    want_loss, want_weights, summary = final_state(tmp_path)
    got_loss, got_weights, _ = final_state(one_launch())
    assert summary["world_size"] == 1 and len(want_loss) == 3 and want_loss[-1] != want_loss[0]
    assert max(abs(a - b) for a, b in zip(got_loss, want_loss, strict=True)) < 1e-5, (got_loss, want_loss)
    assert got_weights.keys() == want_weights.keys()
    worst = max((got_weights[k] - want_weights[k]).abs().max().item() for k in want_weights)
    assert worst < 1e-5, worst


def free_slurm_port() -> int:
    """A free port Lightning's SLURMEnvironment derives from the job id: 15000 + its last four digits."""
    for port in random.sample(range(15000, 25000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.2", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 15000-24999")


@pytest.mark.slow
@pytest.mark.timeout(600)  # the reference and this test's launches, each up to RUN_TIMEOUT
def test_slurm_tasks_on_two_nodes_equal_one_launch(tmp_path: Path, one_launch: Any) -> None:
    """Four tasks started the way `srun --nodes=2 --ntasks-per-node=2` would: Lightning's SLURMEnvironment gives
    the ranks, the job id the port, the node list the main address; our store listens on that address only
    (127.0.0.2 stands for node 0: a cluster's host names would keep torch's own store)."""
    run, port = tmp_path / "run", free_slurm_port()
    slurm = {
        "SLURM_JOB_ID": f"7{port - 15000:04d}",
        "SLURM_JOB_NAME": "train",  # "bash" or "interactive" would tell Lightning it is not under srun
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODELIST": "127.0.0.2,127.0.0.3",
        "SLURM_JOB_NODELIST": "127.0.0.2,127.0.0.3",
    }
    args = [str(ROOT / "train.py"), *TINY, *LAYOUT, *TWO_NODES, f"hydra.run.dir={run}"]
    tasks = [
        (args, clean_env(**slurm, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2)))
        for rank in range(4)
    ]
    codes = run_together(tasks, tmp_path / "logs")
    assert codes == [0, 0, 0, 0], tails(tmp_path / "logs")
    assert_same_run(run, one_launch())


# ---- no processes --------------------------------------------------------------------------------------------
def test_tp_spanning_nodes_is_refused_with_the_numbers_and_layouts_that_fit() -> None:
    with pytest.raises(ValueError) as info:
        ParallelDims(dp=1, pp=1, tp=4).check_tp_fits_nodes(2)
    message = str(info.value)
    assert message == (
        "tp(4) does not divide the 2 devices per node (2 nodes x 2), so a tensor-parallel group would span nodes. "
        "HINT: keep tp inside a node, e.g. dp=2, pp=1, tp=2 or dp=1, pp=2, tp=2; or put a multiple of 4 devices on "
        "each node"
    )
    for dp, pp, tp in [(2, 1, 2), (1, 2, 2), (4, 1, 1), (1, 2, 4)]:
        ParallelDims(dp=dp, pp=pp, tp=tp).check_tp_fits_nodes(4 if tp == 4 else 2)
    with pytest.raises(ValueError, match=r"tp\(4\) does not divide the 6 devices per node \(2 nodes x 6\).* tp=2"):
        ParallelDims(dp=3, pp=1, tp=4).check_tp_fits_nodes(6)


def test_train_py_refuses_a_tp_group_across_nodes_before_launch(compose_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """strategy=tensor derives tp = every process of the run: across 2 nodes it must be told to stay inside one."""
    from train import ConfigError, build

    monkeypatch.setenv("NODE_RANK", "0")  # as if launched on node 0 by hand: check_nodes lets it through
    cfg = compose_cfg("strategy=tensor", "trainer.devices=2", "trainer.num_nodes=2", "trainer.accelerator=cpu")
    with pytest.raises(ConfigError, match=r"^tp\(4\) does not divide the 2 devices per node .* dp=2, pp=1, tp=2"):
        build(cfg)


def test_placement_that_splits_a_tp_group_is_named_on_every_rank() -> None:
    dims = ParallelDims(dp=2, pp=1, tp=2)
    dims.check_tp_placement([0, 0, 1, 1])  # node by node, as torchrun and srun's default block distribution
    with pytest.raises(PlacementError) as info:
        dims.check_tp_placement([0, 1, 0, 1])  # srun --distribution=cyclic
    assert str(info.value).startswith(
        "tensor-parallel group of ranks 0-1 spans nodes [0, 1] (rank 0 on node 0, rank 1 on node 1)"
    )
    assert info.value.same_on_every_rank  # train.py prints it once, not once per rank
    ParallelDims(dp=2, pp=2, tp=1).check_tp_placement([0, 1, 0, 1])  # without tp any placement works


def test_the_store_listens_on_the_address_given_across_nodes() -> None:
    """Node 0's address from MASTER_ADDR, never a loopback of our choosing; host names are left to torch."""
    assert listen_address("10.1.2.3") == "10.1.2.3"
    assert listen_address("127.0.0.1") == "127.0.0.1"
    assert listen_address("node-0.cluster") is None


def test_the_main_address_goes_to_the_store_and_under_torchrun_to_the_attempts_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, str, int]] = []
    for kind in ("bound", "attempt"):
        monkeypatch.setattr(rendezvous, f"{kind}_store", lambda a, p, kind=kind, **_: calls.append((kind, a, p)))
    monkeypatch.setattr(rendezvous, "join", lambda store, world_size: None)
    timeout = JOIN_TIMEOUT
    store_for("10.1.2.3", 29555, rank=0, world_size=4, timeout=timeout, environ={})
    torchrun = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job"}
    store_for("10.1.2.3", 29400, rank=1, world_size=4, timeout=timeout, environ=torchrun)
    assert calls == [("bound", "10.1.2.3", 29555), ("attempt", "10.1.2.3", 29400)]


def test_a_store_bound_to_another_address_listens_there_only() -> None:
    """127.0.0.2 stands for node 0's network address: the listener is there, not on 127.0.0.1 or every interface."""
    port = free_port()
    store = bound_store("127.0.0.2", port, rank=0, world_size=1, timeout=JOIN_TIMEOUT)
    try:
        listening = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:  # 0A: LISTEN
                listening.add(local.split(":")[0])
        assert listening == {"0200007F"}, listening
    finally:
        del store


def test_the_cluster_launcher_is_an_option_the_default_config_does_not_need() -> None:
    """conf/hydra/launcher/slurm.yaml builds on the optional hydra-submitit-launcher plugin: the default config
    composes without it, and the option composes (sized by the trainer) exactly when the plugin is installed."""
    cluster = ["hydra/launcher=slurm", "trainer.num_nodes=2", "trainer.devices=4"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        default = compose("train", return_hydra_config=True)
        assert default.hydra.launcher._target_ == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
        try:
            import hydra_plugins.hydra_submitit_launcher  # noqa: F401
        except ImportError:
            with pytest.raises((MissingConfigException, ConfigCompositionException), match="submitit_slurm"):
                compose("train", overrides=cluster, return_hydra_config=True)
            return
        launcher = compose("train", overrides=cluster, return_hydra_config=True).hydra.launcher
        assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
