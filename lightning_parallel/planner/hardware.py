"""The machine a plan is for: per-device memory and speed, fixed overheads, and a bandwidth/latency network model
that prices collectives and pipeline messages.

Numbers only: it measures nothing (``measure.py`` and ``benchmarks/planner_accuracy.py`` do) and knows no model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_UNITS = {"": 1, "b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30,
          "tb": 2**40, "tib": 2**40}  # fmt: skip
# name -> bytes per (parameter, gradient, optimizer-state element, activation element)
PRECISIONS: dict[str, tuple[int, int, int, int]] = {
    "32-true": (4, 4, 4, 4),
    "bf16-mixed": (4, 4, 4, 2),  # Lightning's mixed precision keeps fp32 weights and autocasts activations
    "16-mixed": (4, 4, 4, 2),
    "bf16-true": (2, 2, 2, 2),
    "16-true": (2, 2, 2, 2),
}
ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # Lightning's short names


def parse_bytes(value: int | float | str) -> int:
    """``80GB`` -> bytes. Device memory is quoted in binary units, as nvidia-smi shows it: 80GB = 80 GiB.

    Raises:
        ValueError: Not a positive size; one line with an example.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"device memory {value!r} is not a size. HINT: write e.g. 80GB, 512MiB or 85899345920")
    return int(float(match.group(1)) * _UNITS[unit])


def human_bytes(count: float) -> str:
    """Bytes in binary units with three significant digits: ``1.5 GiB``; 1,000 to 1,023 of a unit in whole numbers
    (``1,020 MiB``, where three digits would print ``1.02e+03``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            value = count / size
            return f"{value:.3g} {unit}" if abs(value) < 999.5 else f"{value:,.0f} {unit}"
    return f"{count:.0f} B"


@dataclass(frozen=True, kw_only=True)
class Network:
    """Links between devices: a ring for bandwidth, a tree for latency (what NCCL's choice amounts to).

    Args:
        devices_per_node: Devices sharing the fast intra-node links.
        intra_bandwidth: Bytes/s per device inside a node (one direction).
        intra_latency: Seconds per message inside a node.
        inter_bandwidth: Bytes/s per device across nodes.
        inter_latency: Seconds per message across nodes.
    """

    devices_per_node: int = 8
    intra_bandwidth: float = 150e9
    intra_latency: float = 5e-6
    inter_bandwidth: float = 25e9
    inter_latency: float = 10e-6

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not (math.isfinite(v) and (v >= 0 if "latency" in k else v > 0))}
        if bad or self.devices_per_node < 1:
            raise ValueError(
                f"network figures must be finite, bandwidths and devices_per_node > 0 and latencies >= 0, got "
                f"{bad or {'devices_per_node': self.devices_per_node}}. HINT: e.g. inter_bandwidth=25e9"
            )

    def link(self, size: int, stride: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group of ``size`` ranks ``stride`` apart (ranks fill nodes in order)."""
        if size * stride <= self.devices_per_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    def collective_terms(self, kind: str, size: int, stride: int) -> tuple[float, float]:
        """(seconds, seconds per byte of the full tensor) of one collective among ``size`` ranks."""
        if size <= 1:
            return 0.0, 0.0
        bandwidth, latency = self.link(size, stride)
        steps = math.ceil(math.log2(size))
        per_byte = (size - 1) / size / bandwidth
        if kind == "all_reduce":  # reduce-scatter then all-gather
            return 2 * steps * latency, 2 * per_byte
        if kind in ("all_gather", "reduce_scatter"):
            return steps * latency, per_byte
        raise ValueError(f"unknown collective {kind!r}. HINT: all_reduce, all_gather or reduce_scatter")

    def collective(self, kind: str, nbytes: float, size: int, stride: int) -> float:
        """Seconds for one collective over ``nbytes`` (the full tensor) among ``size`` ranks ``stride`` apart."""
        fixed, per_byte = self.collective_terms(kind, size, stride)
        return fixed + per_byte * nbytes

    def send(self, nbytes: float, *, crosses_nodes: bool) -> float:
        """Seconds for one point-to-point message."""
        bandwidth, latency = (
            (self.inter_bandwidth, self.inter_latency) if crosses_nodes else (self.intra_bandwidth, self.intra_latency)
        )
        return latency + nbytes / bandwidth


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device kind and how long the work around the blocks takes on it.

    Args:
        name: Shown in the plan's header.
        memory: Memory per device: bytes or a size such as ``"80GB"``.
        flops: Peak dense FLOP/s per device, or one figure per precision name (``{"bf16-mixed": 989e12, ...}``).
        efficiency: Fraction of peak FLOP/s the blocks reach (model FLOPs utilisation).
        usable_memory: Fraction of ``memory`` a layout may fill (allocator caching, context, fragmentation).
        block_overhead: Seconds per block forward + backward that do not grow with the batch (kernel launches).
        action_overhead: Seconds per pipeline action (one stage's forward or backward of one micro-batch).
        collective_overhead: Seconds per tensor-parallel or sharded data-parallel (FSDP) collective beyond the
            network: DTensor dispatch, redistribution, copies. DDP's bucketed all-reduce has none.
        step_overhead: Seconds per optimizer step outside the blocks (training loop, loss, hooks).
        sync_overhead: Seconds per step that layouts of several devices add beyond the modelled traffic (the logged
            loss's all-reduce, broadcasts, waiting for the slowest rank).
        dp_overhead: Seconds per step of a data-parallel wrapper around the whole model (DDP / FSDP, when
            pp = tp = 1) on top of that: its forward hooks, buffer broadcast and barrier.
        optimizer_time: Seconds per local parameter for one optimizer step.
        dp_overlap: Fraction of the backward pass that hides data-parallel communication (0: none hidden).
        shared_cores: Cores that all devices share (processes on one CPU machine); 0: each device computes on its
            own (GPUs). Devices beyond the cores take turns; a rank waiting in a pipeline's bubble holds no core.
        contention: How many times slower each device computes while ``shared_cores`` of them compute at once than
            while one computes alone (shared caches, memory bandwidth, a VM's cores sharing physical ones).
        network: The links between devices.
    """

    name: str = "device"
    memory: int | str = "80GB"
    flops: float | Mapping[str, float] = 100e12
    efficiency: float = 0.4
    usable_memory: float = 0.9
    block_overhead: float = 0.0
    action_overhead: float = 0.0
    collective_overhead: float = 0.0
    step_overhead: float = 0.0
    sync_overhead: float = 0.0
    dp_overhead: float = 0.0
    optimizer_time: float = 0.0
    dp_overlap: float = 0.0
    shared_cores: int = 0
    contention: float = 1.0
    network: Network = field(default_factory=Network)

    def __post_init__(self) -> None:
        parse_bytes(self.memory)  # fail early on a bad size
        for key in ("efficiency", "usable_memory", "dp_overlap"):
            value = getattr(self, key)
            if not 0 <= value <= 1 or (key != "dp_overlap" and value == 0):
                raise ValueError(f"hardware {key}={value} must be in (0, 1]. HINT: e.g. {key}=0.5")
        for key in (
            "block_overhead",
            "action_overhead",
            "collective_overhead",
            "step_overhead",
            "sync_overhead",
            "dp_overhead",
            "optimizer_time",
        ):
            if not getattr(self, key) >= 0:
                raise ValueError(f"hardware {key}={getattr(self, key)} must be >= 0 seconds. HINT: {key}=0")
        if self.shared_cores < 0 or not self.contention >= 1:
            raise ValueError(
                f"hardware shared_cores={self.shared_cores} must be >= 0 and contention={self.contention} >= 1. "
                "HINT: shared_cores=0, contention=1 for devices that compute on their own"
            )
        rates = self.flops.values() if isinstance(self.flops, Mapping) else [self.flops]
        if not rates or not all(float(rate) > 0 for rate in rates):
            raise ValueError(f"hardware flops {self.flops!r} must be > 0. HINT: e.g. flops=312e12")

    def slowdown(self, busy: int) -> float:
        """How many times slower each of ``busy`` devices computes while they all compute, than one alone."""
        if self.shared_cores == 0 or busy <= 1:
            return 1.0
        running = min(busy, self.shared_cores)  # the rest wait for a core
        contended = 1.0 + (self.contention - 1.0) * (running - 1) / max(1, self.shared_cores - 1)
        return contended * max(1.0, busy / self.shared_cores)

    @property
    def memory_bytes(self) -> int:
        """Memory per device in bytes."""
        return parse_bytes(self.memory)

    def flops_for(self, precision: str) -> float:
        """Peak FLOP/s at a precision (the single figure when only one is given)."""
        if not isinstance(self.flops, Mapping):
            return float(self.flops)
        precision = ALIASES.get(precision, precision)
        if precision not in self.flops:
            raise ValueError(
                f"hardware {self.name} gives no FLOP/s for precision {precision!r}. "
                f"HINT: use one of {', '.join(self.flops)}"
            )
        return float(self.flops[precision])


def precision_bytes(precision: str) -> tuple[int, int, int, int]:
    """Bytes per (parameter, gradient, optimizer-state element, activation element) of a Lightning precision."""
    name = ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}. HINT: use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]
