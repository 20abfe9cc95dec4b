"""After launch, a failed run prints one line per rank (once for an error every rank raises), names the first
error rather than one raised while cleaning up after it, and keeps the whole traceback in the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_parallel.strategies.user_step import StepRefused, _loss_of
from train import report_failure


def raised(make: type[BaseException], message: str) -> BaseException:
    try:
        raise make(message)
    except BaseException as error:  # noqa: BLE001 - the test wants the raised object with its traceback
        return error


@pytest.fixture
def rank(monkeypatch: pytest.MonkeyPatch):
    def set_rank(value: int) -> None:
        monkeypatch.setattr(rank_zero_only, "rank", value)

    return set_rank


def test_a_rank_prints_its_own_error_in_one_line_and_keeps_the_traceback(tmp_path: Path, rank) -> None:
    rank(1)
    line = report_failure(raised(KeyError, "'label'"), str(tmp_path))
    assert line == f"rank 1 failed: KeyError: \"'label'\" (traceback: {tmp_path}/rank1.log)"
    assert "Traceback (most recent call last)" in (tmp_path / "rank1.log").read_text()


def test_an_error_in_clean_up_does_not_hide_the_first_one(tmp_path: Path, rank) -> None:
    rank(0)
    try:
        try:
            raise ValueError("the real cause")
        except ValueError:  # what Lightning's teardown did after a failed set-up
            raise NotImplementedError("Cannot copy out of meta tensor")  # noqa: B904 - an implicit chain on purpose
    except NotImplementedError as error:
        line = report_failure(error, str(tmp_path))
    assert line is not None and line.startswith("rank 0 failed: ValueError: the real cause")


def test_an_error_every_rank_raises_is_printed_by_rank_0_only(tmp_path: Path, rank) -> None:
    error = raised(StepRefused, "training_step calls the network twice; ... HINT: concatenate")
    rank(1)
    assert report_failure(error, str(tmp_path)) is None
    rank(0)
    assert report_failure(error, str(tmp_path)) == (
        f"training_step calls the network twice; ... HINT: concatenate (traceback: {tmp_path}/rank0.log)"
    )


def test_a_loss_with_reduction_none_is_named() -> None:
    with pytest.raises(StepRefused, match=r"returned a loss of shape \(4,\), not a scalar .*reduction='none'"):
        _loss_of(torch.ones(4))
