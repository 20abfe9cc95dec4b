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
from distributed import replica_states, run_workers

sys.path.insert(0, str(Path(__file__).parent))
from user_modules import Classifier, build, fit, loader, sequential_mlp  # noqa: E402

import lightning_parallel  # noqa: E402, F401 - registers the strategies
from lightning_parallel.pipeline.batchnorm import batchnorm_notice  # noqa: E402

STEPS = 12  # two epochs of 6 batches: a reshuffle between epochs would show


def reference(net: str, step: str, batch_size: int = 16, trainer: dict | None = None) -> dict:
    module = build(net, step)
    return fit(module, strategy="auto", devices=1, steps=STEPS, shuffle=False, batch_size=batch_size, **(trainer or {}))


def assert_matches(results: list[dict], ref: dict, replicas: int = 1) -> None:
    """Every rank's losses (averaged over data-parallel replicas) and the union of their weights match."""
    for result in results:
        assert "error" not in result, result
        assert len(result["losses"]) == STEPS
    losses = torch.tensor([result["losses"] for result in results]).reshape(replicas, -1, STEPS).mean(0)
    assert (losses - torch.tensor(ref["losses"])).abs().max() < 1e-5, (losses, ref["losses"])
    for merged in replica_states(results, replicas):  # every replica, not only the last one's ranks
        assert merged.keys() == ref["state"].keys()
        for name, value in ref["state"].items():
            torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-5, msg=name)


def run(name: str, net: str, *, step: str = "criterion", devices: int = 2, **kwargs: object) -> dict:
    config = {"strategy": name, "devices": devices, "steps": STEPS, "net": net, "step": step}
    batch_size, trainer = kwargs.pop("batch_size", None), kwargs.pop("trainer", None)
    extra = {"batch_size": batch_size} if batch_size else {}
    return {**config, "kwargs": kwargs, **extra, **({"trainer": trainer} if trainer else {})}


@pytest.mark.slow
def test_user_modules_match_one_device_or_stop_with_one_line(tmp_path: Path) -> None:
    configs = [
        run("pipeline", "sequential_mlp"),
        run("pipeline", "sequential_mlp", step="functional_with_metrics"),
        run("pipeline", "sequential_mlp", step="scaled"),
        run("pipeline", "sequential_mlp", balance="time"),  # blocks timed on a plain DataLoader's first batch
        run("tensor_parallel", "sequential_mlp"),
        # Networks with their own forward, split by tracing; 20-sample batches end in an uneven last batch
        run("pipeline", "tutorial_cnn", batch_size=20),
        run("pipeline", "tutorial_cnn", schedule="zbv"),
        run("pipeline", "batchnorm_cnn", schedule="gpipe", microbatches=1),  # BatchNorm: exact at one micro-batch
        run("pipeline", "four_linear_mlp", step="functional_with_metrics"),
        run("tensor_parallel", "tutorial_cnn"),
        run("tensor_parallel", "four_linear_mlp"),
        # One weight used on both stages: kept tied (gradients summed between the stages), clipped once
        run("pipeline", "tied_sequential", trainer={"gradient_clip_val": 0.05}),
        # Refused: the same line on every rank, before the optimizer step
        run("pipeline", "sequential_mlp", step="l2"),
        run("pipeline", "sequential_mlp", step="two_forwards"),
        # Replicas that sync every step equal Lightning's DDP on the same module and plain DataLoader
        run("ddp", "tutorial_cnn", batch_size=8),
        run("local_sgd", "tutorial_cnn", batch_size=8, period=1),
        run("diloco", "tutorial_cnn", batch_size=8, period=1, outer_sgd=[1.0, 0.0]),
    ]
    ranks = run_workers("drop_in", 2, configs, tmp_path)
    synced = [list(results) for results in zip(*ranks, strict=True)][-3:]
    configs, ranks = configs[:-3], [rank[:-3] for rank in ranks]
    for results in synced[1:]:
        for rank, (ddp, other) in enumerate(zip(synced[0], results, strict=True)):
            assert "error" not in other and len(other["losses"]) == STEPS, other
            assert max(abs(a - b) for a, b in zip(ddp["losses"], other["losses"], strict=True)) < 1e-5, rank
            for name, value in ddp["state"].items():
                torch.testing.assert_close(other["state"][name], value, rtol=0, atol=1e-5, msg=name)
    runs = list(zip(*ranks, strict=True))  # per config: one result per rank
    for config, results in zip(configs[:-2], runs, strict=False):
        ref = reference(config["net"], config["step"], config.get("batch_size", 16), config.get("trainer"))
        assert_matches(list(results), ref)
    # Metrics updated inside training_step: the logged training accuracy and loss agree with one device.
    ref = reference("sequential_mlp", "functional_with_metrics")
    for result in runs[1]:
        for key in ("train_acc_epoch", "train_loss", "train_acc_step"):
            assert abs(result["metrics"][key] - ref["metrics"][key]) < 1e-5, (key, result["metrics"], ref["metrics"])
    refusals = {-2: "computes with the parameter `model.3.weight` directly", -1: "calls the network twice"}
    for index, expected in refusals.items():
        for result in runs[index]:
            assert "error" in result and expected in result["error"], result
            assert "HINT:" in result["error"] and "\n" not in result["error"]


@pytest.mark.slow
def test_four_processes_traced_stages_data_times_pipeline_and_3d(tmp_path: Path) -> None:
    configs = [
        run("pipeline", "four_linear_mlp", devices=4),
        run("pipeline", "tutorial_cnn", devices=4, schedule="gpipe"),
        run("pipeline", "tutorial_cnn", devices=4, data_parallel_size=2, batch_size=8),
        # pp 2 x tp 2 of the user's nn.Sequential with self.criterion: the automatic plan shards its Linear pairs
        run("pipeline", "sequential_mlp", devices=4, tensor_parallel_size=2),
    ]
    ranks = run_workers("drop_in", 4, configs, tmp_path)
    runs = list(zip(*ranks, strict=True))
    assert_matches(list(runs[0]), reference("four_linear_mlp", "criterion"))
    assert_matches(list(runs[1]), reference("tutorial_cnn", "criterion"))
    # dp 2 x pp 2, 8 samples per replica: one device sees the same 16-sample global batches
    assert_matches(list(runs[2]), reference("tutorial_cnn", "criterion"), replicas=2)
    assert_matches(list(runs[3]), reference("sequential_mlp", "criterion"))


class TwoNetworks(Classifier):
    def __init__(self) -> None:
        super().__init__(sequential_mlp())
        self.teacher = sequential_mlp()


class Manual(Classifier):
    def __init__(self) -> None:
        super().__init__(sequential_mlp())
        self.automatic_optimization = False


class PairBlock(torch.nn.Module):
    """Returns (features, a side value): fine on one device when the next block unpacks it, not across stages."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.mean(dim=1, keepdim=True)


class Unpack(torch.nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] + pair[1]


class TupleBlock(Classifier):
    def __init__(self) -> None:
        net = sequential_mlp()
        super().__init__(torch.nn.Sequential(net[0], PairBlock(), Unpack(), *list(net)[1:]))


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (TwoNetworks, "cannot tell which attribute of TwoNetworks is the network (candidates ['model', 'teacher'])"),
        (Manual, "Manual uses manual optimization"),
        (TupleBlock, "block '1' (PairBlock) of the nn.Sequential returns a tuple"),
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


def test_metrics_built_on_the_meta_device_are_refused_before_launch() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="pipeline", max_steps=1, logger=False)
    with trainer.init_module():
        module = build("sequential_mlp", "criterion")
    with pytest.raises(ValueError, match=r"train_acc \(MulticlassAccuracy\) of Classifier are on the meta device"):
        trainer.fit(module, train_dataloaders=loader(shuffle=False))
