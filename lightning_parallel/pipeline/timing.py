"""When each local pipeline stage computes, measured with module hooks, so the idle time per rank
(the measured bubble) can be put next to the schedule's analytic one, and drawn.

Forward and full backward are timed with hooks; a backward runs from the stage output's autograd node to the
stage's last parameter gradient. Schedules that split the backward (the zero-bubble ones and DualPipeV) run the
input-gradient (I) and weight-gradient (W) passes apart, so one hooked span would cover the wait between them:
their backward is timed at torch's two stage calls instead (`watch_stages`; torch's Python in those calls counts
as busy). Everything else inside the step
(send/recv and their waits, the loss, the schedule's Python) is idle here.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_parallel.autograd_seams import when_gradients_made
from lightning_parallel.seams import stage_backward_calls

# (start_s, end_s, kind "F"/"B"/"I"/"W", stage, micro-batch); wall-clock seconds, so ranks share one clock
Event = tuple[float, float, str, int, int]


class StageTimer:
    """Hooks on the stage modules; `step()` brackets one training step."""

    def __init__(self, stage_modules: dict[int, nn.Module], *, backward: bool) -> None:
        self.active = False
        self.events: list[Event] = []
        self.last_events: list[Event] = []
        self.busy_s = 0.0
        self.wall_s = 0.0
        self._open: dict[tuple[str, int], float] = {}
        self._counts: Counter[tuple[str, int]] = Counter()
        self._step_start = 0.0
        self._backward = backward
        self._watched: set[int] = set()
        self.watch(stage_modules)

    def watch(self, stage_modules: dict[int, nn.Module]) -> None:
        """Time these stage modules too (traced networks get new stage modules per micro-batch shape)."""
        for index, module in stage_modules.items():
            if id(module) in self._watched:
                continue
            self._watched.add(id(module))
            module.register_forward_pre_hook(lambda *_, i=index: self._start("F", i))
            module.register_forward_hook(lambda *_, i=index: self._end("F", i))
            if self._backward:
                self._time_backward(index, module)

    def _time_backward(self, index: int, module: nn.Module) -> None:
        """From the moment backward reaches the stage's output to the moment its parameter gradients are done.
        (Module backward hooks would fire, and torch warn, at the start on stage 0, whose input needs no
        gradient.) A stage without parameters computes next to nothing; its backward is not timed."""
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            module.register_forward_hook(lambda _m, _a, output: self._on_backward_start(output, index))
            when_gradients_made(params, lambda: self._end("B", index))

    def watch_stages(self, stages: Iterable[Any]) -> None:
        """Split-backward schedules: time torch's `PipelineStage.backward_one_chunk` (I, or B when run whole) and
        `backward_weight_one_chunk` (W) of these stages. (On the last stage, I includes the loss's backward.)"""
        for stage in stages:
            if self._backward or id(stage) in self._watched:
                continue
            self._watched.add(id(stage))
            index, (backward, weight) = stage.stage_index, stage_backward_calls(stage)

            def timed_backward(*args: Any, _run: Any = backward, _i: int = index, **kwargs: Any) -> Any:
                kind = "B" if kwargs.get("full_backward", True) else "I"
                self._start(kind, _i)
                try:
                    return _run(*args, **kwargs)
                finally:
                    self._end(kind, _i)

            def timed_weight(*args: Any, _run: Any = weight, _i: int = index, **kwargs: Any) -> Any:
                self._start("W", _i)
                try:
                    return _run(*args, **kwargs)
                finally:
                    self._end("W", _i)

            stage.backward_one_chunk, stage.backward_weight_one_chunk = timed_backward, timed_weight

    def _on_backward_start(self, output: Any, index: int) -> None:
        outputs = output if isinstance(output, tuple | list) else (output,)
        nodes = {t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        for node in nodes:
            node.register_prehook(lambda *_: self._start("B", index))

    def _start(self, kind: str, stage: int) -> None:
        if self.active:
            self._open[(kind, stage)] = time.time()

    def _end(self, kind: str, stage: int) -> Any:
        start = self._open.pop((kind, stage), None)
        if self.active and start is not None:
            microbatch = self._counts[(kind, stage)]
            self._counts[(kind, stage)] += 1
            self.events.append((start, time.time(), kind, stage, microbatch))
        return None

    def begin(self) -> None:
        self.active, self.events = True, []
        self._counts.clear()
        self._step_start = time.time()

    def end(self, *, count: bool) -> None:
        """Close a step; `count=False` for a step whose schedule was just built (shape inference)."""
        self.active = False
        self.last_events = list(self.events)
        if count:
            self.busy_s += sum(end - start for start, end, *_ in self.events)
            self.wall_s += time.time() - self._step_start

    @property
    def idle_fraction(self) -> float | None:
        """Share of this rank's time inside training steps spent waiting, not computing."""
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else None
