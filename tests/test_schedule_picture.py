"""Schedule pictures: every schedule renders to PNG and SVG, measured events draw the same way, bad input exits 2."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from lightning_parallel.insight.schedule_picture import (
    Panel,
    draw,
    main,
    panel_from_events,
    panel_from_timeline,
    simulated_panel,
)
from lightning_parallel.pipeline.schedule_plan import (
    SCHEDULES,
    analytic_bubble,
    rank_actions,
    resolve_schedule,
    simulate,
)

ROOT = Path(__file__).resolve().parents[1]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header's IHDR chunk."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", header[16:24])


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_renders_png_and_svg(tmp_path: Path, schedule: str, pp: int) -> None:
    microbatches = 2 * pp  # valid for every schedule: >= pp, >= 2 * pp for dualpipev, a multiple of the rounds
    panel = simulated_panel(schedule, pp=pp, microbatches=microbatches)
    assert len(panel.events) == pp
    assert panel.bubble_fraction == pytest.approx(analytic_bubble(schedule, pp=pp, microbatches=microbatches))
    assert f"{microbatches} micro-batches" in panel.title and f"on {pp} ranks" in panel.title
    png, svg = draw(panel, tmp_path / "s.png"), draw(panel, tmp_path / "s.svg")
    assert png.stat().st_size > 10_000
    assert svg.stat().st_size > 20_000 and "<svg" in svg.read_text()[:1000]


def test_png_height_grows_with_rows_and_panels(tmp_path: Path) -> None:
    two = png_size(draw(simulated_panel("gpipe", pp=2, microbatches=4), tmp_path / "two.png"))
    four = png_size(draw(simulated_panel("gpipe", pp=4, microbatches=4), tmp_path / "four.png"))
    pair = [simulated_panel(name, pp=4, microbatches=4) for name in ("gpipe", "1f1b")]
    stacked = png_size(draw(pair, tmp_path / "stacked.png"))
    assert four[1] > two[1] and stacked[1] > four[1] + 0.8 * (four[1] - two[1])
    assert stacked[0] == four[0]  # same events per rank, same width


def test_labels_name_the_stage_when_ranks_hold_several(tmp_path: Path) -> None:
    out = draw(simulated_panel("interleaved_1f1b", pp=2, microbatches=4, stages_per_rank=3), tmp_path / "i.svg")
    text = out.read_text()
    assert "12 stages" not in text and "6 stages on 2 ranks" in text
    one_stage = draw(simulated_panel("1f1b", pp=2, microbatches=4), tmp_path / "o.svg").read_text()
    assert "s1" not in one_stage.replace("class=", "")  # no stage tags when each rank holds one stage


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_pp() -> None:
    gpipe, one_f = (simulated_panel(name, pp=4, microbatches=8) for name in ("gpipe", "1f1b"))
    assert [gpipe.in_flight(r) for r in range(4)] == [8, 8, 8, 8]
    assert [one_f.in_flight(r) for r in range(4)] == [4, 3, 2, 1]


def test_timeline_and_measured_events_draw_the_same_way(tmp_path: Path) -> None:
    spec = resolve_schedule("1f1b", pp=2, microbatches=4)
    timeline = simulate(rank_actions(spec, pp=2, microbatches=4), pp=2, num_stages=2, stage_to_rank=[0, 1])
    simulated = panel_from_timeline(timeline, heading="1F1B")
    assert simulated.bubble_fraction == pytest.approx(timeline.bubble_fraction)
    # as a run would measure it: wall-clock seconds, 0.01 s per unit, starting at an arbitrary clock reading
    clock = 1_700_000_000.0
    measured = [
        [(clock + 0.01 * s, clock + 0.01 * e, a.kind, a.stage, a.microbatch) for s, e, a in timeline.events[r]]
        for r in range(2)
    ]
    panel = panel_from_events(measured, heading="measured 1F1B")
    assert panel.events[0][0][0] == 0.0 and panel.makespan == pytest.approx(0.01 * timeline.makespan)
    assert panel.bubble_fraction == pytest.approx(timeline.bubble_fraction, abs=1e-5)  # float clock: ~0.2 us steps
    assert panel.time_unit == "s" and "measured 1F1B: 2 stages on 2 ranks, 4 micro-batches" in panel.title
    out = draw([simulated, panel], tmp_path / "measured.png")
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([], "no events to draw"),
        ([[(0.0, 1.0, "F", 0)]], "has 4 fields, not 5"),
        ([[(0.0, 1.0, "X", 0, 0)]], "has kind 'X'"),
        ([[(2.0, 1.0, "F", 0, 0)]], "start <= end"),
    ],
)
def test_bad_measured_events_fail_with_a_hint(events: list, expected: str) -> None:
    with pytest.raises(ValueError, match=expected) as error:
        panel_from_events(events, heading="bad")
    assert "HINT" in str(error.value) and "\n" not in str(error.value)


def test_cli_draws_a_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp.png"
    argv = ["--schedule", "gpipe,interleaved_1f1b", "--stages", "2", "--microbatches", "4"]
    assert main([*argv, "--stages-per-rank", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "GPipe (gpipe): 2 stages on 2 ranks" in printed and "(interleaved_1f1b): 4 stages on 2 ranks" in printed
    assert png_size(out)[1] > png_size(draw(simulated_panel("gpipe", pp=2, microbatches=4), tmp_path / "one.png"))[1]


BAD_CLI = {
    "unknown schedule": (["--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    "too few micro-batches": (["--schedule", "1f1b", "--microbatches", "2"], "needs microbatches >= pp"),
    "stages per rank on 1f1b": (["--schedule", "1f1b", "--stages-per-rank", "2"], "runs one stage per rank"),
    "bad suffix": (["--schedule", "gpipe", "--out", "x.jpg"], "unknown image type"),
    "no schedule": (["--schedule", ","], "names no schedule"),
    "not a number": (["--schedule", "gpipe", "--stages", "four"], "invalid int value"),
    "no output file": (["--schedule", "gpipe", "--out", None], "the following arguments are required: --out"),
}


@pytest.mark.parametrize("name", BAD_CLI)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    changes, expected = BAD_CLI[name]
    options = {"--stages": "4", "--microbatches": "8", "--out": str(tmp_path / "x.png")}
    for flag, value in zip(changes[::2], changes[1::2], strict=True):
        options[flag] = value
    argv = [part for flag, value in options.items() if value is not None for part in (flag, value)]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    stderr = capsys.readouterr().err.strip()
    assert code == 2 and stderr.count("\n") == 0 and expected in stderr and "HINT" in stderr, stderr
    assert not list(tmp_path.iterdir())


# `python -m lightning_parallel.insight.schedule_picture` without warnings on stderr: test_pipeline_cli draws the
# measured schedule that way (a process of its own here cost ~9 s; the simulated pictures are drawn by `main` above).


def test_a_panel_needs_a_known_image_type(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="HINT: end the file name in .png or .svg"):
        draw(Panel(heading="x", events=[[(0.0, 1.0, "F", 0, 0)]], time_unit="s"), tmp_path / "x.pdf")
