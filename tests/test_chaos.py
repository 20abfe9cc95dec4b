"""benchmarks/chaos.py without training: its kill schedule (chaos_killer.py: reproducible, every kind, aimed inside the
run) and its report (chaos_report.py) from canned runs (steps lost summed, losses compared over the last attempt only,
a failed run named)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from chaos_killer import KINDS, Kill, schedule, target_step  # noqa: E402
from chaos_report import compare, table  # noqa: E402


def test_the_schedule_comes_from_the_seed_and_holds_every_kind_with_a_training_kill_first() -> None:
    assert schedule(0, "tensor", 3) == schedule(0, "tensor", 3)
    assert schedule(0, "tensor", 5) != schedule(1, "tensor", 5)
    for seed in range(30):
        kills = schedule(seed, "pipeline", 3)
        assert sorted(k.kind for k in kills) == sorted(KINDS)
        assert kills[0].kind != "setup"  # a setup kill needs a restarted attempt to hit
        assert all(k.rank in (0, 1) and 0 <= k.fraction < 1 for k in kills)


@pytest.mark.parametrize("resumed", [0, 5, 30, 35, 38])
def test_a_kill_lands_after_the_resumed_step_and_before_the_end_a_save_kill_on_a_checkpoint_step(resumed: int) -> None:
    steps, every = 40, 5
    for fraction in (0.0, 0.3, 0.99):
        step = target_step(Kill("step", 0, fraction), resumed, steps, every)
        assert resumed < step < steps
        save = target_step(Kill("save", 0, fraction), resumed, steps, every)
        assert save % every == 0 and save < steps
        if resumed < (steps - 1) // every * every:  # a checkpoint step is left after the resumed one
            assert save > resumed


def run(losses: list[float], weight: float, resumes: list[tuple[int, int]], wall_s: float) -> dict:
    summary = {"steps": 6, "metrics": {"train/loss": {"history": losses}}}
    summary["resumes"] = [{"from_step": f, "steps_lost": lost, "wall_time_lost_s": 2.0} for f, lost in resumes]
    kills = [{"rank": 1, "kind": "step", "after_step": 3, "attempt_s": 9.0, "saving": False}] * len(resumes)
    return {"summary": summary, "weights": {"w": torch.tensor([weight])}, "kills": kills, "planned": 3,
            "restarts": len(resumes), "wall_s": wall_s, "other_cores": 0.1}  # fmt: skip


def test_the_report_sums_the_resumes_and_compares_the_last_attempts_losses_with_the_same_steps() -> None:
    straight = run([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], 1.0, [], 10.0)
    chaos = run([3.0, 2.0, 1.5], 1.25, [(2, 1), (3, 2)], 40.0)  # the last attempt trained steps 4-6
    row = compare(straight, chaos, steps=6)
    assert row["completed"] and row["steps_lost"] == 3 and row["resumes"] == [(2, 1), (3, 2)]
    assert row["wall_lost_s"] == 30.0 and row["wall_lost_recorded_s"] == 4.0
    assert row["final_loss"] == (1.0, 1.5) and row["loss_max_diff"] == 0.5 and row["weights_max_diff"] == 0.25
    assert row["kills"] == 2 and row["planned"] == 3
    report = {"machine": "m", "date": "d", "seed": 0, "size": {"steps": 6, "every": 2, "model": []}}
    text = table(report | {"strategies": {"tensor": {"row": row, "chaos": chaos}}})
    assert "| tensor | yes | r1 step@3, r1 step@3 (2 of 3 fired) | 2 | 2 (1), 3 (2) | 3 |" in text


def test_a_run_that_did_not_finish_is_a_row_saying_why() -> None:
    straight = run([2.0, 1.0], 1.0, [], 10.0)
    failed = {"kills": [], "planned": 3, "restarts": 4, "error": "Gloo connectFullMesh failed", "wall_s": 99.0}
    row = compare(straight, failed, steps=6)
    assert not row["completed"] and row["error"] == "Gloo connectFullMesh failed"
