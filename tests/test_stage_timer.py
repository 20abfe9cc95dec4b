"""StageTimer: a stage's backward is timed to its end on every stage, the first (input without gradient) too;
split-backward schedules' input- and weight-gradient passes are timed at torch's stage calls."""

from __future__ import annotations

import inspect
import time
import warnings

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

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


class SplitStage:
    """What a split-backward schedule calls on torch's PipelineStage: I (or B when whole), then W."""

    stage_index = 1

    def backward_one_chunk(self, bwd_chunk_id: int, loss: object = None, full_backward: bool = True) -> None:
        time.sleep(SLOW)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        time.sleep(SLOW)


def test_split_backward_is_timed_at_the_stage_calls() -> None:
    for name in ("backward_one_chunk", "backward_weight_one_chunk"):  # the torch methods the timer wraps
        assert hasattr(PipelineStage, name), name
    assert "full_backward" in inspect.signature(PipelineStage.backward_one_chunk).parameters
    module, stage = Stage(), SplitStage()
    timer = StageTimer({1: module}, backward=False)
    timer.watch_stages([stage])
    timer.watch_stages([stage])  # watching twice does not time twice
    timer.begin()
    module(torch.randn(2, 4, requires_grad=True))
    stage.backward_one_chunk(0, loss=None, full_backward=False)
    stage.backward_weight_one_chunk(0, last_backward=True)
    stage.backward_one_chunk(1, loss=None)  # a fallback schedule running the backward whole
    timer.end(count=True)
    kinds = [(kind, stage_index, mb) for _, _, kind, stage_index, mb in timer.last_events]
    assert kinds == [("F", 1, 0), ("I", 1, 0), ("W", 1, 0), ("B", 1, 0)]
    assert all(end - start >= SLOW for start, end, kind, _, _ in timer.last_events if kind != "F")
    assert 0 <= timer.idle_fraction < 0.2


def test_full_backward_timer_leaves_stage_calls_alone() -> None:
    stage = SplitStage()
    original = stage.backward_one_chunk
    StageTimer({1: Stage()}, backward=True).watch_stages([stage])
    assert stage.backward_one_chunk == original  # hooks time the backward there; no double counting


def test_timing_the_backward_holds_no_gradient() -> None:
    """Timing a stage's backward keeps none of its gradients: torch's multi-grad hook held each until the stage's
    last, so autograd copied every gradient into `.grad` and both lived to the end of the stage's backward (a pp2 x
    tp2 GPT's first rank 1.0 MB over its dry run in a real launch: benchmarks/results/dry_run_vs_launch.md)."""
    from lightning_parallel.dryrun.live_bytes import LiveBytes

    peaks = []
    for timed in (False, True):
        stage = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
        timer = StageTimer({0: stage}, backward=True) if timed else None
        with LiveBytes(list(stage.parameters())) as live:
            stage(torch.ones(8, 64)).sum().backward()
        peaks.append(live.peak)
        assert timer is None or timer.busy_s == 0.0  # hooked, not begun: nothing recorded
    assert peaks[1] == peaks[0], peaks
