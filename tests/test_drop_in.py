"""Drop-in: LightningModules written the way users write them train under the strategies, chosen by registry
name with no other change, and match one device (losses and final weights within 1e-5); what cannot be run
exactly stops with one line. Plain DataLoaders with shuffle=False and Lightning's default
use_distributed_sampler=True: at one data-parallel replica the strategies leave the user's sampler alone."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_workers

sys.path.insert(0, str(Path(__file__).parent))
from user_modules import Classifier, build, fit, loader, sequential_mlp  # noqa: E402

import lightning_parallel  # noqa: E402, F401 - registers the strategies
from lightning_parallel.pipeline.batchnorm import batchnorm_notice  # noqa: E402

STEPS = 12  # two epochs of 6 batches: a reshuffle between epochs would show


def reference(net: str, step: str) -> dict:
    return fit(build(net, step), strategy="auto", devices=1, steps=STEPS, shuffle=False)


def assert_matches(results: list[dict], ref: dict) -> None:
    for result in results:
        assert "error" not in result, result
        assert len(result["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(result["losses"], ref["losses"], strict=True)) < 1e-5
    merged = {name: value for result in results for name, value in result["state"].items()}
    assert merged.keys() == ref["state"].keys()
    for name, value in ref["state"].items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_user_modules_match_one_device_or_stop_with_one_line(tmp_path: Path) -> None:
    pipeline = {"strategy": "pipeline", "devices": 2, "steps": STEPS, "net": "sequential_mlp"}
    configs = [
        {**pipeline, "step": "criterion"},
        {**pipeline, "step": "functional_with_metrics"},
        {**pipeline, "step": "scaled"},
        {**pipeline, "step": "criterion", "strategy": "tensor_parallel"},
        {**pipeline, "step": "l2"},
        {**pipeline, "step": "two_forwards"},
    ]
    ranks = run_workers("drop_in", 2, configs, tmp_path)
    runs = list(zip(*ranks, strict=True))  # per config: one result per rank
    for index in range(4):
        assert_matches(list(runs[index]), reference("sequential_mlp", configs[index]["step"]))
    # Metrics updated inside training_step: the logged training accuracy and loss agree with one device.
    ref = reference("sequential_mlp", "functional_with_metrics")
    for result in runs[1]:
        for key in ("train_acc_epoch", "train_loss", "train_acc_step"):
            assert abs(result["metrics"][key] - ref["metrics"][key]) < 1e-5, (key, result["metrics"], ref["metrics"])
    for index, expected in [
        (4, "computes with the parameter `model.3.weight` directly"),
        (5, "calls the network twice"),
    ]:
        for result in runs[index]:
            assert "error" in result and expected in result["error"], result
            assert "HINT:" in result["error"] and "\n" not in result["error"]


class TwoNetworks(Classifier):
    def __init__(self) -> None:
        super().__init__(sequential_mlp())
        self.teacher = sequential_mlp()


class Manual(Classifier):
    def __init__(self) -> None:
        super().__init__(sequential_mlp())
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (lambda: build("tied_sequential", "criterion"), "tied parameters across pipeline ranks (1.weight = 3.weight)"),
        (TwoNetworks, "cannot tell which attribute of TwoNetworks is the network (candidates ['model', 'teacher'])"),
        (Manual, "Manual uses manual optimization"),
    ],
)
def test_pipeline_refuses_before_launch(module, expected: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="pipeline", max_steps=1, logger=False)
    with pytest.raises(ValueError, match="HINT") as raised:
        trainer.fit(module(), train_dataloaders=loader(shuffle=False))
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_batchnorm_under_micro_batches_is_said_once_with_the_way_to_exactness() -> None:
    network = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    notice = batchnorm_notice(network, microbatches=4, bubble_at_one=0.5, deferred=False)
    assert notice is not None and "\n" not in notice
    assert "1 BatchNorm layer(s)" in notice and "4 micro-batches" in notice and "microbatches=1 is exact" in notice
    assert "bubble 50%" in notice and "deferred_batchnorm=True" in notice
    assert "deferred_batchnorm" not in batchnorm_notice(network, microbatches=4, bubble_at_one=0.5, deferred=True)
    assert batchnorm_notice(network, microbatches=1, bubble_at_one=0.5, deferred=False) is None
    assert batchnorm_notice(sequential_mlp(), microbatches=4, bubble_at_one=0.5, deferred=False) is None
