"""Insight into parallel runs: pipeline schedules drawn as timelines, sweep directories turned into reports.

Names are loaded on first use, so importing the package stays cheap and `python -m` runs its modules cleanly.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_HOME = {
    "Event": "schedule_picture",
    "Panel": "schedule_picture",
    "draw": "schedule_picture",
    "panel_from_events": "schedule_picture",
    "panel_from_timeline": "schedule_picture",
    "simulated_panel": "schedule_picture",
    "Job": "sweep_report",
    "load_jobs": "sweep_report",
    "write_report": "sweep_report",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    # importing the modules here eagerly would make `python -m lightning_parallel.insight.<module>` warn
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
