"""Draw a pipeline schedule as a timeline image: one row per pipeline rank, one box per compute action.

Takes a simulated `Timeline` (from `schedule_plan`) or measured per-rank events of the same shape; writes
PNG or SVG with matplotlib, and its command line. The panels it draws are `schedule_panels.py`'s (their names are
imported from here too). It measures and simulates nothing itself and launches no processes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_parallel.insight.schedule_panels import (
    COLORS,
    KIND_NAMES,
    Event,
    Panel,
    display_name,
    measured_panels,
    panel_from_events,
    panel_from_timeline,
    simulated_panel,
)
from lightning_parallel.pipeline.schedule_plan import SCHEDULES, resolve_schedule

__all__ = [  # the panels' names too, imported from here by callers
    "COLORS", "KIND_NAMES", "SUFFIXES", "Event", "Panel", "display_name", "draw", "main", "measured_panels",
    "panel_from_events", "panel_from_timeline", "simulated_panel",
]  # fmt: skip

IDLE_COLOR = "#eeeeee"
SUFFIXES = (".png", ".svg")
_ROW_INCHES = 0.42  # height of one rank's row
_PANEL_EXTRA_INCHES = 0.95  # title, axis labels and ticks of one panel


def draw(panels: Panel | Sequence[Panel], out: str | Path) -> Path:
    """Draw the panels one above the other into `out` (PNG or SVG by suffix) and return its path.

    Panels with the same time unit share the time axis, so two schedules compare at a glance.

    Raises:
        ValueError: an unsupported suffix or no panels.
    """
    panels = [panels] if isinstance(panels, Panel) else list(panels)
    out = Path(out)
    if out.suffix.lower() not in SUFFIXES:
        raise ValueError(f"cannot write {out.name!r}: unknown image type. HINT: end the file name in .png or .svg")
    if not panels:
        raise ValueError("nothing to draw: got 0 panels. HINT: pass at least one Panel")
    from matplotlib.figure import Figure  # lazily: importing this module stays cheap

    rows = [len(p.events) for p in panels]
    longest = max(max((len(rank) for rank in p.events), default=0) for p in panels)
    width = min(40.0, max(8.0, 2.0 + 0.42 * longest))
    height = sum(_ROW_INCHES * r + _PANEL_EXTRA_INCHES for r in rows) + 0.5  # + the legend
    # a bare Figure renders with Agg (PNG) or the SVG backend by suffix and leaves pyplot's global state alone
    fig = Figure(figsize=(width, height))
    share = len({p.time_unit for p in panels}) == 1
    axes = fig.subplots(len(panels), 1, sharex=share, squeeze=False, gridspec_kw={"height_ratios": rows})
    for i, (ax, panel) in enumerate(zip(axes[:, 0], panels, strict=True)):
        _draw_panel(ax, panel, width)
        if not share or i == len(panels) - 1:
            ax.set_xlabel(f"time ({panel.time_unit});  right: idle share and most micro-batches in flight", fontsize=8)
    kinds = sorted({e[2] for p in panels for rank in p.events for e in rank}, key=list(COLORS).index)
    _legend(fig, kinds)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _draw_panel(ax: Any, panel: Panel, width_inches: float) -> None:
    makespan = panel.makespan or 1.0
    several = _stages_by_rank(panel)
    for rank, rank_events in enumerate(panel.events):
        y = rank  # rank 0 on top: the y axis is inverted below
        ax.barh(y, makespan, left=0, height=0.8, color=IDLE_COLOR, hatch="///", edgecolor="#cccccc", linewidth=0)
        busy = 0.0
        for start, end, kind, stage, microbatch in rank_events:
            chunk = several[rank].index(stage) if len(several[rank]) > 1 else 0
            ax.barh(
                y, end - start, left=start, height=0.8, color=_shade(COLORS[kind], chunk), edgecolor="white", lw=0.8
            )
            label = f"{microbatch}" if len(several[rank]) == 1 else f"{microbatch}\ns{stage}"
            box_inches = (end - start) / makespan * (width_inches - 1.8)
            if box_inches >= 0.11 * max(len(part) for part in label.split("\n")):  # only labels that fit
                size = 7 if "\n" not in label else 6
                ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=size, color="white")
            busy += end - start
        note = f"idle {1 - busy / makespan:.0%}\n{panel.in_flight(rank)} in flight"
        ax.text(makespan * 1.005, y, note, va="center", fontsize=6.5, color="#555555", linespacing=1.1)
    ax.set_yticks(range(len(panel.events)), [f"rank {r}" for r in range(len(panel.events))], fontsize=8)
    ax.set_ylim(len(panel.events) - 0.5, -0.5)
    ax.set_xlim(0, makespan * 1.08)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(panel.title, fontsize=9, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _stages_by_rank(panel: Panel) -> list[list[int]]:
    # a rank's stages in order of first use, so its first stage gets the full colour and later ones lighter
    result: list[list[int]] = []
    for rank_events in panel.events:
        seen: list[int] = []
        for e in rank_events:
            if e[3] not in seen:
                seen.append(e[3])
        result.append(seen)
    return result


def _shade(color: str, chunk: int) -> tuple[float, float, float]:
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = min(0.5, 0.3 * chunk)  # later stages on the same rank: mixed towards white
    return (rgb[0] + (1 - rgb[0]) * mix, rgb[1] + (1 - rgb[1]) * mix, rgb[2] + (1 - rgb[2]) * mix)


def _legend(fig: Any, kinds: list[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS[k], label=f"{k} {KIND_NAMES[k]}") for k in kinds]
    handles.append(Patch(facecolor=IDLE_COLOR, hatch="///", edgecolor="#cccccc", label="idle"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> Any:
        print(
            f"error: {message}. HINT: python -m {__spec__.name if __spec__ else 'schedule_picture'} --help",
            file=sys.stderr,
        )
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        description="Draw pipeline schedules as timelines, simulated under unit costs (no processes are started).",
        epilog="Example: --schedule gpipe,1f1b --stages 4 --microbatches 8 --out docs/images/schedule.png",
    )
    parser.add_argument("--schedule", help=f"one or more of {','.join(SCHEDULES)}, comma-separated")
    parser.add_argument("--stages", type=int, help="pipeline ranks (devices), one row each")
    parser.add_argument("--microbatches", type=int, help="micro-batches per step")
    parser.add_argument(
        "--from-summary",
        help="a pipeline run's summary.json: draw its last training step as measured on each rank, "
        "above the same schedule simulated (the other options are then taken from the run)",
    )
    parser.add_argument(
        "--stages-per-rank", type=int, default=None, help="stages per rank for the multi-stage schedules (default 2)"
    )
    parser.add_argument("--out", required=True, help="output image: .png or .svg")
    return parser


def _panels_for(names: list[str], *, pp: int, microbatches: int, stages_per_rank: int | None) -> list[Panel]:
    panels = []
    for name in names:
        per_rank = stages_per_rank
        if per_rank is not None and len(names) > 1:
            # in a comparison, --stages-per-rank is for the multi-stage schedules; one-stage ones ignore it
            if resolve_schedule(name, pp=pp, microbatches=microbatches).stages_per_rank == 1:
                per_rank = None
        panels.append(simulated_panel(name, pp=pp, microbatches=microbatches, stages_per_rank=per_rank))
    return panels


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: draw one schedule, or several stacked for comparison; bad input exits 2 with one line."""
    args = _parser().parse_args(argv)
    names = [n.strip() for n in (args.schedule or "").split(",") if n.strip()]
    try:
        if args.from_summary:
            panels = measured_panels(args.from_summary)
            out = draw(panels, args.out)
            for panel in panels:
                print(panel.title)
            print(f"wrote {out}")
            return 0
        if args.stages is None or args.microbatches is None:
            raise ValueError("--stages and --microbatches are required. HINT: e.g. --stages 4 --microbatches 8")
        if not names:
            raise ValueError(f"--schedule {args.schedule!r} names no schedule. HINT: e.g. --schedule gpipe,1f1b")
        panels = _panels_for(
            names, pp=args.stages, microbatches=args.microbatches, stages_per_rank=args.stages_per_rank
        )
        out = draw(panels, args.out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for panel in panels:
        print(panel.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
