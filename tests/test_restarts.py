"""Surviving failures under the launchers users have: torchrun with `--max-restarts` re-runs the same command after a
rank is SIGKILLed; the restarted attempt rendezvouses again, resumes from the newest checkpoint (`ckpt_path=last`) and
ends where an uninterrupted run ends, for pipeline, tensor, ddp and DiLoCo. A SIGSTOPped rank ends the job within the
timeout, named in one line.

One launch of torch's elastic launcher runs all eight fits (each strategy interrupted and straight) as one Hydra sweep
of train.py; rank 1 kills itself at step 3 in one strategy per attempt, so four kills cost five attempts. Its workers
are forked from a process that imported train.py (tests/workers/elastic.py, itself forked from the tests' server;
torchrun's agent, rendezvous and restarts otherwise), which saves ~5 s of CPU per worker and attempt; the SIGSTOP test
runs the `torchrun` command itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT
from distributed import WORKERS, run_script

from lightning_parallel.checkpoint import export

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d"]
TORCHRUN += ["--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.2"]
ELASTIC = WORKERS / "elastic.py"  # the same, workers forked (args: max restarts, train.py's), forked from the server
# 6 steps of SimpleCNN on digits (22 batches an epoch: every checkpoint is mid-epoch), a checkpoint every 2 steps.
STEPS = ["trainer=cpu", "trainer.devices=2", "trainer.max_steps=6", "ckpt_path=last", "logger=csv"]
CHECKPOINTS = ["callbacks.progress_bar=null", "callbacks.lr_monitor=null", "callbacks.model_checkpoint.monitor=null"]
CHECKPOINTS += ["callbacks.model_checkpoint.save_top_k=0", "+callbacks.model_checkpoint.every_n_train_steps=2"]
# strategy option -> (its class, the attempt in which rank 1 kills itself at step 3)
KILLED = {
    "pipeline": ("PipelineParallelStrategy", 0),
    "tensor": ("TensorParallelStrategy", 1),
    "ddp": ("DDPStrategy", 2),
    "diloco_period2": ("DiLoCoStrategy", 3),  # tests/conf: DiLoCo syncing every 2 steps, so the 6 steps sync
}
TIMEOUT = 400


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "SLURM_"))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        clean.pop(name, None)
    path = os.pathsep.join([str(ROOT), str(WORKERS)])
    return {**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": path}


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`command` in its own session; whatever is left of it afterwards is killed."""
    proc = subprocess.Popen(command, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        subprocess.run(["pkill", "-9", "-s", str(proc.pid)], check=False)  # torchrun's workers share its session
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def final_state(run_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    if checkpoint.is_dir():  # a mesh strategy's sharded checkpoint
        checkpoint = export(checkpoint, run_dir / "whole.pt")
    return summary, torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)
def test_torchrun_restarts_after_a_kill_continue_exactly(tmp_path: Path) -> None:
    kill = "_target_:failing.FailAt,rank:1,step:3,mode:kill,enabled:${interrupt}"
    kills = [f"+callbacks.kill{i}={{{kill},attempt:{a},strategy:{cls}}}" for i, (cls, a) in enumerate(KILLED.values())]
    sweep = [f"strategy={','.join(KILLED)}", "+interrupt=true,false", "hydra.sweep.dir=sweep"]
    sweep += ["hydra.sweep.subdir=${hydra:runtime.choices.strategy}-${interrupt}"]
    sweep += [f"hydra.searchpath=[file://{ROOT / 'tests' / 'conf'}]"]
    args = [str(len(KILLED)), "-m", *sweep, *STEPS, *CHECKPOINTS, *kills]
    done = run_script(ELASTIC, args, cwd=tmp_path, env=env(), timeout=TIMEOUT)
    result = subprocess.CompletedProcess(done.args, done.returncode, done.stdout + done.stderr, "")
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("ckpt_path=last: no checkpoint in") == 8  # each fit started once, from scratch
    for name in KILLED:
        resumed, resumed_weights = final_state(tmp_path / "sweep" / f"{name}-True")
        straight, straight_weights = final_state(tmp_path / "sweep" / f"{name}-False")
        (record,) = resumed["resumes"]
        assert (record["from_step"], record["steps_lost"]) == (2, 1), (name, record)  # step 3 done, lost, redone
        assert record["wall_time_lost_s"] > 0 and record["checkpoint"].endswith("last.ckpt")
        assert straight["resumes"] == [] and resumed["steps"] == straight["steps"] == 6
        want, got = straight["metrics"]["train/loss"]["history"], resumed["metrics"]["train/loss"]["history"]
        assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, want[2:], strict=True)) < 1e-5, (name, got, want)
        worst = max((resumed_weights[k] - straight_weights[k]).abs().max().item() for k in straight_weights)
        assert resumed_weights.keys() == straight_weights.keys() and worst < 1e-5, (name, worst)
        print(f"{name}: resumed from step 2 after a kill at step 3; final weights within {worst:.1e}")


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)
def test_a_stopped_rank_ends_the_job_within_the_timeout_named_in_one_line(tmp_path: Path) -> None:
    """SIGSTOP leaves a rank's sockets open, so its peers wait until the collective timeout (gloo raises then); the
    heartbeats name it, and it is killed so torchrun need not wait 30 s for a process that cannot take SIGTERM."""
    timeout = 6
    stop = "+callbacks.stop={_target_:failing.FailAt,rank:1,step:2,mode:stop}"
    args = [str(ROOT / "train.py"), "strategy=pipeline", f"strategy.timeout={timeout}", *STEPS, "callbacks=none"]
    result = run([*TORCHRUN, "--max-restarts=0", *args, stop, "hydra.run.dir=run"], tmp_path)
    ended = time.time()
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: rank 1 stopped answering: no heartbeat for "), result.stdout[-3000:]
    # rank 0's own last beat: mostly inside a pipeline send/recv; its beat may also land in the schedule or a collective
    doing = r"; rank 0 waited for it in (a pipeline send/recv|the pipeline schedule|a collective)"
    waited = re.search(doing, errors[0])
    assert waited and "; rank 1 was killed. HINT: " in errors[0], errors[0]
    seconds = ended - float((tmp_path / "failed_at").read_text())
    # Not killed, the stopped rank would hold torchrun for its 30 s SIGTERM grace after the timeout: any bound under
    # timeout + 30 tells the two apart; the time after the timeout is load (15.9 s in all at load 25, bound was 21)
    assert seconds < timeout + 25, f"the job took {seconds:.0f} s to end after the stop (timeout {timeout} s)"
    print(f"{errors[0]}\nended {seconds:.1f} s after the stop")
