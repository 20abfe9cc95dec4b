"""Deferred BatchNorm statistics for micro-batched pipelines (torchgpipe's idea).

Under micro-batching each BatchNorm normalises with its micro-batch's statistics, as in GPipe, and
would also update its running statistics once per micro-batch. With deferral, normalisation still
uses micro-batch statistics, but the running statistics are updated once per mini-batch, from the
whole mini-batch, exactly as one process would. Parameter and buffer names do not change.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_SUM, _SQUARES, _COUNT = "_deferred_sum", "_deferred_squares", "_deferred_count"


def _accumulate(module: _BatchNorm, args: tuple[torch.Tensor, ...]) -> None:
    if not module.training:
        return
    x = args[0].detach()
    dims = [d for d in range(x.dim()) if d != 1]  # every dimension but channels
    with torch.no_grad():
        getattr(module, _SUM).add_(x.sum(dims, dtype=torch.float64))
        getattr(module, _SQUARES).add_(x.pow(2).sum(dims, dtype=torch.float64))
        getattr(module, _COUNT).add_(x.numel() // x.shape[1])


def _running_stats(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`bn`'s running mean, variance and batch count: buffers a BatchNorm built to track them always has."""
    mean, var, tracked = bn.running_mean, bn.running_var, bn.num_batches_tracked
    if mean is None or var is None or tracked is None:
        raise RuntimeError(
            f"{type(bn).__name__} tracks running statistics but has no running buffers. "
            "HINT: build it with track_running_stats=True rather than setting the flag afterwards."
        )
    return mean, var, tracked


def defer_over_microbatches(network: nn.Module, *, deferred: bool, pp: int) -> list[_BatchNorm]:
    """The set-up step: `defer_batchnorm` when asked for (`deferred`) and a step is cut into micro-batches (pp > 1);
    nothing otherwise (at pp=1 a step is one batch, whose statistics are already the mini-batch's)."""
    return defer_batchnorm(network) if deferred and pp > 1 else []


def defer_batchnorm(network: nn.Module) -> list[_BatchNorm]:
    """Make every BatchNorm in `network` defer its running-statistics update; returns them for `commit`."""
    layers = [m for m in network.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    for bn in layers:
        device = _running_stats(bn)[0].device
        # Non-persistent buffers: not in checkpoints, but saved and restored with the other buffers.
        bn.register_buffer(_SUM, torch.zeros(bn.num_features, dtype=torch.float64, device=device), persistent=False)
        bn.register_buffer(_SQUARES, torch.zeros_like(getattr(bn, _SUM)), persistent=False)
        bn.register_buffer(_COUNT, torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        # Training then normalises with batch statistics and leaves the running ones alone; evaluation
        # still uses the running statistics (BatchNorm passes them whenever it is not training).
        bn.track_running_stats = False
        bn.register_forward_pre_hook(_accumulate)
    return layers


def commit_batchnorm(layers: list[_BatchNorm]) -> None:
    """Fold the statistics gathered over all micro-batches of one mini-batch into the running ones."""
    with torch.no_grad():
        for bn in layers:
            count = int(getattr(bn, _COUNT))
            if count == 0:
                continue
            mean = getattr(bn, _SUM) / count
            var = getattr(bn, _SQUARES) / count - mean.pow(2)
            unbiased = var * count / max(count - 1, 1)
            running_mean, running_var, tracked = _running_stats(bn)
            momentum = bn.momentum if bn.momentum is not None else 1.0 / (int(tracked) + 1)
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
            tracked.add_(1)
            getattr(bn, _SUM).zero_()
            getattr(bn, _SQUARES).zero_()
            getattr(bn, _COUNT).zero_()


def batchnorm_notice(network: nn.Module, *, microbatches: int, bubble_at_one: float, deferred: bool) -> str | None:
    """The one line to say at start when BatchNorm will train differently from one device, else None."""
    count = sum(isinstance(m, _BatchNorm) for m in network.modules())
    if count == 0 or microbatches <= 1:
        return None
    hint = "" if deferred else "; deferred_batchnorm=True at least makes the running statistics exact"
    return (
        f"{count} BatchNorm layer(s) normalise each of the {microbatches} micro-batches with its own statistics, "
        f"so training differs from one device (GPipe semantics). HINT: microbatches=1 is exact but leaves no "
        f"overlap between stages (bubble {bubble_at_one:.0%}){hint}"
    )
