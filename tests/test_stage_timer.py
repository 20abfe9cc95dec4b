"""StageTimer: a stage's backward is timed to its end on every stage, the first (input without gradient) too."""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

from lightning_parallel.pipeline.timing import StageTimer

SLOW = 0.05  # seconds the backward of SlowBackward sleeps


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW)
        return grad


class Stage(nn.Module):
    """Linear, then an op whose backward takes SLOW seconds: the backward's end is after the sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SlowBackward.apply(self.linear(x))


def test_backward_is_timed_on_the_first_stage_and_later_ones() -> None:
    for index in (0, 1):  # stage 0's input needs no gradient; a later stage's does
        stage = Stage()
        timer = StageTimer({index: stage}, backward=True)
        x = torch.randn(2, 4, requires_grad=index > 0)
        timer.begin()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "full backward hook is firing ..." warning from torch either
            stage(x).sum().backward()
        timer.end(count=True)
        durations = {kind: end - start for start, end, kind, _, _ in timer.last_events}
        assert durations.keys() == {"F", "B"}
        assert durations["B"] >= SLOW, (index, durations)
        assert 0 <= timer.idle_fraction < 0.5  # the sleep is busy time, not idle


def test_forward_only_timing_records_no_backward() -> None:
    stage = Stage()
    timer = StageTimer({0: stage}, backward=False)
    timer.begin()
    stage(torch.randn(2, 4)).sum().backward()
    timer.end(count=True)
    assert [kind for _, _, kind, _, _ in timer.last_events] == ["F"]
