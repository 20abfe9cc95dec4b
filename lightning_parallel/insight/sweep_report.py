"""Turn a `train.py -m` sweep directory into a comparison: `report.md` plus `throughput.png` and `memory.png`.

Reads each job's `summary.json` and `.hydra/overrides.yaml`; jobs without a summary are reported as failed.
It reads and draws only: it runs no training and changes nothing in the sweep's job directories. The job records
it reads are `sweep_jobs.py`'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_parallel.insight.sweep_jobs import Job, load_jobs
from lightning_parallel.insight.sync_report import sync_section

__all__ = [  # `sweep_jobs.py`'s names too, imported from here by callers
    "COLUMNS", "HEADLINE_METRICS", "Job", "format_bytes", "headline_metric", "load_jobs", "main", "markdown_table",
    "plot_memory", "plot_throughput", "table_row", "write_report",
]  # fmt: skip

HEADLINE_METRICS = ("val/acc", "val/ppl", "val/loss")  # the first one a run logged is its headline
COLUMNS = [
    "job",
    "overrides",
    "strategy",
    "devices",
    "final train/loss",
    "headline (final / best)",
    "samples/s",
    "step time",
    "peak memory / device: max (per rank)",
    "parameters / device: max (per rank)",
    "bubble",
]


def format_bytes(n: float | None) -> str:
    """`1536` -> `1.5 KiB`; None -> `-`."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _per_device(values: list[int] | None) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return format_bytes(values[0])
    return f"{format_bytes(max(values))} ({', '.join(format_bytes(v) for v in values)})"


def headline_metric(summary: dict[str, Any]) -> str | None:
    """The validation metric a run is judged by: val/acc, else val/ppl, else val/loss (None if none logged)."""
    return next((name for name in HEADLINE_METRICS if name in summary.get("metrics", {})), None)


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _bubble(summary: dict[str, Any]) -> str:
    parallel = summary.get("parallel") or {}
    if "bubble_fraction" not in parallel:
        return "-"
    return (
        f"{parallel['bubble_fraction']:.1%} ({parallel.get('schedule', '?')}, {parallel.get('microbatches', '?')} mb)"
    )


def table_row(job: Job) -> list[str]:
    """The report's cells for one job, in `COLUMNS` order."""
    label = job.label or "-"
    s = job.summary
    if s is None:
        return [job.name, label, "**failed** (no summary.json)", *["-"] * (len(COLUMNS) - 3)]
    metrics = s.get("metrics", {})
    loss = metrics.get("train/loss", {}).get("final")
    name = headline_metric(s)
    headline = f"{name} {_number(metrics[name]['final'])} / {_number(metrics[name]['best'])}" if name else "-"
    step = s.get("step_time_s")
    return [
        job.name,
        label,
        str(s.get("strategy", "?")),
        str(s.get("devices", "?")),
        _number(loss),
        headline,
        _rate(s.get("throughput_samples_per_s")),
        "-" if step is None else f"{step * 1e3:.3g} ms",
        _per_device(s.get("peak_memory_bytes")),
        _per_device(s.get("parameter_bytes_per_rank")),
        _bubble(s),
    ]


def markdown_table(jobs: Sequence[Job]) -> str:
    """A GitHub markdown table, one row per job (failed jobs included)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in table_row(job)) + " |" for job in jobs]
    return "\n".join(lines)


def _short(job: Job) -> str:
    return f"{job.name}: {job.label}" if job.label else job.name


def _finished(jobs: Sequence[Job], key: str) -> list[tuple[Job, dict[str, Any]]]:
    # the jobs that recorded `key`, each with its summary
    return [(job, job.summary) for job in jobs if job.summary is not None and job.summary.get(key)]


def _strategy_colors(done: list[tuple[Job, dict[str, Any]]]) -> dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return {name: palette(i % 10) for i, name in enumerate(sorted({str(s["strategy"]) for _, s in done}))}


def plot_throughput(jobs: Sequence[Job], out: Path) -> Path:
    """Bars per finished job: samples/s in total and per device, coloured by strategy."""
    from matplotlib.figure import Figure  # lazily: importing this module stays cheap

    done = _finished(jobs, "throughput_samples_per_s")
    colors = _strategy_colors(done)
    fig = Figure(figsize=(max(6.0, 1.4 + 1.1 * len(done)), 6.5))
    total_ax, device_ax = fig.subplots(2, 1, sharex=True)
    x = range(len(done))
    for ax, per_device in ((total_ax, False), (device_ax, True)):
        values = [s["throughput_samples_per_s"] / ((s.get("devices") or 1) if per_device else 1) for _, s in done]
        ax.bar(x, values, color=[colors[s["strategy"]] for _, s in done])
        for i, v in zip(x, values, strict=True):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("samples/s per device" if per_device else "samples/s", fontsize=9)
        ax.spines[["top", "right"]].set_visible(False)
    total_ax.set_title("Training throughput by job", fontsize=10)
    device_ax.set_xticks(list(x), [_short(job) for job, _ in done], rotation=25, ha="right", fontsize=7)
    _strategy_legend(fig, colors)
    return _save(fig, out)


def plot_memory(jobs: Sequence[Job], out: Path) -> Path:
    """Grouped bars per finished job: each rank's peak memory, labelled with the rank's parameter bytes."""
    from matplotlib.figure import Figure

    done = _finished(jobs, "peak_memory_bytes")
    colors = _strategy_colors(done)
    widest = max((len(s["peak_memory_bytes"]) for _, s in done), default=1)
    fig = Figure(figsize=(max(6.0, 1.4 + 0.45 * widest * len(done)), 4.5))
    ax = fig.subplots()
    bar = 0.8 / widest
    for i, (_, s) in enumerate(done):
        peaks = s["peak_memory_bytes"]
        params = s.get("parameter_bytes_per_rank") or [None] * len(peaks)
        for rank, (peak, param) in enumerate(zip(peaks, params, strict=False)):
            left = i - bar * len(peaks) / 2 + bar * rank  # the job's bars centred on its tick
            ax.bar(left, peak / 2**20, width=bar * 0.9, align="edge", color=colors[s["strategy"]])
            note = f"r{rank}" + (f"\n{format_bytes(param)}" if param is not None else "")
            ax.text(left + bar * 0.45, peak / 2**20, note, ha="center", va="bottom", fontsize=6)
    ax.set_ylabel("peak memory per device (MiB)", fontsize=9)
    ax.set_title("Peak memory per device (a bar per rank, labelled with its parameter bytes)", fontsize=10)
    ax.set_xticks(range(len(done)), [_short(job) for job, _ in done], rotation=25, ha="right", fontsize=7)
    ax.margins(y=0.15)
    ax.spines[["top", "right"]].set_visible(False)
    _strategy_legend(fig, colors)
    return _save(fig, out)


def _strategy_legend(fig: Any, colors: dict[str, Any]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=name) for name, c in colors.items()]
    fig.legend(handles=handles, loc="lower center", ncol=max(1, min(4, len(handles))), fontsize=7, frameon=False)


def _save(fig: Any, out: Path) -> Path:
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # the bottom strip holds the strategy legend
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write `report.md`, `throughput.png` and `memory.png` for the sweep into `out_dir` (default: the sweep).

    Returns:
        The path of `report.md`.

    Raises:
        ValueError: no finished job under `sweep_dir` (see `load_jobs`).
    """
    jobs = load_jobs(sweep_dir)
    out = Path(out_dir) if out_dir is not None else Path(sweep_dir)
    plot_throughput(jobs, out / "throughput.png")
    plot_memory(jobs, out / "memory.png")
    failed = [job.name for job in jobs if job.failed]
    shared = sorted(set.intersection(*(set(job.overrides) for job in jobs))) if len(jobs) > 1 else []
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{len(jobs)} jobs, {len(jobs) - len(failed)} finished"
        + (f", **{len(failed)} failed** (no summary.json): {', '.join(failed)}" if failed else "")
        + ".",
        "",
        *([f"Shared overrides: `{' '.join(shared)}`", ""] if shared else []),
        markdown_table(jobs),
        "",
        "Peak memory is the CUDA allocator's peak on GPU and the process peak RSS on CPU; for a dry run "
        "(`dry_run=true`), the step's peak of live tensors per pipeline rank. "
        "Bubble is the schedule's analytic idle fraction (pipeline runs only).",
        "",
        *sync_section([(_short(job), job.summary) for job in jobs if job.summary is not None], headline_metric),
        "![throughput](throughput.png)",
        "",
        "![memory per device](memory.png)",
        "",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `python -m lightning_parallel.insight.sweep_report multirun/<date>/<time> [--out DIR]`."""
    parser = argparse.ArgumentParser(description="Compare the jobs of a train.py -m sweep: report.md and plots.")
    parser.add_argument("sweep_dir", help="a sweep directory, e.g. multirun/<date>/<time>")
    parser.add_argument("--out", default=None, help="where to write report.md and the plots (default: sweep_dir)")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.sweep_dir, args.out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report.read_text().split("\n\n![")[0])
    print(f"\nwrote {report} and its plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
