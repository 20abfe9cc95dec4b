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


def test_a_busy_thread_elsewhere_in_the_process_does_not_count() -> None:
    """A thread left busy in the process (another test's, a user's) once made a 64 x 64 Linear cost 28 ms of the
    process's CPU time, 4x a 40-layer block's: with one intra-op thread a block's cost is this thread's CPU time."""
    import threading

    with torch.device("meta"):
        network = nn.Sequential(OrderedDict(light=nn.Linear(64, 64), head=nn.Linear(64, 4)))
    sample, cpu = torch.randn(32, 64), torch.device("cpu")
    quiet = measure_block_costs(network, sample, device=cpu)
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    spinner.start()
    try:
        busy = measure_block_costs(network, sample, device=cpu)
    finally:
        stop.set()
        spinner.join()
    # a spinning Python thread: this thread's CPU time grew 13x (its turns at the GIL), the process's 330x
    assert busy[0] < 50 * max(quiet[0], 1e-4), (quiet, busy)
