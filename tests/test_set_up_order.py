"""The set-up order (`parallelize/order.py`): at dp = pp = tp = 1 every step returns at once, so a network comes out
as one process builds it: plain parameters with one process's values, no inputs asked for, no mesh touched, no FSDP2
and no deferred BatchNorm. (The orders at larger sizes: the parity tests.)"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.dims import ParallelDims
from lightning_parallel.parallelize import parallelize_pipeline, parallelize_tensor
from lightning_parallel.weights import materialize


def size_one() -> SimpleNamespace:
    """A strategy's settings at size 1 everywhere, with every option that acts at a larger size switched on, and
    no mesh: a step that touched it would fail."""
    return SimpleNamespace(
        dims=ParallelDims(dp=1, pp=1, tp=1),
        device_mesh=None,
        root_device=torch.device("cpu"),
        plan=None,
        spec=None,
        balance="time",
        replicas="fsdp",
        deferred_batchnorm=True,
        activation_checkpointing="none",
        compile_options=None,
        sequence_parallel=False,
        microbatches_for=lambda pp: 2 * pp,
    )


def meta_network() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def assert_as_one_process_builds_it(network: nn.Module) -> None:
    reference = meta_network()
    materialize(reference, torch.device("cpu"))
    for (name, param), (_, expected) in zip(network.named_parameters(), reference.named_parameters(), strict=True):
        assert type(param) is nn.Parameter and torch.equal(param, expected), name
    assert not any(isinstance(m, FSDPModule) for m in network.modules())


def test_the_pipeline_order_at_size_one_places_the_network_whole() -> None:
    network = meta_network()
    done = parallelize_pipeline(network, size_one(), lambda: pytest.fail("inputs asked for with nothing to split"))
    assert done.stages is None and done.plan is None and done.batchnorms == [] and done.compiled_blocks == 0
    assert network[1].track_running_stats  # BatchNorm statistics are not deferred: there are no micro-batches
    assert_as_one_process_builds_it(network)


def test_the_tensor_order_at_tp1_reports_its_plan_and_leaves_the_network_plain() -> None:
    network = meta_network()
    done = parallelize_tensor(network, network, size_one(), configured=False)
    assert done.plan[0] == "auto" and done.plan[1], done.plan  # resolved for summary.json, not applied
    assert_as_one_process_builds_it(network)
    configured = copy.deepcopy(network)
    done = parallelize_tensor(configured, configured, size_one(), configured=True)
    assert done.plan == ("configure_model", {}, {}) and done.peak_parameter_bytes == 0
