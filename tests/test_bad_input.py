"""Values of the wrong type or range, and names that do not exist: each is one line with a fix, before anything runs.

The strategies' own checks run in-process (the Python API), config keys through Hydra's compose API and
`train.build`, and only a few cases through the real command line (each costs a Python start-up).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from conftest import run_cli
from hydra.errors import HydraException

from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy
from train import ConfigError, build, hydra_error_line

P, T = PipelineParallelStrategy, TensorParallelStrategy

# ---- the Python API: each constructor argument ---------------------------------------------------------------------
CONSTRUCTOR = [
    (P, {"microbatches": "abc"}, "microbatches='abc'): microbatches must be an integer >= 1 or None, got 'abc' (str)"),
    (P, {"microbatches": 2.5}, "microbatches must be an integer >= 1 or None, got 2.5 (float). HINT: microbatches=4"),
    (P, {"microbatches": True}, "got True (bool)"),
    (P, {"microbatches": 0}, "microbatches=0): microbatches must be an integer >= 1"),
    (P, {"schedule": "zigzag"}, "schedule must be one of gpipe, 1f1b, interleaved_1f1b, looped_bfs"),
    (P, {"schedule": None}, "schedule must be one of"),
    (P, {"stages_per_rank": 0}, "stages_per_rank must be an integer >= 1 or None"),
    (P, {"data_parallel_size": "2"}, "data_parallel_size must be an integer >= 1 or None, got '2' (str)"),
    (P, {"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1 or None, got 0"),
    (P, {"tensor_parallel_size": None}, "tensor_parallel_size must be an integer >= 1, got None"),
    (P, {"pipeline_parallel_size": 2.0}, "pipeline_parallel_size must be an integer >= 1 or None, got 2.0 (float)"),
    (P, {"plan": "megatron"}, "PipelineParallelStrategy(plan='megatron')"),
    (P, {"replicas": "zero"}, "replicas must be one of replicate, fsdp, got 'zero' (str). HINT: replicas='replicate'"),
    (P, {"balance": "even"}, "balance must be None, one of flops, parameters, time, or block names per stage"),
    (P, {"balance": 3}, "balance must be None"),
    (P, {"deferred_batchnorm": "yes"}, "deferred_batchnorm must be True or False, got 'yes' (str)"),
    (P, {"network_attr": ""}, "network_attr must be None or a non-empty string"),
    (P, {"timeout": -1}, "timeout=-1): timeout must be a positive number of seconds or a timedelta, got -1 (int)"),
    (P, {"timeout": "abc"}, "timeout must be a positive number of seconds or a timedelta, got 'abc' (str)"),
    (P, {"timeout": 0}, "timeout must be a positive number"),
    (P, {"timeout": float("inf")}, "timeout must be a positive number"),
    (P, {"timeout": timedelta(seconds=-5)}, "timeout must be a positive number"),
    (P, {"process_group_backend": "glooo"}, "process_group_backend must be None (gloo on CPU, nccl on GPU) or one of"),
    (P, {"process_group_backend": "cpu:gloo,cuda:nccll"}, "process_group_backend must be None"),
    (T, {"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1 or None, got 0 (int)"),
    (T, {"tensor_parallel_size": 2.0}, "got 2.0 (float)"),
    (T, {"data_parallel_size": "abc"}, "data_parallel_size must be an integer >= 1 or None"),
    (T, {"plan": "megatron"}, "plan must be None (the model's own tp_plan), 'auto', or a dict"),
    (T, {"plan": ["colwise"]}, "plan must be None"),
    (T, {"plan": {"fc": "colwize"}}, "plan['fc']='colwize'): plan['fc'] must be one of colwise, rowwise"),
    (T, {"sequence_parallel": 1}, "sequence_parallel must be True or False, got 1 (int)"),
    (T, {"network_attr": 3}, "network_attr must be None or a non-empty string"),
    (T, {"timeout": -1}, "TensorParallelStrategy(timeout=-1): timeout must be a positive number"),
    (T, {"process_group_backend": "mpii"}, "process_group_backend must be None"),
    (P, {"activation_checkpointing": "some"}, "activation_checkpointing must be one of none, full, selective"),
    (T, {"activation_checkpointing": True}, "activation_checkpointing must be one of none, full, selective"),
    (T, {"compile": "yes"}, "compile must be True, False or a dict of torch.compile arguments, got 'yes' (str)"),
    (P, {"compile": 1}, "compile must be True, False or a dict of torch.compile arguments"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "expected"), CONSTRUCTOR, ids=[f"{c.__name__}{k}" for c, k, _ in CONSTRUCTOR]
)
def test_constructor_rejects_wrong_type_or_range(cls: type, kwargs: dict, expected: str) -> None:
    with pytest.raises(ValueError) as error:
        cls(**kwargs)
    message = str(error.value)
    assert expected in message, message
    assert message.startswith(f"{cls.__name__}(") and "HINT: " in message and "\n" not in message


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (P, {"microbatches": 8, "schedule": "zbv", "stages_per_rank": 2, "data_parallel_size": 2}),
        (P, {"balance": [["0", "1"], ["2"]], "deferred_batchnorm": True, "network_attr": "net"}),
        (P, {"timeout": timedelta(minutes=1), "process_group_backend": "cpu:gloo,cuda:nccl"}),
        (P, {"timeout": 2.5, "process_group_backend": "gloo"}),
        (T, {"tensor_parallel_size": 2, "data_parallel_size": None, "plan": {"fc*": "colwise"}}),
        (T, {"plan": "auto", "sequence_parallel": True, "timeout": 30}),
        (T, {"activation_checkpointing": "selective", "compile": {"mode": "max-autotune"}}),
        (P, {"activation_checkpointing": "full", "compile": True}),
    ],
)
def test_constructor_accepts_valid_arguments(cls: type, kwargs: dict) -> None:
    cls(**kwargs)


# ---- config keys: composed as train.py composes them, then built ---------------------------------------------------
CONFIG = {
    "seed=abc": (["seed=abc"], "seed=abc must be an integer >= 0. HINT: seed=42"),
    "seed=true": (["seed=true"], "seed=True must be an integer"),
    "max_steps=abc": (["trainer.max_steps=abc"], "trainer.max_steps=abc must be an integer >= -1. HINT"),
    "max_steps=2.5": (["trainer.max_steps=2.5"], "trainer.max_steps=2.5 must be an integer"),
    "max_epochs=abc": (["trainer.max_epochs=abc"], "trainer.max_epochs=abc must be an integer >= -1 or null"),
    "accumulate=0": (
        ["trainer.accumulate_grad_batches=0"],
        "trainer.accumulate_grad_batches=0 must be an integer >= 1",
    ),
    "num_workers=-1": (["data.num_workers=-1"], "data.num_workers=-1 must be an integer >= 0"),
    "batch_size=abc": (["data.batch_size=abc"], "data.batch_size=abc must be an integer >= 1"),
    "log_every=-2": (["trainer.log_every_n_steps=-2"], "trainer.log_every_n_steps=-2 must be an integer >= 0"),
    "pipeline microbatches=abc": (
        ["strategy=pipeline", "strategy.microbatches=abc"],
        "PipelineParallelStrategy(microbatches='abc'): microbatches must be an integer",
    ),
    "pipeline microbatches=2.5": (["strategy=pipeline", "strategy.microbatches=2.5"], "got 2.5 (float)"),
    "pipeline timeout=-1": (["strategy=pipeline", "strategy.timeout=-1"], "timeout must be a positive number"),
    "pipeline timeout=abc": (["strategy=pipeline", "strategy.timeout=abc"], "got 'abc' (str). HINT: timeout=300"),
    "tensor plan": (["strategy=tensor", "strategy.plan=megatron"], "TensorParallelStrategy(plan='megatron')"),
    "ddp timeout=abc": (["strategy=ddp", "strategy.timeout=abc"], "DDPStrategy(timeout='abc'): timeout must be"),
    "lr=abc": (["optimizer.lr=abc"], "optimizer.lr=abc must be a positive number. HINT: optimizer.lr=3.0e-3"),
    "lr=0": (["optimizer.lr=0"], "optimizer.lr=0 must be a positive number"),
    "clip=-1": (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val=-1 must be a number >= 0 or null"),
    "misspelt pipeline key": (
        ["strategy=pipeline", "+strategy.microbatchs=4"],
        "strategy.microbatchs is not an argument of PipelineParallelStrategy. HINT: did you mean strategy.microbatches",
    ),
    "unknown single-device key": (
        ["+strategy.microbatches=4"],
        "strategy.microbatches is not an argument of SingleDeviceStrategy. HINT: known: device,",
    ),
    "unknown trainer key": (["+trainer.max_step=4"], "trainer.max_step is not an argument of Trainer. HINT: did you"),
    "unknown model key": (["+model.widht=4"], "model.widht is not an argument of SimpleCNN. HINT: known: in_channels"),
}


@pytest.mark.parametrize("case", CONFIG)
def test_config_value_names_its_key(compose_cfg, case: str) -> None:
    overrides, expected = CONFIG[case]
    with pytest.raises(ConfigError) as error:
        build(compose_cfg("trainer.accelerator=cpu", *overrides))
    message = str(error.value)
    assert expected in message and "HINT: " in message and "\n" not in message, message


# ---- Hydra's own errors (raised while composing, before train.py's code runs) ----------------------------------------
HYDRA = {
    "model=nonexistent": "model=nonexistent is not an option of model. HINT: known: resnet152, resnet18, resnet50, ",
    "data=digit": "data=digit is not an option of data. HINT: did you mean data=digits? known: digits,",
    "experiment=nonexistent": "experiment=nonexistent is not an option of experiment. HINT: known: resnet_throughput,",
    "trainer.max_step=4": "trainer.max_step is not a key of trainer. HINT: did you mean trainer.max_steps? known:",
    "trainer.no_such_key=1": "Could not override 'trainer.no_such_key'. HINT: To append to your config use +",
    "seed=[1": "seed=[1: no viable alternative at input '[1'. HINT: See https://hydra.cc",
}


@pytest.mark.parametrize("override", HYDRA)
def test_hydra_composition_error_is_one_line(compose_cfg, override: str) -> None:
    with pytest.raises(HydraException) as error:
        compose_cfg(override)
    line = hydra_error_line(error.value)
    assert line.startswith(HYDRA[override]) and "\n" not in line, line


def test_runs_without_an_experiment_still_compose(compose_cfg) -> None:
    assert compose_cfg().model._target_.endswith("SimpleCNN")  # `experiment: null` selects none
    assert compose_cfg("experiment=transformer_copy").model._target_.endswith("GPT")


# ---- the real command line: exit 2, one line, no traceback ----------------------------------------------------------
# One case per way out: a ConfigError from `build` (main's handler) and a Hydra composition error (cli's handler).
# A misspelt strategy key also leaves through `build` as a ConfigError: its line is checked in process above.
CLI = {
    "type error": (["strategy=pipeline", "strategy.microbatches=abc"], "microbatches='abc'"),
    "unknown experiment": (["experiment=nonexistent"], "experiment=nonexistent"),
}


@pytest.mark.parametrize("case", CLI)
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, case: str) -> None:
    overrides, key = CLI[case]
    result = run_cli(*overrides, cwd=tmp_path, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], result.stderr[-2000:]
    assert "HINT: " in lines[0] and "Traceback" not in result.stderr + result.stdout
    assert not list(tmp_path.rglob("summary.json"))


def test_an_optimizer_that_cannot_step_shards_is_one_line_before_the_first_step(tmp_path: Path) -> None:
    """Known only once the optimizer exists (after launch): every rank refuses before the first step, rank 0 says it."""
    overrides = [
        "strategy=tensor",
        "trainer.devices=2",
        "optimizer._target_=torch.optim.Adafactor",  # refused in every torch of the range (Rprop up to 2.14)
        "trainer.max_steps=2",
    ]
    result = run_cli(*overrides, cwd=tmp_path, timeout=180)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1, result.stderr[-2000:]
    assert len(errors) == 1 and "torch.optim.Adafactor cannot update tensor-parallel" in errors[0], result.stderr[
        -2000:
    ]
    assert not list(tmp_path.rglob("summary.json"))
