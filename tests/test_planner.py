"""Layout planner, planning: schedule costs, plans at scale, fit marking, bad input, the plan command and
strategy=auto. Its memory figures are checked in tests/test_planner_memory.py."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest
import torch
from conftest import CONF, ROOT
from distributed import run_script
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from planner_models import H100, meta_models
from torch import nn

from lightning_parallel.models import SimpleCNN
from lightning_parallel.pipeline.schedule_plan import analytic_bubble
from lightning_parallel.pipeline.schedules import SCHEDULE_TRAITS
from lightning_parallel.planner import (
    CostModel,
    Hardware,
    Layout,
    Network,
    gpt_workload,
    human_bytes,
    measure_block_seconds,
    parse_bytes,
    plan,
    schedule_cost,
    workload_from_module,
)
from lightning_parallel.planner.presets import hardware_preset, hardware_presets
from lightning_parallel.planner.schedule_costs import _simulated
from lightning_parallel.strategies.auto import AutoStrategy
from lightning_parallel.strategies.layouts import strategy_choice, train_overrides
from plan import make_plan, report, train_command


# ---- schedules ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev", "interleaved_zero_bubble"])
def test_schedule_costs_are_analytic_bubble_and_extrapolate_closely(name: str) -> None:
    v = SCHEDULE_TRAITS[name].default_stages_per_rank
    assert schedule_cost(name, pp=4, microbatches=8, stages_per_rank=v).bubble == analytic_bubble(
        name, pp=4, microbatches=8, stages_per_rank=v
    )
    exact = _simulated(name, 16, 64, v)
    approx = schedule_cost(name, pp=16, microbatches=64, stages_per_rank=v)
    assert not approx.exact and approx.bubble == pytest.approx(exact.bubble, abs=0.01)
    assert max(approx.in_flight) == pytest.approx(max(exact.in_flight), rel=0.1)


# ---- planning ----------------------------------------------------------------------------------------------------
def test_100b_gpt_on_4096_devices_plans_in_seconds() -> None:
    """Seconds of this process's own CPU time (one thread): other work on a shared machine stretches the wall clock
    (18 s for 1.3 s of CPU beside a 2-thread matmul, load 13), not the planner's work."""
    started = time.process_time()
    workload = gpt_workload(depth=80, width=10240, heads=80, vocab_size=51200, seq_len=2048)
    result = plan(workload, devices=4096, hardware=H100, global_batch=1536, precision="bf16-mixed")
    elapsed = time.process_time() - started
    assert 100e9 < workload.params < 103e9
    assert elapsed < 10, f"planning took {elapsed:.1f} s of CPU"
    best = result.best
    assert best is not None and best.fits and best.layout.devices == 4096
    assert best.layout.pp > 1 and best.layout.tp > 1  # 1.6 TB of weights and Adam state need model parallelism
    unfit = [e for e in result.estimates if not e.fits]
    assert unfit and all(e.memory["total"] > e.capacity for e in unfit)
    assert result.estimates.index(unfit[0]) > result.estimates.index(best)
    assert "NO" in result.table(len(result.estimates)) and result.explain().startswith(f"dp{best.layout.dp} x")


def test_layouts_that_do_not_fit_are_marked_and_explained() -> None:
    model, sample = meta_models()["resnet50"]
    workload = workload_from_module(model, sample)
    tight = Hardware(name="small", memory="300MB", flops=1e13)
    result = plan(workload, devices=4, hardware=tight, replica_batch=8)
    ddp = next(e for e in result.estimates if e.layout == Layout(dp=4))
    assert not ddp.fits and ddp.memory["total"] > 16 * workload.params  # weights, grads, Adam: 16 B/param alone
    assert result.best is not None and result.best.layout != Layout(dp=4)
    assert "plain data parallelism would need" in result.explain() and "does not fit" in result.explain()
    nothing = plan(workload, devices=4, hardware=Hardware(memory="10MB", flops=1e13), replica_batch=8)
    assert nothing.best is None and nothing.explain().startswith("No layout fits")


def test_measured_block_costs_drive_the_estimate() -> None:
    torch.manual_seed(0)
    model = SimpleCNN(in_channels=1, image_size=8, num_classes=10)
    seconds = measure_block_seconds(model, lambda n: torch.randn(n, 1, 8, 8), sizes=(2, 4), repeats=2, warmup=1)
    assert len(seconds) == 5 and all(fixed >= 0 and per >= 0 for fixed, per in seconds)
    workload = workload_from_module(model, torch.zeros(2, 1, 8, 8)).with_seconds([(1e-3, 1e-4)] * 5)
    estimate = CostModel(workload, Hardware(memory="1GB", flops=1e12)).estimate(Layout(dp=1), batch=10)
    assert estimate.time["compute"] == pytest.approx(5 * (1e-3 + 10 * 1e-4))


def test_shared_cores_slow_the_compute_and_fill_the_bubble() -> None:
    """Two pipeline ranks on one core (two processes, one core) compute half as fast while both compute, but a rank
    waiting in the bubble holds no core: the other runs alone at full speed then, so the step is the work of both."""
    workload = gpt_workload(depth=4, width=256, heads=4, vocab_size=64, seq_len=32)
    layout = Layout(dp=1, pp=2, schedule="1f1b", microbatches=4)
    own, shared = (
        CostModel(workload, Hardware(memory="1GB", flops=1e12, shared_cores=cores)).estimate(layout, batch=8)
        for cores in (0, 1)
    )
    assert shared.time["compute"] == pytest.approx(2 * own.time["compute"])
    assert own.time["bubble"] > 0 and shared.time["bubble"] == pytest.approx(0.0, abs=1e-12)
    work = 2 * own.time["compute"] + own.time["pp_comm"]  # both ranks' compute, one after the other, and the messages
    assert shared.step_time - shared.time["overhead"] - shared.time["optimizer"] == pytest.approx(work, rel=1e-9)


def test_contended_cores_slow_each_device_that_computes_at_once() -> None:
    """Each of two devices sharing two cores computes ``contention`` times slower while both compute; a pipeline
    rank computing alone in the other's bubble runs at full speed, so only part of the bubble is lost."""
    free = Network(intra_bandwidth=1e30, intra_latency=0.0)  # messages cost nothing: compute alone decides
    alone = Hardware(memory="1GB", flops=1e12, network=free)
    contended = replace(alone, shared_cores=2, contention=1.5)
    assert [contended.slowdown(n) for n in (1, 2, 4)] == [1.0, 1.5, 3.0]
    workload = gpt_workload(depth=4, width=256, heads=4, vocab_size=64, seq_len=32)
    own, shared = (CostModel(workload, h).estimate(Layout(dp=2), batch=8).time for h in (alone, contended))
    assert shared["compute"] == pytest.approx(1.5 * own["compute"])
    gpipe = Layout(dp=1, pp=2, schedule="gpipe", microbatches=2)
    own, shared = (CostModel(workload, h).estimate(gpipe, batch=8).time for h in (alone, contended))
    cost = schedule_cost("gpipe", pp=2, microbatches=2)  # one rank computes alone 2/3 of the step, both 1/3
    assert cost.busy_ranks == pytest.approx((0.0, 2 / 3, 1 / 3))
    step = own["compute"] + own["bubble"]  # at full speed
    assert shared["compute"] + shared["bubble"] == pytest.approx(step * (2 / 3 + 1.5 / 3), rel=1e-9)


BAD = {
    "zero devices": (
        lambda: plan(
            gpt_workload(depth=2, width=8, heads=2, vocab_size=8, seq_len=4), devices=0, hardware=H100, global_batch=8
        ),
        "devices=0",
    ),  # fmt: skip
    "both batches": (
        lambda: plan(
            gpt_workload(depth=2, width=8, heads=2, vocab_size=8, seq_len=4),
            devices=2,
            hardware=H100,
            global_batch=8,
            replica_batch=4,
        ),
        "exactly one",
    ),  # fmt: skip
    "unknown schedule": (
        lambda: plan(
            gpt_workload(depth=2, width=8, heads=2, vocab_size=8, seq_len=4),
            devices=2,
            hardware=H100,
            global_batch=8,
            schedules=["zigzag"],
        ),
        "zigzag",
    ),  # fmt: skip
    "memory": (lambda: parse_bytes("eighty gigs"), "not a size"),
    "efficiency": (lambda: Hardware(efficiency=0), "efficiency"),
    "tp does not divide": (
        lambda: CostModel(gpt_workload(depth=2, width=12, heads=3, vocab_size=9, seq_len=4), H100).estimate(
            Layout(dp=1, tp=2), batch=2
        ),
        "tp=2 does not divide",
    ),  # fmt: skip
    "no layout": (
        lambda: plan(
            gpt_workload(depth=2, width=8, heads=2, vocab_size=8, seq_len=4), devices=16, hardware=H100, global_batch=7
        ),
        "global_batch=7",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_with_a_hint(case: str) -> None:
    call, fragment = BAD[case]
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert fragment in message and "HINT" in message and "\n" not in message


# ---- the command and strategy=auto -------------------------------------------------------------------------------
def compose_plan(*overrides: str):  # noqa: ANN201
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("plan", overrides=list(overrides))


def test_plan_command_reports_a_ranked_table_and_a_train_command() -> None:
    cfg = compose_plan("model=simple_cnn", "data=digits", "devices=4", "device_memory=1GB", "runnable_only=true")
    result = make_plan(cfg)
    text = report(result, 5)
    assert "layouts, best 5 shown" in text and " wins at " in text and "python train.py strategy=" in text
    assert all(strategy_choice(e.layout) is not None for e in result.estimates)


def test_sizes_print_in_digits_not_exponents() -> None:
    """A plan row of 1,020 MiB printed as 1.02e+03 MiB."""
    sizes = [human_bytes(n * 2**20) for n in (1.5, 999, 1020, 1023.9)]
    assert sizes == ["1.5 MiB", "999 MiB", "1,020 MiB", "1,024 MiB"]
    assert human_bytes(2**30) == "1 GiB" and human_bytes(5000 * 2**40) == "5,000 TiB"


def test_plan_rows_compare_at_one_global_batch() -> None:
    """Every row processes data.batch_size samples per step whatever its replicas; the train.py command of a
    layout with replicas gives each its share (train.py's data.batch_size is per replica)."""
    cfg = compose_plan("model=simple_cnn", "data=digits", "data.batch_size=32", "devices=4", "runnable_only=true")
    result = make_plan(cfg)
    assert result.global_batch == 32 and {e.layout.dp for e in result.estimates} >= {1, 2, 4}
    for estimate in result.estimates:
        assert estimate.batch * estimate.layout.dp == 32, (estimate.layout, estimate.batch)
    replicated = Layout(dp=2, pp=2, schedule="1f1b", microbatches=4)
    assert train_command(replicated, 32, cuda=False).endswith(" strategy.data_parallel_size=2 data.batch_size=16")
    assert "data.batch_size" not in train_command(Layout(dp=1, pp=4, schedule="1f1b", microbatches=4), 32, cuda=False)
    best = next(e for e in result.estimates if e.fits and strategy_choice(e.layout, cuda=False))
    assert report(result, 3).splitlines()[-1].endswith(train_command(best.layout, 32, cuda=False)[len("python ") :])


@pytest.mark.parametrize("name", hardware_presets())
def test_hardware_presets_read_the_same_with_and_without_hydra(name: str) -> None:
    """The plan command's group `hardware` and strategy=auto read the same shipped files."""
    cfg = compose_plan(f"hardware={name}")
    from_hydra = instantiate(cfg.hardware, _convert_="all")
    assert hardware_preset(name) == from_hydra
    assert hardware_preset(name, memory="1GB").memory_bytes == 2**30


def test_plan_command_bad_input_is_one_line_and_exit_2(tmp_path) -> None:  # noqa: ANN001
    done = run_script(  # `python plan.py ...`, forked from the tests' server (tests/distributed.py)
        ROOT / "plan.py", ["model=simple_cnn", "data=digits", "device_memory=lots"],
        cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "not a size" in done.stderr and done.stdout == ""


def test_train_overrides_and_auto_strategy(compose_cfg, capsys) -> None:  # noqa: ANN001
    assert train_overrides(Layout(dp=2, pp=2, schedule="1f1b", microbatches=4)) == [
        "strategy=pipeline", "trainer.devices=4", "strategy.schedule=1f1b", "strategy.microbatches=4",
        "strategy.data_parallel_size=2",
    ]  # fmt: skip
    assert train_overrides(Layout(dp=2, tp=2)) is None  # tensor parallelism with replicas always shards them
    assert train_overrides(Layout(dp=1, pp=2, tp=2, schedule="1f1b", microbatches=2)) == [
        "strategy=pipeline", "trainer.devices=4", "strategy.schedule=1f1b", "strategy.microbatches=2",
        "strategy.data_parallel_size=1", "strategy.tensor_parallel_size=2",
    ]  # 3D: tensor parallelism inside the pipeline's stages  # fmt: skip
    assert train_overrides(Layout(dp=1, pp=2, schedule="zbv", microbatches=2, stages_per_rank=2)) == [
        "strategy=pipeline", "trainer.devices=2", "strategy.schedule=zbv", "strategy.microbatches=2",
        "strategy.data_parallel_size=1",
    ]  # the split-backward schedules train the GPT and SimpleCNN (the planner used to leave them out)  # fmt: skip
    assert train_overrides(Layout(dp=2, dp_shard=True)) == ["strategy=fsdp", "trainer.devices=2"]
    assert strategy_choice(Layout(dp=2, dp_shard=True), cuda=False) is None  # Lightning's FSDP needs GPUs
    cfg = compose_cfg("strategy=auto", "trainer.devices=2", "trainer.accelerator=cpu")
    from train import build_strategy

    strategy = build_strategy(cfg)
    assert type(strategy).__name__ in {
        "DDPStrategy",
        "FSDPStrategy",
        "PipelineParallelStrategy",
        "TensorParallelStrategy",
    }
    # It says what it chose and why, and train.py records both in summary.json.
    choice = strategy.auto_choice
    assert choice["strategy"].startswith("strategy=") and " wins at " in choice["reason"], choice
    said = capsys.readouterr().err
    assert said.startswith("strategy=auto (this package's layout planner, not Lightning's 'auto') runs strategy=")
    assert choice["reason"] in said
    with pytest.raises(ValueError, match="trainer.devices as a count"):
        AutoStrategy(model=nn.Sequential(), data=None, devices=-1)


def test_a_plain_data_parallel_winner_is_told_the_sync_trade_off() -> None:
    """Where DDP wins, the explanation names local SGD, DiLoCo and async SGD with the share of the step they would
    save on; where a model-parallel layout wins, they do not apply (they replicate the whole model)."""
    model, sample = meta_models()["resnet50"]
    workload = workload_from_module(model, sample)
    ddp = plan(workload, devices=4, hardware=H100, global_batch=4096)
    assert ddp.best is not None and ddp.best.layout == Layout(dp=4)
    share = ddp.best.time["dp_comm"] / ddp.best.step_time
    assert 0 < share < 1
    assert (
        f"Trade-off: strategy=local_sgd or strategy=diloco exchange every `period` steps, cutting the {share:.0%}"
        in (ddp.explain())
    )
    assert "strategy=async_sgd never waits" in ddp.explain()
    # An all-reduce that rounds to 0% of the step (resnet152 on 8 x H100) has nothing to cut: say so, not "0%".
    best = ddp.best
    hidden = replace(best, time={**best.time, "compute": best.time["compute"] + best.time["dp_comm"], "dp_comm": 1e-9})
    said = replace(ddp, estimates=(hidden, *ddp.estimates[1:])).explain()
    assert not re.search(r"(?<!\d)0%", said) and "only gradients cross devices (under 1% of the step)" in said, said
    assert "Trade-off: the gradient all-reduce takes under 1% of the step, so strategy=local_sgd or " in said, said
    pipelined = plan(workload, devices=4, hardware=H100, global_batch=256)
    assert pipelined.best is not None and pipelined.best.layout.pp > 1
    assert "Trade-off" not in pipelined.explain()
