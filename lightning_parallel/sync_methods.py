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
        ring: The exchange is an all-reduce among the workers (else a push to a server and a pull back).
        buffers: Floating-point buffers travel too (DDP broadcasts them, DiLoCo averages them; both counted as
            part of the all-reduce).
        periodic: Exchanges every `period` optimizer steps instead of every step.
        first_after_one: A periodic method's first exchange follows step 1 (torch's PeriodicModelAverager), not
            step `period` (DiLoCo).
        waits_for_slowest: Each exchange is a meeting of all workers, so one slow worker paces all.
    """

    name: str
    exchanged: str
    ring: bool
    buffers: bool
    periodic: bool
    first_after_one: bool
    waits_for_slowest: bool

    def exchanges_per_step(self, period: int = 1, steps: int | None = None) -> float:
        """Exchanges per optimizer step: counted exactly over a run of ``steps``, or the long-run average."""
        if not self.periodic:
            return 1.0
        if steps is None:
            return 1 / period
        return (1 + (steps - 1) // period if self.first_after_one else steps // period) / steps

    def bytes_per_step(
        self, parameters: int, workers: int, *, period: int = 1, buffers: int = 0, steps: int | None = None
    ) -> float:
        """Bytes one worker sends plus receives per optimizer step (fp32), from what the method exchanges.

        A ring all-reduce of B bytes sends and receives 2 (n-1)/n x B each; a push and a pull move B each.
        """
        values = parameters + (buffers if self.buffers else 0)
        if self.ring:
            return 2 * 2 * (workers - 1) / workers * FP32 * values * self.exchanges_per_step(period, steps)
        return 2 * FP32 * values

    def formula(self, period: int = 1) -> str:
        """`bytes_per_step` in words, for n workers and P parameters."""
        if not self.ring:
            return f"4P push + 4P pull every step ({self.exchanged})"
        every = f"/ {period} " if self.periodic and period > 1 else ""
        return f"4 (n-1)/n x 4P {every}({self.exchanged})"


SYNC_METHODS: dict[str, SyncMethod] = {
    method.name: method
    for method in (
        SyncMethod("ddp", "gradient all-reduce every step", ring=True, buffers=True, periodic=False,
                   first_after_one=False, waits_for_slowest=True),
        SyncMethod("local_sgd", "parameter average every period", ring=True, buffers=False, periodic=True,
                   first_after_one=True, waits_for_slowest=True),
        SyncMethod("diloco", "pseudo-gradient average every period, outer step", ring=True, buffers=True,
                   periodic=True, first_after_one=False, waits_for_slowest=True),
        SyncMethod("async_sgd", "gradient to a server, weights back", ring=False, buffers=False, periodic=False,
                   first_after_one=False, waits_for_slowest=False),
    )
}  # fmt: skip

MEASURED = "benchmarks/results/sync_vs_async_{2,4}p.md"  # where the steps-to-target side of the trade-off is measured


def alternatives(gradient_share: float) -> str:
    """A sentence for a plain data-parallel layout whose gradient all-reduce takes ``gradient_share`` of its step:
    what the periodic and the asynchronous methods would change, and where their cost is measured."""
    periodic = " or ".join(f"strategy={m.name}" for m in SYNC_METHODS.values() if m.periodic)
    free = " or ".join(f"strategy={m.name}" for m in SYNC_METHODS.values() if not m.waits_for_slowest)
    if f"{gradient_share:.0%}" == "0%":  # nothing worth cutting: "cutting the 0% of the step" said nothing true
        return (
            f"Trade-off: the gradient all-reduce takes under 1% of the step, so {periodic} (exchanging every "
            f"`period` steps) would save almost nothing here; {free} never waits for a slow worker, but may need more "
            f"steps to reach a target (measured: {MEASURED})."
        )
    return (
        f"Trade-off: {periodic} exchange every `period` steps, cutting the {gradient_share:.0%} of the step spent "
        f"on the gradient all-reduce about period-fold, and {free} never waits for a slow worker; both may need "
        f"more steps to reach a target (measured: {MEASURED})."
    )
