"""The first part of `make gpu-check` (gpu_check.py): `pytest -m gpu` over the test files that mark GPU tests, read
back from pytest's JUnit XML as counts and each failure's one line. It runs no GPU work of its own."""

from __future__ import annotations

import re
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from harness import ROOT, run


def pytest_part(timeout: float) -> dict[str, Any]:
    """`pytest -m gpu` over the test files that mark GPU tests: counts, and each failure's one line."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"]
        started = time.perf_counter()
        code, output = run([*command, *files], timeout=timeout, env={"PYTHONUNBUFFERED": "1"})
        outcome = read_junit(junit) if junit.exists() else {"failures": []}
    deselected = re.search(r"(\d+) deselected", output)
    last = [line for line in output.splitlines() if line.strip()][-1:] or [""]
    return {
        "command": f"pytest -m gpu {' '.join(files)}",
        "exit_code": code,
        "seconds": time.perf_counter() - started,
        "deselected": int(deselected.group(1)) if deselected else 0,
        "last_line": last[0].strip(),
        **outcome,
    }


def read_junit(path: Path) -> dict[str, Any]:
    """Passed / failed / errors / skipped counts from pytest's JUnit XML, and each failure's test and first line."""
    kinds = {"failure": "failed", "error": "errors", "skipped": "skipped"}
    counts: dict[str, Any] = dict.fromkeys(("passed", *kinds.values()), 0)
    counts["failures"] = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        found = next((child for child in case if child.tag in kinds), None)
        kind = kinds[found.tag] if found is not None else "passed"
        counts[kind] += 1
        if found is not None and kind != "skipped":
            line = ((found.get("message") or found.text or "").strip().splitlines() or [""])[0]
            counts["failures"].append({"test": f"{case.get('classname')}::{case.get('name')}", "line": line})
    return counts
