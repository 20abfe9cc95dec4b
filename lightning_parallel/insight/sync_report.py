"""The sweep report's section for a sweep over how replicas agree (ddp, local_sgd, diloco, async_sgd): bytes each
worker exchanges per step, whether it waits for the slowest, and the metric each reached, with the trade-off in a
sentence drawn from those numbers. Reads summary.json's `parallel` (each strategy's `describe()`); draws nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_parallel.sync_methods import MEASURED, SYNC_METHODS

COLUMNS = ["job", "method", "bytes / worker / step", "waits for the slowest", "headline (final)", "step time",
           "async staleness mean / max"]  # fmt: skip


def _method(summary: dict[str, Any]) -> str | None:
    kind = (summary.get("parallel") or {}).get("kind")
    return kind if kind in SYNC_METHODS else None


def _bytes(summary: dict[str, Any]) -> float | None:
    parallel, workers, parameters = summary["parallel"], summary.get("world_size"), summary.get("parameters")
    if not workers or not parameters:
        return None
    return SYNC_METHODS[parallel["kind"]].bytes_per_step(parameters, workers, period=parallel.get("period", 1))


def _staleness(summary: dict[str, Any]) -> str:
    seen = summary["parallel"].get("staleness")
    if not seen:
        return "-"
    return ", ".join(f"r{s['rank']} {s.get('mean', 0):.2f} / {s.get('max', 0)}" for s in seen)


def sync_section(
    runs: Sequence[tuple[str, dict[str, Any]]], headline: Callable[[dict[str, Any]], str | None]
) -> list[str]:
    """Markdown lines for the finished ``(job, summary)`` runs that used a method of `SYNC_METHODS`, or none when
    fewer than two methods ran (nothing to compare). ``headline`` names a summary's headline metric."""
    ran = [(job, s) for job, s in runs if _method(s) is not None]
    if len({_method(s) for _, s in ran}) < 2:
        return []
    lines = [
        "## How the replicas agree",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    finals: dict[str, tuple[float, str]] = {}
    for job, s in ran:
        method = SYNC_METHODS[s["parallel"]["kind"]]
        period = s["parallel"].get("period")
        sent = _bytes(s)
        name = headline(s)
        final = s["metrics"][name]["final"] if name else None
        if name and final is not None:
            finals[job] = (final, name)
        step = s.get("step_time_s")
        cells = [
            job,
            method.name + (f" (period {period})" if period else ""),
            "-" if sent is None else f"{sent / 1e6:.3g} MB",
            "yes" if method.waits_for_slowest else "no",
            "-" if final is None else f"{name} {final:.4g}",
            "-" if step is None else f"{step * 1e3:.3g} ms",
            _staleness(s),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", _tradeoff(ran, finals), ""]
    return lines


def _tradeoff(ran: list[tuple[str, dict[str, Any]]], finals: dict[str, tuple[float, str]]) -> str:
    sent = {job: b for job, s in ran if (b := _bytes(s)) is not None}
    parts = []
    if sent:
        least, most = min(sent, key=sent.__getitem__), max(sent, key=sent.__getitem__)
        ratio = sent[most] / sent[least] if sent[least] else float("inf")
        parts.append(f"`{least}` exchanged the fewest bytes per step ({ratio:.3g}x fewer than `{most}`)")
    if finals:
        name = next(iter(finals.values()))[1]
        lower_is_better = name.endswith("loss") or name.endswith("ppl")
        pick = min if lower_is_better else max
        best = pick(finals, key=lambda job: finals[job][0])
        parts.append(f"`{best}` reached the best {name} ({finals[best][0]:.4g})")
    said = "; ".join(parts) or "no run recorded its size or a metric"
    return (
        f"{said}. Fewer bytes or no waiting can cost steps to a target: compare the headline at equal steps and "
        f"wall time (the methods measured side by side with a straggler: {MEASURED})."
    )
