"""Sweep reports: a real `train.py -m` sweep turned into report.md and plots; hand-written summaries; bad input."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from lightning_parallel.insight.sweep_report import COLUMNS, format_bytes, load_jobs, main, write_report


def table(report: Path) -> dict[str, dict[str, str]]:
    """The report's (first) table as {job: {column: cell}}."""
    text = report.read_text()
    first = text[text.index("\n| ") :].split("\n\n")[0]
    rows = [line for line in first.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in rows[0].strip("|").split(" | ")]
    assert header == COLUMNS
    cells = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]
    return {row[0]: dict(zip(header, row, strict=True)) for row in cells}


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", header[16:24])


@pytest.mark.slow
def test_report_of_a_real_sweep(
    single_and_ddp_sweep: tuple[Any, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result, ran_in = single_and_ddp_sweep  # the sweep test_cli checks the job directories of
    assert result.returncode == 0, result.stderr[-3000:]
    [sweep] = (ran_in / "multirun").glob("*/*")
    assert main([str(sweep), "--out", str(tmp_path / "report")]) == 0
    assert "| 1 | strategy=ddp | DDPStrategy | 2 |" in capsys.readouterr().out
    report = tmp_path / "report" / "report.md"
    rows = table(report)
    assert list(rows) == ["0", "1"]
    single, ddp = rows["0"], rows["1"]
    assert (single["overrides"], single["strategy"], single["devices"]) == (
        "strategy=single",
        "SingleDeviceStrategy",
        "1",
    )
    assert (ddp["overrides"], ddp["strategy"], ddp["devices"]) == ("strategy=ddp", "DDPStrategy", "2")
    summaries = {job.name: job.summary for job in load_jobs(sweep)}
    assert summaries["1"]["parallel"] == {"kind": "ddp", "workers": 2, "collectives": True}  # type: ignore[index]
    for name, row in rows.items():
        summary: dict[str, Any] = summaries[name]  # type: ignore[assignment]
        assert row["final train/loss"] == f"{summary['metrics']['train/loss']['final']:.4g}"
        assert row["headline (final / best)"].startswith("val/acc ")
        assert float(row["samples/s"]) > 0 and row["step time"].endswith(" ms")
        assert row["peak memory / device: max (per rank)"].startswith(format_bytes(max(summary["peak_memory_bytes"])))
        assert row["bubble"] == "-"
    # max, then rank 0 and rank 1 (units vary with the measured size)
    assert re.fullmatch(
        r"[\d.]+ [KMG]iB \([\d.]+ [KMG]iB, [\d.]+ [KMG]iB\)", ddp["peak memory / device: max (per rank)"]
    )
    assert "Shared overrides: `" in report.read_text() and "trainer.devices=2" in report.read_text()
    for plot in ("throughput.png", "memory.png"):
        path = tmp_path / "report" / plot
        assert path.stat().st_size > 15_000 and min(png_size(path)) > 300
    assert not (sweep / "report.md").exists()  # --out was honoured


def summary(strategy: str, devices: int, *, metric: str, value: float, bytes_: int, **extra: Any) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "devices": devices,
        "world_size": devices,
        "metrics": {
            "train/loss": {"final": 0.5, "best": 0.4, "history": [0.6, 0.5]},
            metric: {"final": value, "best": value * 0.9, "history": [value]},
        },
        "throughput_samples_per_s": 1000.0 * devices,
        "step_time_s": 0.012,
        "step_time_s_per_rank": [0.012] * devices,
        "peak_memory_bytes": [bytes_ + rank * 2**20 for rank in range(devices)],
        "parameter_bytes_per_rank": [4096] * devices,
        **extra,
    }


def write_job(root: Path, name: str, overrides: list[str], content: dict[str, Any] | None) -> None:
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if content is not None:
        (job / "summary.json").write_text(json.dumps(content))


def test_report_from_hand_written_summaries(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    pipeline = {"schedule": "1f1b", "microbatches": 4, "bubble_fraction": 0.2, "pipeline_size": 2}
    write_job(
        sweep,
        "0",
        ["model=transformer", "strategy=single"],
        summary("SingleDeviceStrategy", 1, metric="val/ppl", value=12.0, bytes_=2**30),
    )
    write_job(
        sweep,
        "1",
        ["model=transformer", "strategy=pipeline"],
        summary("PipelineParallelStrategy", 2, metric="val/ppl", value=11.0, bytes_=2**29, parallel=pipeline),
    )
    write_job(sweep, "2", ["model=transformer", "strategy=tensor"], None)  # crashed before writing its summary
    write_job(
        sweep,
        "10",
        ["model=transformer", "strategy=ddp"],
        summary("DDPStrategy", 2, metric="val/loss", value=2.5, bytes_=2**20),
    )
    report = write_report(sweep)
    assert report == sweep / "report.md"
    rows = table(report)
    assert list(rows) == ["0", "1", "2", "10"]  # job order, not string order
    assert rows["0"]["overrides"] == "strategy=single"  # overrides shared by every job are shown once, above
    assert rows["0"]["headline (final / best)"] == "val/ppl 12 / 10.8"
    assert rows["10"]["headline (final / best)"] == "val/loss 2.5 / 2.25"
    assert rows["1"]["bubble"] == "20.0% (1f1b, 4 mb)"
    assert rows["1"]["peak memory / device: max (per rank)"] == "513.0 MiB (512.0 MiB, 513.0 MiB)"
    assert rows["1"]["parameters / device: max (per rank)"] == "4.0 KiB (4.0 KiB, 4.0 KiB)"
    assert rows["1"]["samples/s"] == "2000" and rows["1"]["step time"] == "12 ms"
    assert rows["2"]["strategy"] == "**failed** (no summary.json)"
    assert set(list(rows["2"].values())[3:]) == {"-"}
    text = report.read_text()
    assert "4 jobs, 3 finished, **1 failed** (no summary.json): 2." in text
    assert "Shared overrides: `model=transformer`" in text
    assert (sweep / "throughput.png").stat().st_size > 10_000 and (sweep / "memory.png").stat().st_size > 10_000


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (None, 512, 1536, 3 * 2**30)] == ["-", "512 B", "1.5 KiB", "3.0 GiB"]


@pytest.mark.parametrize("case", ["missing", "empty", "only failed jobs", "broken json"])
def test_bad_sweep_directory_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    sweep = tmp_path / "sweep"
    expected = {
        "missing": "is not a directory",
        "empty": "no summary.json under",
        "only failed jobs": "(2 job directories, none finished)",
        "broken json": "is not valid JSON",
    }[case]
    if case != "missing":
        sweep.mkdir()
    if case == "only failed jobs":
        write_job(sweep, "0", ["strategy=ddp"], None)
        write_job(sweep, "1", ["strategy=tensor"], None)
    if case == "broken json":
        write_job(sweep, "0", ["strategy=ddp"], None)
        (sweep / "0" / "summary.json").write_text("{not json")
    assert main([str(sweep)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ") and expected in captured.err
    assert "HINT" in captured.err and not captured.out
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.rglob("report.md"))


def test_a_sweep_over_how_replicas_agree_gets_the_trade_off(tmp_path: Path) -> None:
    """ddp vs local SGD vs async SGD: bytes per worker per step from `sync_methods`, waiting, staleness, and a
    sentence naming the job that exchanged least and the one that reached the best headline."""
    sweep = tmp_path / "sweep"
    size = {"parameters": 1000}
    staleness = [{"rank": 0, "pushes": 9, "dropped": 0, "mean": 0.5, "max": 2}]
    runs = {
        "ddp": {"kind": "ddp", "workers": 2},
        "local_sgd": {"kind": "local_sgd", "workers": 2, "period": 4, "warmup_steps": 0},
        "async_sgd": {"kind": "async_sgd", "workers": 2, "max_staleness": None, "staleness": staleness},
    }
    for i, (name, parallel) in enumerate(runs.items()):
        accuracy = {"ddp": 0.97, "local_sgd": 0.96, "async_sgd": 0.98}[name]
        content = summary("X", 2, metric="val/acc", value=accuracy, bytes_=2**20, parallel=parallel, **size)
        write_job(sweep, str(i), [f"strategy={name}"], content)
    text = write_report(sweep).read_text()
    section = text[text.index("## How the replicas agree") :]
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in section.splitlines() if line.startswith("| ")
    }
    # a ring all-reduce of 4000 bytes between 2 workers: 2 x 2 x 1/2 x 4000 = 8000 bytes; local SGD every 4th step
    assert rows["0: strategy=ddp"][1:5] == ["ddp", "0.008 MB", "yes", "val/acc 0.97"]
    assert rows["1: strategy=local_sgd"][1:5] == ["local_sgd (period 4)", "0.002 MB", "yes", "val/acc 0.96"]
    assert rows["2: strategy=async_sgd"][1:5] == ["async_sgd", "0.008 MB", "no", "val/acc 0.98"]
    assert rows["2: strategy=async_sgd"][6].startswith("r0 0.50 / 2")
    assert "`1: strategy=local_sgd` exchanged the fewest bytes per step (4x fewer than `0: strategy=ddp`)" in section
    assert "`2: strategy=async_sgd` reached the best val/acc (0.98)" in section
    assert table(sweep / "report.md").keys() == {"0", "1", "2"}  # the main table is unchanged


def test_no_trade_off_section_for_one_method(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for i in range(2):
        parallel = {"kind": "ddp", "workers": 2}
        write_job(
            sweep, str(i), [f"seed={i}"], summary("X", 2, metric="val/acc", value=0.9, bytes_=1, parallel=parallel)
        )
    assert "How the replicas agree" not in write_report(sweep).read_text()
