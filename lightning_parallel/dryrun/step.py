"""One training step of one rank role on fake tensors: the peak of live tensor bytes (`live_bytes.py`) and the gradient
and optimizer-state bytes the step leaves. At pp=1 the
user's `training_step` runs as Lightning would call it; at pp > 1 the rank's own compute actions run in the order the
schedule gives them (`pipeline/schedule_plan.rank_actions`), on its own stage modules, with no transport.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from lightning_parallel.dryrun.live_bytes import LiveBytes
from lightning_parallel.one_process_ranks import local_part, outside_fake_tensors
from lightning_parallel.parameter_kinds import then_by_kind
from lightning_parallel.pipeline.partition import Partition
from lightning_parallel.pipeline.runtime import clone_view_outputs
from lightning_parallel.pipeline.schedule_plan import ScheduleSpec, rank_actions
from lightning_parallel.pipeline.split import NetworkSplit
from lightning_parallel.strategies.user_step import _loss_of, slice_batch, swap_attribute
from lightning_parallel.tensor.traced_stages import stages_on_mesh


def optimizer_of(module: pl.LightningModule) -> torch.optim.Optimizer:
    """The one optimizer `configure_optimizers()` returns (alone, first of a list, or under "optimizer")."""
    made: Any = module.configure_optimizers()
    if isinstance(made, Mapping):
        made = made["optimizer"]
    if isinstance(made, (list, tuple)):
        made = made[0]
    if isinstance(made, Mapping):
        made = made["optimizer"]
    if not isinstance(made, torch.optim.Optimizer):
        raise ValueError(
            f"{type(module).__name__}.configure_optimizers() gave {type(made).__name__}; the dry run measures one "
            "torch optimizer. HINT: return an optimizer, a list of them, or a dict with 'optimizer'"
        )
    return made


def tracked_step(module: pl.LightningModule, run: Callable[[], None]) -> dict[str, int]:
    """Run `run` (forward and backward) then the optimizer's step, counting live tensor bytes (`LiveBytes`): the
    peak (parameters and buffers included), and the gradient and optimizer-state bytes held afterwards. A step after
    the first: the optimizer's state (made at its first step) is there through forward and backward."""
    optimizer = optimizer_of(module)
    _make_state(module, optimizer)
    state = [v for values in optimizer.state.values() for v in values.values() if torch.is_tensor(v)]
    # held from the start: the parameters, buffers and the optimizer's state (alive through forward and backward)
    with LiveBytes([*module.parameters(), *module.buffers(), *state]) as live, ExitStack() as stack:
        then_by_kind(run, optimizer, stack)()  # the update sees one parameter kind at a time, as in a real step
        optimizer.step()
    grads = sum(_bytes(p.grad) for p in module.parameters() if p.grad is not None)
    states = sum(_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    return {"peak_total": int(live.peak), "gradient_bytes": int(grads), "optimizer_bytes": int(states)}


def _make_state(module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
    """One update on zero gradients, uncounted, so the optimizer holds its state as every step after the first."""
    trained = [p for p in module.parameters() if p.requires_grad]
    for param in trained:
        param.grad = torch.zeros_like(param)
    with ExitStack() as stack:
        then_by_kind(lambda: None, optimizer, stack)()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def whole_step(module: pl.LightningModule, batch: Any) -> Callable[[], None]:
    """pp=1: the user's `training_step` and its backward (logging muted)."""

    def run() -> None:
        with swap_attribute(module, "log", _ignore), swap_attribute(module, "log_dict", _ignore):
            loss = _loss_of(module.training_step(batch, 0))
        loss.backward()

    return run


def scheduled_step(
    module: pl.LightningModule,
    network: nn.Module,
    batch: Any,
    *,
    split: NetworkSplit,
    partition: Partition,
    spec: ScheduleSpec,
    pp: int,
    pp_rank: int,
    microbatches: int,
    boundaries: Sequence[tuple[Any, ...]],
    tp_mesh: DeviceMesh | None = None,
    heads: Sequence[str] = (),
) -> Callable[[], None]:
    """pp > 1: this rank's forward and backward actions in the schedule's order, each micro-batch's graph kept from
    its forward to its backward, as the schedule keeps it. `boundaries[s]`: stage s's inputs for one micro-batch
    (meta tensors), from which fake inputs of the same shapes are made; the last stage's loss is the user's step on
    the micro-batch's rows, with the network's output substituted. `tp_mesh`: traced stages compute on DTensors
    over it, as the strategy's runtime makes them (`tensor/traced_stages.stages_on_mesh`), `heads` its vocab_heads."""
    rows = _rows(batch)
    size = rows // microbatches
    example = tuple(_like(t, grad=False) for t in boundaries[0])
    with outside_fake_tensors():  # a traced network's stages: traced (or copied) from meta modules
        stages = split.stage_modules(partition, pp_rank, example)
        if tp_mesh is not None:
            stages, _ = stages_on_mesh(stages, None, tp_mesh, heads)
    last = len(partition.stages) - 1

    def forward(stage: int, micro: int, inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any, Any]:
        """(inputs, the stage's output, what backward starts from): torch's `PipelineStage.fwd_cache` keeps the
        first two until the micro-batch's backward has run, the last stage's output (its logits) too, beside the
        loss the schedule keeps for that backward (`_internal_losses`)."""
        out = clone_view_outputs(stages[stage], inputs, stages[stage](*inputs))  # as the runtime's hook copies them
        if stage != last:
            return inputs, out, out
        part = slice_batch(batch, micro * size, (micro + 1) * size, rows)
        value = split.output(out)
        with swap_attribute(network, "forward", lambda *a, **k: value), swap_attribute(module, "log", _ignore):
            return inputs, out, _loss_of(module.training_step(part, micro))

    def run() -> None:
        # each stage's receive buffers, one per micro-batch, made at the first step and kept (`PipelineStage`'s
        # args_recv_info / grad_recv_info): the first stage's inputs are the batch's, the last stage's loss has none
        ours = [s for s, rank in enumerate(spec.stage_to_rank(pp)) if rank == pp_rank]
        received = {(s, m): tuple(_like(t, grad=s > 0) for t in boundaries[s])
                    for s in ours for m in range(microbatches)}  # fmt: skip
        gradients = {(s, m): tuple(_like(t, grad=False) for t in boundaries[s + 1])
                     for s in ours if s < last for m in range(microbatches)}  # fmt: skip
        alive: dict[tuple[int, int], Any] = {}
        weights: dict[tuple[int, int], Callable[[], None]] = {}  # a split backward's W, waiting
        sent: list[torch.Tensor] = []  # held until the step ends (`ScheduleTraits.holds_sends`)
        owner = spec.stage_to_rank(pp)
        for action in rank_actions(spec, pp=pp, microbatches=microbatches)[pp_rank]:
            key = (action.stage, action.microbatch)
            stage, micro = key
            if action.kind == "F":
                alive[key] = forward(stage, micro, received[key])
                out = _tensors(alive[key][1])
                if stage < last and owner[stage + 1] == pp_rank:  # a V's turn: handed over, not sent
                    received[stage + 1, micro] = tuple(t.detach().requires_grad_(t.requires_grad) for t in out)
                elif stage < last and spec.traits.holds_sends:
                    sent.extend(out)
            elif action.kind == "W":
                weights.pop(key)()
            else:
                inputs, output, start = alive.pop(key)
                grads = _backward(
                    inputs, output, start, gradients.get(key), stages[stage], weights, key, action.kind == "I"
                )
                if stage > 0 and owner[stage - 1] == pp_rank:
                    gradients[stage - 1, micro] = tuple(grads)
                elif stage > 0 and spec.traits.holds_sends:
                    sent.extend(g for g in grads if g is not None)

    return run


def _backward(
    inputs: tuple[Any, ...],
    output: Any,
    start: Any,
    given: tuple[Any, ...] | None,
    stage: nn.Module,
    weights: dict[tuple[int, int], Callable[[], None]],
    key: tuple[int, int],
    split: bool,
) -> list[torch.Tensor | None]:
    """One micro-batch's backward from `start` (the loss, or the stage's output with the gradients `given` from the
    next stage, its receive buffers); its inputs and output stay alive until it returns, as
    `PipelineStage.backward_one_chunk` holds them. Returns the inputs' gradients (what goes to the stage before).
    `split`: an input-gradient action (I) whose weight-gradient action (W) is left in `weights[key]`, holding what
    torch's stage keeps for it (`backward_state`): on the first stage everything (its I does nothing, its W is the
    whole backward), elsewhere what torch's `stage_backward_input` leaves (the graph below the weights with its saved
    tensors, the gradients at the weights) and the inputs' gradients (`.grad` of the receive buffers)."""
    ends = _tensors(start)
    outs = [t for t in ends if t.requires_grad]
    grads = None if given is None else [torch.ones_like(t) if g is None else g
                                        for t, g in zip(ends, given, strict=True) if t.requires_grad]  # fmt: skip
    if not split:
        torch.autograd.backward(outs, grads or [torch.ones_like(t) for t in outs])
        found = _input_grads(inputs)
        for tensor in inputs:  # `stage_backward` hands the gradients on and drops them from the inputs
            if torch.is_tensor(tensor):
                tensor.grad = None
        return found
    if key[0] == 0:
        kept = (inputs, output)

        def whole() -> None:
            torch.autograd.backward(outs, grads or [torch.ones_like(t) for t in outs])
            kept.__len__()  # held until W, as `backward_state` holds them

        weights[key] = whole
        return [None for _ in inputs]
    _, groups = stage_backward_input(outs, grads, list(inputs), stage.parameters())
    held = (inputs, start, grads)

    def weight() -> None:
        stage_backward_weight(stage.parameters(), groups)
        held.__len__()

    weights[key] = weight
    return _input_grads(inputs)


def _input_grads(inputs: tuple[Any, ...]) -> list[torch.Tensor | None]:
    return [t.grad if torch.is_tensor(t) else None for t in inputs]


def boundaries_of(split: NetworkSplit, partition: Partition, example: tuple[torch.Tensor, ...], pp: int) -> list[tuple]:
    """Each stage's inputs for one micro-batch, found by running the whole (unpruned, meta) network stage by stage."""
    current: tuple = tuple(t.to("meta") if torch.is_tensor(t) else t for t in example)
    modules: dict[int, nn.Module] = {}
    for rank in range(pp):  # traced for the meta device: nothing is moved to where the batch is
        modules.update(split.stage_modules(partition, rank, current))
    inputs: list[tuple] = []
    with torch.no_grad():
        for stage in range(len(partition.stages)):
            inputs.append(current)
            out = modules[stage](*current)
            current = tuple(_tensors(out))
    return inputs


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _like(tensor: Any, *, grad: bool) -> Any:
    if not torch.is_tensor(tensor):
        return tensor
    made = torch.zeros(tensor.shape, dtype=tensor.dtype, device="cpu")
    return made.requires_grad_(True) if grad and made.is_floating_point() else made


def _rows(batch: Any) -> int:
    first = next(iter(_tensors(batch)), None)
    if first is None or first.dim() == 0:
        raise ValueError("the dry run found no tensor with a batch dimension in the batch. HINT: pass batch=")
    return int(first.shape[0])


def _bytes(tensor: torch.Tensor) -> int:
    local = local_part(tensor)
    return local.numel() * local.element_size()


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
