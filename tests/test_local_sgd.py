"""strategy=local_sgd and strategy=diloco: period 1 equals DDP, larger periods sync exactly at their steps, both
resume exactly from mid-period and mid-epoch, and bad values are one line before launch.

Why period 1 equals DDP: with H=1 the averaged parameters (local SGD), or the outer step with lr 1 and no momentum
applied to the averaged change (DiLoCo), are the mean of the replicas' updates: for SGD, whose update is linear in
the gradient (momentum and weight decay included), that is DDP's update with the averaged gradient. An inner Adam
would not be (each replica normalises by its own second moments). The tests use plain SGD there.

One launch (2 processes, the tiny GPT, 20 steps per fit) runs every fit; the tests read its results.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from distributed import WORKERS, run_workers

from lightning_parallel import DiLoCoStrategy, LocalSGDStrategy
from lightning_parallel.sync_methods import SYNC_METHODS
from train import ConfigError, build

STEPS = 20
SAVED = 7  # the checkpoint resumed from: mid-period (4) and mid-epoch (10 steps)
PLAIN, MOMENTUM = 0.0, 0.9
FITS = {
    "ddp": {"strategy": "ddp", "momentum": PLAIN},
    # foreach and fused: CUDA's optimizer kernels, against DDP's plain loop
    "local_sgd_1": {"strategy": "local_sgd", "args": {"period": 1}, "momentum": PLAIN, "kernel": {"foreach": True}},
    "diloco_1": {
        "strategy": "diloco",
        "args": {"period": 1, "outer_optimizer": [1.0, 0.0, False]},
        "momentum": PLAIN,
        "kernel": {"fused": True},
    },
    "local_sgd_4": {
        "strategy": "local_sgd",
        "args": {"period": 4, "warmup_steps": 3},
        "momentum": MOMENTUM,
        "save": True,
    },
    "local_sgd_4_resumed": {
        "strategy": "local_sgd",
        "args": {"period": 4, "warmup_steps": 3},
        "momentum": MOMENTUM,
        "resume": "local_sgd_4",
    },
    "diloco_4": {"strategy": "diloco", "args": {"period": 4}, "momentum": MOMENTUM, "save": True},  # Nesterov outer
    "diloco_4_resumed": {"strategy": "diloco", "args": {"period": 4}, "momentum": MOMENTUM, "resume": "diloco_4"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Fit name -> each rank's {losses, state, sums}."""
    out = tmp_path_factory.mktemp("local_sgd")
    configs = []
    for name, config in FITS.items():
        config = {**config, "steps": STEPS, "save_dir": str(out / name) if config.get("save") else None}
        if "resume" in config:  # the saving fit's step-7 checkpoint
            config["resume"] = str(out / config["resume"] / f"step={SAVED}.ckpt")
        configs.append(config)
    per_rank = run_workers("local_sgd", 2, configs, out / "launch", timeout=240)
    return {name: [per_rank[rank][i] for rank in range(2)] for i, name in enumerate(FITS)}


def assert_states_close(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=atol, msg=name)


@pytest.mark.slow
def test_ddp_equals_one_process(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The DDP run the period-1 fits are compared with is itself one process's training at the global batch (run
    here, in this process), so none of them is compared only with another parallel run."""
    sys.path.insert(0, str(WORKERS))
    from local_sgd import fit

    one = fit({"strategy": "single", "devices": 1, "steps": STEPS, "momentum": PLAIN})
    for rank in range(2):
        ddp = runs["ddp"][rank]
        assert len(ddp["losses"]) == len(one["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(ddp["losses"], one["losses"], strict=True)) < 1e-5
        assert_states_close(ddp["state"], one["state"], atol=1e-5)
    assert abs(one["sums"][-1] - one["sums"][0]) > 1e-2  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local_sgd_1", "diloco_1"])
def test_period_one_equals_ddp(runs: dict[str, list[dict[str, Any]]], name: str) -> None:
    # DDP logs the loss averaged over the ranks; local SGD and DiLoCo log each rank's own (no meeting per step).
    own = [runs[name][rank]["losses"] for rank in range(2)]
    assert own[0] != own[1]
    mean = [(a + b) / 2 for a, b in zip(*own, strict=True)]
    for rank in range(2):
        ddp, other = runs["ddp"][rank], runs[name][rank]
        assert len(other["losses"]) == len(ddp["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(ddp["losses"], mean, strict=True)) < 1e-5
        assert_states_close(other["state"], ddp["state"], atol=1e-5)
    assert abs(runs["ddp"][0]["sums"][-1] - runs["ddp"][0]["sums"][0]) > 1e-2  # not a comparison of idle weights


def synced_steps(name: str) -> set[int]:
    """Steps (1-based) after which the replicas must be equal."""
    if name == "local_sgd_4":  # 3 DDP steps, then torch's averager at its steps 3, 7, ... (after steps 4, 8, ...)
        return {1, 2, 3} | set(range(4, STEPS + 1, 4))
    return set(range(4, STEPS + 1, 4))  # DiLoCo: after every 4th inner step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local_sgd_4", "diloco_4"])
def test_replicas_equal_right_after_each_averaging_and_differ_between(
    runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    sums = [runs[name][rank]["sums"] for rank in range(2)]
    assert len(sums[0]) == len(sums[1]) == STEPS
    equal = {step for step in range(1, STEPS + 1) if sums[0][step - 1] == sums[1][step - 1]}
    apart = {step for step in range(1, STEPS + 1) if abs(sums[0][step - 1] - sums[1][step - 1]) > 1e-6}
    assert equal == synced_steps(name)
    assert apart == set(range(1, STEPS + 1)) - synced_steps(name)
    assert_states_close(runs[name][1]["state"], runs[name][0]["state"], atol=0)  # step 20 syncs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local_sgd_4", "diloco_4"])
def test_resume_equals_an_uninterrupted_run(runs: dict[str, list[dict[str, Any]]], name: str) -> None:
    # Saved at step 7, inside a period: each replica's own weights and momentum matter (Lightning alone would restart
    # both replicas from rank 0's); and inside an epoch: the resumed epoch goes on at its 8th batch.
    assert abs(runs[name][0]["sums"][SAVED - 1] - runs[name][1]["sums"][SAVED - 1]) > 1e-6  # replicas differed
    for rank in range(2):
        whole, resumed = runs[name][rank], runs[f"{name}_resumed"][rank]
        assert len(resumed["losses"]) == STEPS - SAVED
        assert max(abs(a - b) for a, b in zip(whole["losses"][SAVED:], resumed["losses"], strict=True)) < 1e-6
        assert max(abs(a - b) for a, b in zip(whole["sums"][SAVED:], resumed["sums"], strict=True)) < 1e-6
        assert_states_close(resumed["state"], whole["state"], atol=1e-6)


# ---- bad input, before launch ---------------------------------------------------------------------------------------
CONSTRUCTOR = [
    (LocalSGDStrategy, {"period": 0}, "LocalSGDStrategy(period=0): period must be an integer >= 1"),
    (LocalSGDStrategy, {"period": 2.5}, "period must be an integer >= 1, got 2.5 (float)"),
    (LocalSGDStrategy, {"warmup_steps": -1}, "warmup_steps=-1): warmup_steps must be an integer >= 0"),
    (LocalSGDStrategy, {"model_averaging_period": 3}, "model_averaging_period must be left out"),
    (DiLoCoStrategy, {"period": 0}, "DiLoCoStrategy(period=0): period must be an integer >= 1"),
    (DiLoCoStrategy, {"outer_optimizer": "sgd"}, "outer_optimizer must be a callable returning a torch.optim"),
    (
        DiLoCoStrategy,
        {"outer_optimizer": list},
        "outer_optimizer must be a callable returning a torch.optim.Optimizer, not list",
    ),
    (DiLoCoStrategy, {"outer_optimizer": partial(torch.optim.SGD, lr=-1)}, "works (Invalid learning rate: -1)"),
    (DiLoCoStrategy, {"find_unused_parameters": True}, "find_unused_parameters must be left out"),
]


@pytest.mark.parametrize(("cls", "kwargs", "expected"), CONSTRUCTOR, ids=[str(k) for _, k, _ in CONSTRUCTOR])
def test_constructor_rejects_bad_values(cls: type, kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError) as error:
        cls(**kwargs)
    message = str(error.value)
    assert expected in message and "HINT: " in message and "\n" not in message, message


CONFIG = {
    "period=0": (["strategy=local_sgd", "strategy.period=0"], "LocalSGDStrategy(period=0): period must be"),
    "warmup=-1": (["strategy=local_sgd", "strategy.warmup_steps=-1"], "warmup_steps=-1): warmup_steps must be"),
    "diloco period=0": (["strategy=diloco", "strategy.period=0"], "DiLoCoStrategy(period=0): period must be"),
    "unknown outer optimizer": (
        ["strategy=diloco", "strategy.outer_optimizer._target_=torch.optim.SGDD"],
        "strategy.outer_optimizer._target_=torch.optim.SGDD cannot be imported. "
        "HINT: did you mean strategy.outer_optimizer._target_=torch.optim.SGD?",
    ),
    "outer optimizer not an optimizer": (
        ["strategy=diloco", "strategy.outer_optimizer._target_=torch.nn.Linear"],
        "outer_optimizer must be an optimizer factory that works (Linear.__init__() got an unexpected keyword "
        "argument 'lr')",
    ),
}


@pytest.mark.parametrize("case", CONFIG)
def test_config_value_names_its_key(compose_cfg, case: str) -> None:
    overrides, expected = CONFIG[case]
    with pytest.raises(ConfigError) as error:
        build(compose_cfg("trainer.accelerator=cpu", "trainer.devices=2", *overrides))
    message = str(error.value)
    assert expected in message and "HINT: " in message and "\n" not in message, message


# The unknown outer optimizer through the real command line (exit 2, one line) was a launch of its own; the line is
# `build`'s (test_config_value_names_its_key above), and a ConfigError from `build` exits 2 as one line in
# test_bad_input.test_cli_bad_input_exits_2_with_one_line and test_cli.test_bad_input_is_one_clear_line.


def test_each_method_describes_itself_for_summary_json() -> None:
    """summary.json's `parallel` names the method (a row of `sync_methods.SYNC_METHODS`) and its period, which the
    sweep report's comparison reads."""
    local, diloco = LocalSGDStrategy(period=4, warmup_steps=2), DiLoCoStrategy(period=10)
    assert local.describe() == {"kind": "local_sgd", "workers": 1, "collectives": False, "period": 4, "warmup_steps": 2}
    assert diloco.describe() == {"kind": "diloco", "workers": 1, "collectives": False, "period": 10}
    assert {local.describe()["kind"], diloco.describe()["kind"]} <= set(SYNC_METHODS)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: nccl takes one device per rank")
@pytest.mark.parametrize("name", ["local_sgd", "diloco", "async_sgd"])
def test_on_two_gpus_with_nccl(tmp_path: Path, name: str) -> None:
    """The same strategies on nccl (Lightning picks it for CUDA): a short train.py run ends with its summary."""
    period = [] if name == "async_sgd" else ["strategy.period=2"]
    result = run_cli(
        f"strategy={name}", *period, "trainer.accelerator=gpu", "trainer.devices=2", "trainer.max_steps=6",
        "trainer.limit_val_batches=2", "callbacks=none", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["parallel"]["kind"], summary["world_size"], summary["steps"]) == (name, 2, 6)


def test_bytes_per_step_count_the_syncs_these_tests_observe() -> None:
    """`sync_methods` counts exchanges on the steps `synced_steps` checks above: local SGD after steps 1, 5, 9, ...
    (torch's averager, no warm-up), DiLoCo after 4, 8, ...; DDP every step; async pushes and pulls every step."""
    local, diloco = SYNC_METHODS["local_sgd"], SYNC_METHODS["diloco"]
    assert local.exchanges_per_step(4, steps=10) == 3 / 10 and diloco.exchanges_per_step(4, steps=10) == 2 / 10
    assert local.exchanges_per_step(4) == diloco.exchanges_per_step(4) == 1 / 4
    # 1000 parameters (4000 bytes) between 2 workers: a ring all-reduce moves 2 x 2 x 1/2 x 4000 bytes per worker
    assert SYNC_METHODS["ddp"].bytes_per_step(1000, 2) == 8000 == SYNC_METHODS["async_sgd"].bytes_per_step(1000, 2)
    assert local.bytes_per_step(1000, 2, period=4, steps=10) == 8000 * 3 / 10
