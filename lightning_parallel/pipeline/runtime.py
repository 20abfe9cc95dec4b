"""One pipelined step with `torch.distributed.pipelining`: stages and a schedule per input shape (its micro-batch
count from `microbatches.py`, recorded as it runs), and gradients set aside between a step and its backward.

Knows nothing about Lightning: the strategy decides when to call it and what to do with the results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import OVERLAP_F_B, PipelineScheduleSingle, _PipelineScheduleRuntime
from torch.utils import _pytree as pytree

from lightning_parallel.autograd_seams import send_zero_gradients
from lightning_parallel.pipeline.microbatches import PlansUsed, PlanUsed, plan_microbatches
from lightning_parallel.pipeline.schedule_plan import resolve_schedule
from lightning_parallel.pipeline.timing import StageTimer
from lightning_parallel.seams import (
    action_order,
    forward_actions,
    shape_inference,
    skip_self_warmup,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# One micro-batch of the network's inputs -> this rank's stage modules for that shape (traced networks).
StageFactory = Callable[[tuple[torch.Tensor, ...]], dict[int, nn.Module]]


def placeholder_loss(output: object) -> torch.Tensor:
    """A zero loss connected to every floating output (a tensor, or the tensors of a tuple, dict or other pytree such as
    a ``ModelOutput``), so a schedule can run its backward without a real loss."""
    tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    floating = [t for t in tensors if t.is_floating_point()]
    return sum((t * 0).sum() for t in floating) if floating else torch.zeros(())  # type: ignore[return-value]


def clone_view_outputs(module: nn.Module, args: object, output: object) -> object:
    """Forward hook: torch's split backward (zero-bubble schedules, DualPipeV) detaches stage outputs in place,
    which a view such as `x.view(x.size(0), -1)` does not allow; such an output leaves the stage as a copy."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._is_view() else output
    if isinstance(output, tuple):
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t for t in output)
    return output


def take_gradients(params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]:
    """Detach the current gradients from the parameters and return them (the parameters keep none)."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def put_gradients(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def guard_metadata_inference(schedule: object, modules: Sequence[nn.Module], inferring: list[bool]) -> None:
    """Undo what torch's shape inference does to module buffers, and flag it while it runs.

    On the first step of a schedule, every stage runs one extra forward to infer shapes, on the first
    micro-batch at stage 0 and on uninitialised memory elsewhere, and (from torch 2.12 on) the last stage calls
    the loss on that output with the whole target. BatchNorm running statistics would silently absorb the forward,
    so buffers are saved before that step and restored after it; `inferring[0]` is True meanwhile, so the
    loss can skip user code that must see each real micro-batch exactly once.
    """
    name, infer = shape_inference(schedule)
    buffers = [b for module in modules for b in module.buffers()]

    def guarded(*args: object, **kwargs: object) -> object:
        saved = [b.detach().clone() for b in buffers]
        inferring[0] = True
        try:
            return infer(*args, **kwargs)
        finally:
            inferring[0] = False
            with torch.no_grad():
                for buffer, value in zip(buffers, saved, strict=True):
                    buffer.copy_(value)

    setattr(schedule, name, guarded)


def drop_backward_actions(schedule: object) -> None:
    """Make an action-list schedule forward-only, for evaluation.

    torch's action-list schedules (looped BFS, interleaved, zero-bubble, DualPipeV) still walk their backward
    actions when built without a loss, and the split-backward ones then fail ("can't steal_bwd_input if this
    stage doesn't have backward"). Each rank keeps the forward actions (`seams.forward_actions`) in their order
    (the forward halves of DualPipeV's overlapped pairs included): removing actions that wait can not add a
    deadlock to an order that had none.
    """
    if not isinstance(schedule, _PipelineScheduleRuntime):
        return  # single-stage schedules skip the backward themselves when there is no loss
    keep = forward_actions()
    order = action_order(schedule)
    for rank, actions in order.items():
        flat: list[Any] = []
        for action in actions:
            parts = action.sub_actions if action.computation_type == OVERLAP_F_B else [action]
            flat.extend(a for a in parts if a.computation_type in keep)
        order[rank] = flat


class PipelineRuntime:
    """The local stages of one pipeline rank and their schedules, one per (mode, input shape).

    Args:
        stage_modules: stage index -> module holding that stage's blocks (shared with the model).
        num_stages: total stages in the pipeline (pipeline size x stages per rank).
        schedule: our schedule name (see `schedule_plan.SCHEDULES`).
        microbatches: requested micro-batches per step; fewer are used when the batch needs it (`used`
            records what ran; `warn` hears once per batch size that ran fewer).
        group: the pipeline process group.
        device: where this rank's stages run.
        loss_fn: per micro-batch loss `(output, target) -> scalar mean`, called on the last stage.
        stage_factory: for networks traced per shape, builds the stage modules for a micro-batch's inputs;
            `stage_modules` are then the ones built for the first example.
        warn: called with `fallback_warning`'s line the first time a batch size falls back.
    """

    def __init__(
        self,
        *,
        stage_modules: dict[int, nn.Module],
        num_stages: int,
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: LossFn,
        stage_factory: StageFactory | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.stage_modules = dict(sorted(stage_modules.items()))
        self.stage_factory = stage_factory
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.group = group
        self.device = device
        self.loss_fn = loss_fn
        self.pp = dist.get_world_size(group)
        self.stages_per_rank = len(self.stage_modules)
        spec = resolve_schedule(schedule, pp=self.pp, microbatches=microbatches, stages_per_rank=self.stages_per_rank)
        self.has_first = 0 in self.stage_modules
        self.has_last = num_stages - 1 in self.stage_modules
        self._schedules: dict[tuple, tuple[object, PlanUsed]] = {}
        self._inferring = [False]
        self._hooked: set[int] = set()
        self.used = PlansUsed(schedule=schedule, requested=microbatches, warn=warn)
        # Fallback schedules (`ScheduleTraits.fallback`) split the backward only when the configured one does too.
        self.timer = StageTimer(self.stage_modules, backward=not spec.splits_backward)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._inferring[0]:  # shape inference: any loss connected to the output will do
            return placeholder_loss(output)
        return self.loss_fn(output, target)

    def _valid_indices(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook: during shape inference later stages run on `torch.empty` inputs; an integer one carried
        to a later stage (labels for a loss computed inside the model, token ids) would index out of range there, so
        it becomes zeros of the same shape, a valid index. Real steps are untouched."""
        if not self._inferring[0]:
            return None
        return tuple(
            torch.zeros_like(a) if isinstance(a, torch.Tensor) and not (a.is_floating_point() or a.is_complex()) else a
            for a in args
        )

    @property
    def microbatches_used(self) -> dict[tuple[bool, int], tuple[str, int]]:
        """(training?, batch size) -> (schedule, micro-batches) that ran (the benchmarks read this)."""
        return {key: (used.schedule, used.microbatches) for key, used in self.used.plans.items()}

    def _schedule(self, training: bool, inputs: tuple[torch.Tensor, ...]) -> tuple[object, PlanUsed]:
        # Every rank holds the batch (ranks of a replica share it), so every rank computes the same key.
        key = (training, tuple(tuple(t.shape) for t in inputs))
        if key not in self._schedules:
            batch_size = inputs[0].shape[0]
            name, count = plan_microbatches(
                batch_size,
                schedule=self.schedule_name,
                requested=self.microbatches,
                pp=self.pp,
                stages_per_rank=self.stages_per_rank,
            )
            spec = resolve_schedule(name, pp=self.pp, microbatches=count, stages_per_rank=self.stages_per_rank)
            modules = self._modules_for(inputs, count)
            stages = [
                PipelineStage(module, index, self.num_stages, self.device, group=self.group)
                for index, module in modules.items()
            ]
            self.timer.watch_stages(stages)
            for stage in stages:
                send_zero_gradients(stage)
            loss_fn = self._loss if training else None
            schedule_class: Any = spec.torch_class  # a single- or multi-stage torch schedule class, by name
            if issubclass(schedule_class, PipelineScheduleSingle):
                schedule = schedule_class(stages[0], n_microbatches=count, loss_fn=loss_fn)
            else:
                schedule = schedule_class(stages, n_microbatches=count, loss_fn=loss_fn)
            skip_self_warmup(schedule, stages, dist.get_rank())
            if not training:
                drop_backward_actions(schedule)
            guard_metadata_inference(schedule, list(modules.values()), self._inferring)
            self._schedules[key] = (schedule, self.used.record(training, batch_size, name, count))
        return self._schedules[key]

    def _modules_for(self, inputs: tuple[torch.Tensor, ...], count: int) -> dict[int, nn.Module]:
        if self.stage_factory is None:
            modules = self.stage_modules
        else:
            micro = tuple(t[: t.shape[0] // count] for t in inputs)  # every micro-batch has this shape
            modules = dict(sorted(self.stage_factory(micro).items()))
            self.timer.watch(modules)
        for module in modules.values():
            if id(module) not in self._hooked:
                self._hooked.add(id(module))
                module.register_forward_hook(clone_view_outputs)
                module.register_forward_pre_hook(self._valid_indices)
        return modules

    def train_step(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch; gradients land in `.grad`. Returns the mean loss on the
        rank holding the last stage, None elsewhere. Every rank passes the batch."""
        new = (True, tuple(tuple(t.shape) for t in inputs)) not in self._schedules
        schedule, used = self._schedule(True, inputs)
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        self.timer.begin()
        schedule.step(*args, return_outputs=False, **kwargs)  # type: ignore[attr-defined]
        self.timer.end(count=not new)  # a new schedule's first step includes shape inference
        used.batches += 1
        return torch.stack([loss.detach().float() for loss in losses]).mean() if self.has_last else None

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """Forward only (evaluation). Returns the whole batch's output (what the last stage returns, each tensor
        concatenated over micro-batches) on the last stage's rank."""
        schedule, used = self._schedule(False, inputs)
        with torch.no_grad():
            output = schedule.step(*(inputs if self.has_first else ()))  # type: ignore[attr-defined]
        used.batches += 1
        return output if self.has_last else None
