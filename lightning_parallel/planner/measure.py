"""Time each block's forward + backward on this machine at two micro-batch sizes: a fixed and a per-sample cost.

Runs the given (materialised) model on its own device with random inputs; it trains nothing (gradients it leaves in
``.grad`` are cleared) and estimates nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn


def measure_block_seconds(
    model: nn.Sequential,
    make_batch: Callable[[int], torch.Tensor],
    *,
    sizes: Sequence[int] = (2, 8),
    repeats: int = 5,
    warmup: int = 2,
    threads: int | None = None,
) -> list[tuple[float, float]]:
    """Median forward + backward seconds of every block at two batch sizes, fitted as ``fixed + per_sample * n``.

    Args:
        model: An ``nn.Sequential`` of blocks with real (not meta) weights.
        make_batch: Returns a model input of ``n`` samples.
        sizes: The two batch sizes to time (the larger one should be near the planned micro-batch size).
        repeats: Timed runs per block and size; the median is kept (the machine may be shared).
        warmup: Untimed runs first (allocator, kernel selection).
        threads: Intra-op threads while timing (one device = one thread on a CPU); None keeps torch's setting.

    Returns:
        One ``(fixed seconds, seconds per sample)`` pair per block, both >= 0.
    """
    if any(t.is_meta for t in model.parameters()):
        raise ValueError(
            "measure_block_seconds needs real weights, the model is on the meta device. HINT: build it on CPU"
        )
    if len(sizes) != 2 or not 1 <= sizes[0] < sizes[1] or repeats < 1:
        raise ValueError(f"need two increasing batch sizes >= 1 and repeats >= 1, got {sizes}, {repeats}. HINT: (2, 8)")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        timings = [_time_blocks(model, make_batch(n), repeats, warmup) for n in sizes]
    finally:
        torch.set_num_threads(previous)
        model.zero_grad(set_to_none=True)
    fits = []
    for small, large in zip(*timings, strict=True):
        per_sample = max(0.0, (large - small) / (sizes[1] - sizes[0]))
        fixed = small - per_sample * sizes[0]
        if fixed < 0:  # noise: attribute everything to the samples
            fixed, per_sample = 0.0, large / sizes[1]
        fits.append((fixed, per_sample))
    return fits


def _time_blocks(model: nn.Sequential, x: torch.Tensor, repeats: int, warmup: int) -> list[float]:
    seconds = []
    for index, block in enumerate(model.children()):
        inputs = x.detach()
        if index > 0 and inputs.is_floating_point():
            inputs.requires_grad_(True)
        out = block(inputs)
        grad = torch.ones_like(out)
        samples = []
        for run in range(warmup + repeats):
            start = time.perf_counter()
            out = block(inputs)
            out.backward(grad)
            if run >= warmup:
                samples.append(time.perf_counter() - start)
        seconds.append(statistics.median(samples))
        x = out.detach()
    return seconds
