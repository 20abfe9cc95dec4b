"""Measure each block's forward + backward time on a sample micro-batch, for balancing stages by time
(as torchgpipe's balance_by_time did). Materialises one block at a time, so the whole model never exists.

It only measures; the split itself is `balance.split_by_cost`.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn


def _real_copy(block: nn.Module, device: torch.device) -> nn.Module:
    """A copy of the block with real storage (values do not matter for timing)."""
    if any(t.is_meta for t in [*block.parameters(), *block.buffers()]):
        block = copy.deepcopy(block).to_empty(device=device)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.02)
            for b in block.buffers():
                b.fill_(1.0) if b.is_floating_point() else b.zero_()
        return block
    return copy.deepcopy(block).to(device)


def measure_block_costs(
    network: nn.Sequential, sample: torch.Tensor, *, device: torch.device, repeats: int = 3
) -> list[float]:
    """Fastest seconds of forward + backward per block, feeding each block the previous block's output.

    The fastest of the repeats, not their median: on a shared machine other work only ever adds time. On CPU CPU
    time, not the wall clock, so other processes' load (another rank's, another job's) does not count: this thread's
    with one intra-op thread (all of a block's work runs here; a busy thread elsewhere in the process, once 28 ms on
    a 32 x 64 Linear, does not count either), else the process's (the intra-op threads share the work).

    Args:
        network: the model as an nn.Sequential of named blocks (may live on the meta device).
        sample: one micro-batch of model input.
        device: where to measure (the rank's own device).
        repeats: timed repetitions per block after one warm-up.
    """
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    if device.type != "cuda" and torch.get_num_threads() == 1:
        clock = time.thread_time
    costs = []
    x = sample.to(device)
    for block in network.children():
        real = _real_copy(block, device).train()
        inputs = x.detach().requires_grad_(x.is_floating_point())
        times = []
        for attempt in range(repeats + 1):
            start = clock()
            out = real(inputs)
            out.float().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if attempt:  # the first run pays one-off allocation costs
                times.append(clock() - start)
        costs.append(min(times))
        x = out.detach()
        del real
    return costs
