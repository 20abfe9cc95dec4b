"""Timing blocks for balance='time' works on a meta-device model and sees a heavy block as heavy."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from lightning_parallel.pipeline.profile import measure_block_costs


def test_costs_per_block_on_a_meta_model() -> None:
    with torch.device("meta"):
        network = nn.Sequential(
            OrderedDict(
                light=nn.Linear(64, 64),
                heavy=nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)]),
                head=nn.Linear(64, 4),
            )
        )
    costs = measure_block_costs(network, torch.randn(32, 64), device=torch.device("cpu"))
    assert len(costs) == 3 and all(c > 0 for c in costs)
    assert costs[1] > 5 * costs[0]
    assert all(p.is_meta for p in network.parameters())  # the model itself was never materialised
