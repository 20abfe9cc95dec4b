"""What a dry run found, as records: one row per rank role (measured bytes next to the planner's), the table printed,
`dry_run.json`, and the one-line refusal of a role that does not fit the device memory. Formats only; measures
nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_parallel.planner import human_bytes, parse_bytes
from lightning_parallel.planner.presets import hardware_preset, hardware_presets

KEYS = ("params", "grads", "optimizer", "activations", "total")


@dataclass(frozen=True)
class RoleRow:
    """One rank role: which ranks it stands for, its blocks and tensor plan, and bytes measured and predicted (keys
    params, grads, optimizer, activations, total). The measured total is the step's peak of live tensors; its
    activations are that peak less the parameters, gradients and optimizer state (so also FSDP2's gathered blocks)."""

    role: str
    global_rank: int
    ranks: int
    blocks: list[str]
    sharded: dict[str, str]
    measured: dict[str, int]
    predicted: dict[str, float] | None
    set_up_peak_bytes: int
    seconds: float

    @classmethod
    def of(cls, role: Any, measured: Any, predicted: dict[str, float] | None) -> RoleRow:
        step = measured.step
        figures = {
            "params": measured.parameter_bytes,
            "grads": step["gradient_bytes"],
            "optimizer": step["optimizer_bytes"],
            "activations": 0,
            "total": step["peak_total"],
        }
        # what the peak holds besides them: activations, temporaries, FSDP2's gathered blocks
        figures["activations"] = max(0, figures["total"] - figures["params"] - figures["grads"] - figures["optimizer"])
        return cls(
            role=f"pp rank {role.pp_rank}",
            global_rank=role.rank,
            ranks=role.ranks,
            blocks=measured.blocks,
            sharded=measured.sharded,
            measured=figures,
            predicted=predicted,
            set_up_peak_bytes=measured.set_up_peak_bytes,
            seconds=round(measured.seconds, 2),
        )

    @property
    def miss(self) -> float | None:
        """The planner's total against the measured peak, as a signed fraction (0.05: 5% over)."""
        if self.predicted is None or not self.measured["total"]:
            return None
        return self.predicted["total"] / self.measured["total"] - 1.0


@dataclass(frozen=True)
class DryRun:
    """Every role of one layout; `str()` is the table, `refusal` the line for a role over `limit` bytes."""

    layout: str
    world_size: int
    strategy: str
    rows: list[RoleRow]
    limit: int | None
    planner: str
    untried: tuple[str, ...] = ()  # the strategy's options that would lower a step's peak, not yet set

    @property
    def refusal(self) -> str | None:
        """One line naming the first role that does not fit, its bytes and the limit; None when all fit."""
        if self.limit is None:
            return None
        for row in self.rows:
            step, set_up = row.measured["total"], row.set_up_peak_bytes
            need, when = (set_up, "while materialising its part") if set_up > step else (step, "at its step's peak")
            if need > self.limit:
                return (
                    f"{row.role} (global rank {row.global_rank}, {row.ranks} ranks alike) of {self.layout} needs "
                    f"{human_bytes(need)} ({need} bytes) {when}, over the device memory of {human_bytes(self.limit)} "
                    f"({self.limit} bytes). HINT: {self._remedies(step=set_up <= step)}"
                )
        return None

    def _remedies(self, *, step: bool) -> str:
        """Only what would change the peak: a step's peak falls with activation checkpointing or a smaller batch, a
        set-up peak (parameters alone) with neither; replicas=fsdp where it is not set already."""
        options = ["raise the tensor or pipeline size"]
        options += [f"use {option}" for option in self.untried if step or option.startswith("replicas")]
        if not step:
            return (
                " or ".join(options) + "; a network that does not initialise by name (weights.init_by_name) is "
                "materialised whole before it is sharded"
            )
        return ", ".join(options) + " or use a smaller batch"

    def to_json(self) -> dict[str, Any]:
        rows = [{**asdict(row), "miss": row.miss} for row in self.rows]
        head = {k: v for k, v in asdict(self).items() if k != "rows"}
        return {**head, "fits": self.refusal is None, "rows": rows}

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        os.replace(tmp, path)

    def __str__(self) -> str:
        spans = [f"{row.blocks[0]}..{row.blocks[-1]} ({len(row.blocks)})" if row.blocks else "-" for row in self.rows]
        wide = max([22, *map(len, spans)])  # a traced network's blocks have long names (model.layers.31)
        lines = [
            f"dry run: {self.strategy} {self.layout} on {self.world_size} ranks (fake process group, fake tensors); "
            f"planner: {self.planner}",
            f"{'role':<10} {'ranks':>5} {'blocks':<{wide}} {'sharded':>7} | "
            + " | ".join(f"{k:>21}" for k in KEYS)
            + f" | {'set-up peak':>11} | miss",
        ]
        for row, blocks in zip(self.rows, spans, strict=True):
            cells = []
            for key in KEYS:
                guess = human_bytes(row.predicted[key]) if row.predicted is not None else "-"
                cells.append(f"{human_bytes(row.measured[key]):>10} /{guess:>10}")
            miss = f"{row.miss:+.1%}" if row.miss is not None else "-"
            lines.append(
                f"{row.role:<10} {row.ranks:>5} {blocks:<{wide}} {len(row.sharded):>7} | "
                + " | ".join(cells)
                + f" | {human_bytes(row.set_up_peak_bytes):>11} | {miss}"
            )
        lines.append(
            "each cell: measured / predicted; total = the step's peak of live tensors; set-up peak = the most "
            "parameter bytes held while materialising and sharding"
        )
        if self.limit is not None:
            lines.append(
                f"device memory {human_bytes(self.limit)}: "
                + ("every role fits" if not self.refusal else "does not fit")
            )
        return "\n".join(lines)


def device_limit(value: int | str | None) -> int | None:
    """Bytes a rank may hold: a size (80GB), or a hardware preset's usable memory (h100)."""
    if value is None:
        return None
    if isinstance(value, str) and value in hardware_presets():
        preset = hardware_preset(value)
        return int(preset.memory_bytes * preset.usable_memory)
    return parse_bytes(value)
