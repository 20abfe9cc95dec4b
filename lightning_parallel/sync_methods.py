"""How data-parallel replicas keep in agreement: one row per `conf/strategy` option on this axis (ddp, local_sgd,
diloco, async_sgd), saying what crosses the network, how often, and whether each step waits for the slowest worker.

The planner's explanation, the sweep report and `benchmarks/sync_vs_async.py` all read these rows, so the trade-off
(fewer bytes, or no waiting, against more steps to a target) is stated in one place. Plain Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4  # bytes per exchanged value


@dataclass(frozen=True)
class SyncMethod:
    """One way for replicas to agree.

    Args:
        name: The `conf/strategy` option.
        exchanged: What each worker sends and receives, in words.
        periodic: Exchanges every `period` optimizer steps instead of every step.
        waits_for_slowest: Each exchange is a meeting of all workers, so one slow worker paces all.
    """

    name: str
    exchanged: str
    periodic: bool
    waits_for_slowest: bool

    def bytes_per_step(
        self, parameters: int, workers: int, *, period: int = 1, buffers: int = 0, steps: int | None = None
    ) -> float:
        """Bytes one worker sends plus receives per optimizer step (fp32), from what the method exchanges.

        A ring all-reduce of B bytes sends and receives 2 (n-1)/n x B each. ``steps`` counts the exchanges of a run
        that long exactly (local SGD averages after steps 1, 1 + period, ...; DiLoCo after period, 2 x period, ...);
        None gives the long-run average.
        """
        ring = 2 * 2 * (workers - 1) / workers
        p, b = FP32 * parameters, FP32 * buffers
        if self.name == "ddp":  # gradients all-reduced every step, floating-point buffers broadcast
            return ring * p + 2 * b
        if self.name == "local_sgd":  # torch's PeriodicModelAverager: parameters only
            syncs = 1 + (steps - 1) // period if steps else None
            return ring * p * (syncs / steps if syncs and steps else 1 / period)
        if self.name == "diloco":  # the pseudo-gradient and floating-point buffers
            return ring * (p + b) * (steps // period / steps if steps else 1 / period)
        return 2 * p  # async: a gradient pushed, the weights pulled

    def formula(self, period: int = 1) -> str:
        """`bytes_per_step` in words, for n workers and P parameters."""
        every = f"/ {period} " if self.periodic and period > 1 else ""
        if self.name == "async_sgd":
            return f"4P push + 4P pull every step ({self.exchanged})"
        return f"4 (n-1)/n x 4P {every}({self.exchanged})"


SYNC_METHODS: dict[str, SyncMethod] = {
    method.name: method
    for method in (
        SyncMethod("ddp", "gradient all-reduce every step", periodic=False, waits_for_slowest=True),
        SyncMethod("local_sgd", "parameter average every period", periodic=True, waits_for_slowest=True),
        SyncMethod("diloco", "pseudo-gradient average every period, outer step", periodic=True, waits_for_slowest=True),
        SyncMethod("async_sgd", "gradient to a server, weights back", periodic=False, waits_for_slowest=False),
    )
}

MEASURED = "benchmarks/results/sync_vs_async_{2,4}p.md"  # where the steps-to-target side of the trade-off is measured


def alternatives(gradient_share: float) -> str:
    """A sentence for a plain data-parallel layout whose gradient all-reduce takes ``gradient_share`` of its step:
    what the periodic and the asynchronous methods would change, and where their cost is measured."""
    periodic = " or ".join(f"strategy={m.name}" for m in SYNC_METHODS.values() if m.periodic)
    free = " or ".join(f"strategy={m.name}" for m in SYNC_METHODS.values() if not m.waits_for_slowest)
    return (
        f"Trade-off: {periodic} exchange every `period` steps, cutting the {gradient_share:.0%} of the step spent "
        f"on the gradient all-reduce about period-fold, and {free} never waits for a slow worker; both may need "
        f"more steps to reach a target (measured: {MEASURED})."
    )
