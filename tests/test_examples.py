"""The examples the docs show run as written, at toy size, one launch each: examples/drop_in.py under the pipeline on 2
CPU processes and under every registered strategy name in this process (one device each: the name resolves, the
user's module trains and validates); examples/hf_causal_lm_3d.py trains a transformers GPT-2 on padded batches under
the pipeline on 2 processes and exports it back (the same script at pp2 x tp2 differs only in its arguments; that
layout's parity and export are tests/test_hf_tensor.py's and test_hf_pipeline.py's); examples/cluster/
torchrun_restarts.sh runs its torchrun command (`--max-restarts`, `ckpt_path=last`) with one worker. The Python
examples' first process is forked from the tests' server (tests/distributed.py run_script: ~9 s of CPU less each), and
the rank each launches through Lightning's launcher is a fork of it running the same command line
(tests/forked_ranks.py: ~9 s less again)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_torch_2_13
from distributed import run_script

EXAMPLES = Path(__file__).parents[1] / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_drop_in_example_runs_under_the_pipeline(tmp_path: Path) -> None:
    args = ["--strategy", "pipeline", "--devices", "2", "--epochs", "1", "--max-steps", "6"]
    done = run_script(EXAMPLES / "drop_in.py", args, cwd=tmp_path, env=ENV, timeout=300, fork_ranks=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "val_acc 0." in done.stdout


def test_drop_in_example_trains_under_every_registered_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_parallel

    spec = importlib.util.spec_from_file_location("drop_in", EXAMPLES / "drop_in.py")
    assert spec is not None and spec.loader is not None
    drop_in = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drop_in)
    monkeypatch.chdir(tmp_path)
    names = list(lightning_parallel._REGISTERED)
    assert {"pipeline", "tensor_parallel", "local_sgd", "diloco", "async_sgd"} <= set(names) <= set(StrategyRegistry)
    environment = dict(os.environ)
    for name in ["auto", *names]:
        # a fit leaves MASTER_ADDR / MASTER_PORT, NODE_RANK and LOCAL_RANK behind (as train.py says), and a
        # LOCAL_RANK makes the next Trainer in this process take itself for a launched rank: each fit starts clean
        os.environ.clear()
        os.environ.update(environment)
        trainer = drop_in.fit(strategy=name, devices=1, epochs=1, max_steps=2)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        assert trainer.global_step == 2 and 0 <= float(trainer.callback_metrics["val_acc"]) <= 1, name
    os.environ.clear()
    os.environ.update(environment)


@needs_torch_2_13  # its loss from labels sends integers between pipeline stages, refused before 2.13
@pytest.mark.slow
def test_transformers_example_trains_padded_batches_and_exports_them_back(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    args = ["--devices", "2", "--pp", "2", "--tp", "1", "--layers", "2", "--steps", "2", "--out", str(tmp_path / "out")]
    done = run_script(EXAMPLES / "hf_causal_lm_3d.py", args, cwd=tmp_path, env=ENV, timeout=300, fork_ranks=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported to" in done.stdout
    config = json.loads((tmp_path / "out" / "gpt2" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_layer"] == 2
    assert (tmp_path / "out" / "gpt2" / "model.safetensors").is_file()


@pytest.mark.slow
def test_torchrun_recipe_runs_and_writes_its_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**ENV, "NPROC": "1", "PORT": "0", "RUN_DIR": str(run), "PYTHON": sys.executable}
    toy = ["model.depth=1", "model.width=16", "model.heads=2", "data.num_samples=64", "data.seq_len=8"]
    toy += ["trainer.max_steps=2", "callbacks.step_checkpoint.every_n_train_steps=1", "callbacks.progress_bar=null"]
    done = subprocess.run(["bash", str(EXAMPLES / "cluster" / "torchrun_restarts.sh"), *toy], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["strategy"] == "PipelineParallelStrategy"
    assert (run / "checkpoints" / "step=2.ckpt").exists()
