"""The micro-batch plan of a batch, the record of what ran, its one warning per batch size, and the
end-of-run caption built from it: pure, no processes (the 2-process run is in test_pipeline_features.py)."""

from __future__ import annotations

import pytest

from lightning_parallel.callbacks.run_summary import IDLE_NOTE, bubble_caption, print_rank_table
from lightning_parallel.pipeline.microbatches import PlansUsed, PlanUsed, fallback_warning, plan_microbatches

PLANS = [
    # schedule, pp, stages per rank, requested, batch -> what runs
    ("1f1b", 2, 1, 4, 8, ("1f1b", 4)),
    ("1f1b", 2, 1, 4, 6, ("1f1b", 3)),  # fewer, same schedule
    ("1f1b", 2, 1, 4, 2, ("1f1b", 2)),
    ("1f1b", 2, 1, 4, 7, ("gpipe", 1)),  # 1f1b needs >= pp micro-batches
    ("1f1b", 4, 1, 8, 2, ("gpipe", 2)),
    ("dualpipev", 2, 2, 4, 7, ("zbv", 1)),  # dualpipev needs >= 2 x pp
    ("dualpipev", 2, 2, 8, 10, ("dualpipev", 5)),
]


@pytest.mark.parametrize(("schedule", "pp", "per_rank", "requested", "batch", "expected"), PLANS)
def test_plan_takes_the_largest_count_that_divides_the_batch(
    schedule: str, pp: int, per_rank: int, requested: int, batch: int, expected: tuple[str, int]
) -> None:
    got = plan_microbatches(batch, schedule=schedule, requested=requested, pp=pp, stages_per_rank=per_rank)
    assert got == expected


def test_fallback_warning_names_batch_requested_used_and_a_fix() -> None:
    assert fallback_warning(PlanUsed(True, 8, "1f1b", 4), schedule="1f1b", requested=4) is None
    other = fallback_warning(PlanUsed(True, 7, "gpipe", 1), schedule="1f1b", requested=4)
    assert other == (
        "pipeline: batches of 7 run gpipe with 1 micro-batch instead of 1f1b with 4 (7 rows do not split into 4 "
        "equal micro-batches). HINT: a batch size divisible by microbatches=4 (e.g. 8), or drop a short last batch"
    )
    fewer = fallback_warning(PlanUsed(False, 6, "1f1b", 3), schedule="1f1b", requested=4)
    assert fewer is not None and "batches of 6 run 1f1b with 3 micro-batches instead of 4 (" in fewer
    assert "\n" not in fewer


def test_record_counts_per_mode_and_batch_size_and_warns_once_per_size() -> None:
    heard: list[str] = []
    used = PlansUsed(schedule="1f1b", requested=4, warn=heard.append)
    for _ in range(3):
        used.record(True, 8, "1f1b", 4).batches += 1  # as requested: silent
    for _ in range(2):
        used.record(True, 7, "gpipe", 1).batches += 1
    used.record(False, 7, "gpipe", 1).batches += 1  # same size in evaluation: no second warning
    used.record(False, 2, "1f1b", 2).batches += 1
    assert [line.split(" run ")[0] for line in heard] == ["pipeline: batches of 7", "pipeline: batches of 2"]
    assert {key: (p.schedule, p.microbatches, p.batches) for key, p in used.plans.items()} == {
        (True, 8): ("1f1b", 4, 3),
        (True, 7): ("gpipe", 1, 2),
        (False, 7): ("gpipe", 1, 1),
        (False, 2): ("1f1b", 2, 1),
    }


def test_caption_reports_what_ran_per_batch_size() -> None:
    requested = {"schedule": "1f1b", "microbatches": 4, "bubble_fraction": 0.2}
    one = {"schedule": "1f1b", "microbatches": 4, "bubble_fraction": 0.2, "requested": requested}
    one["ran"] = [{"mode": "train", "batch_size": 8, **requested}, {"mode": "eval", "batch_size": 3}]
    assert bubble_caption(one) == "analytic bubble of 1f1b x4: 20%"
    fell_back = {"schedule": "gpipe", "microbatches": 1, "bubble_fraction": 0.5, "requested": requested}
    fell_back["ran"] = [
        {"mode": "train", "batch_size": 7, "schedule": "gpipe", "microbatches": 1, "bubble_fraction": 0.5},
        {"mode": "train", "batch_size": 2, "schedule": "1f1b", "microbatches": 2, "bubble_fraction": 1 / 3},
    ]
    assert bubble_caption(fell_back) == (
        "analytic bubble of gpipe x1 (batch 7): 50%, 1f1b x2 (batch 2): 33%, requested 1f1b x4"
    )
    assert bubble_caption({"requested": requested, "ran": []}) is None  # nothing ran: no bubble claimed


def test_rank_table_says_what_idle_counts(capsys: pytest.CaptureFixture[str]) -> None:
    memory = (
        "peak_memory_bytes",
        "parameter_bytes_per_rank",
        "gradient_bytes_per_rank",
        "optimizer_state_bytes_per_rank",
    )
    summary = {**{key: [1024, 1024] for key in memory}, "step_time_s_per_rank": [0.02, 0.02]}
    print_rank_table({**summary, "per_rank": [{"idle_fraction": 0.9}, {"idle_fraction": 0.5}]}, {})
    printed = " ".join(capsys.readouterr().err.split())  # the caption wraps at the table's width
    assert "90%" in printed and IDLE_NOTE in printed
    print_rank_table(summary, {})  # no pipeline: no idle column values, no note
    assert "idle:" not in capsys.readouterr().err
