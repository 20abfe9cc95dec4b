"""Analyse any network (a transformers model, not only an ``nn.Sequential``) from one forward of its own call on fake
CPU tensors: its units (the outermost modules whose class repeats, e.g. decoder layers, and the other modules that
hold parameters themselves, e.g. an embedding, a norm, an LM head) in the order they run, each a planner ``Block``.

Saved tensors are the unit's that was running when autograd saved them; those saved after the last unit (the loss
on the logits) are that unit's ``outside_activations``, its output (the logits) its ``loss_input``. FLOPs are the
forward's x 3, without fused attention (it has no FLOP formula on CPU). Under a pipeline the forward runs as its
trace runs it (`as_traced`). It times nothing and sets nothing up.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.planner.analysis import _ShardTracker, tp_modulus
from lightning_parallel.planner.loss_backward import loss_backward_elements
from lightning_parallel.planner.workload import Block, Workload, human_count
from lightning_parallel.seams import as_traced
from lightning_parallel.tensor.sharded_logits import vocab_heads


def units_of(network: nn.Module) -> list[tuple[str, nn.Module]]:
    """The network's units, in definition order: outermost modules of a class that occurs more than once among the
    modules holding parameters, and modules holding parameters directly outside those."""
    holding = [m for m in network.modules() if next(m.parameters(), None) is not None]
    counts: dict[type, int] = {}
    for module in holding:
        counts[type(module)] = counts.get(type(module), 0) + 1
    units: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if next(child.parameters(), None) is None:
                continue
            if counts[type(child)] > 1 or next(child.parameters(recurse=False), None) is not None:
                units.append((full, child))
            else:
                walk(f"{full}.", child)

    walk("", network)
    return units


def workload_from_call(
    network: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    styles: Mapping[str, str],
    name: str | None = None,
    traced: bool = False,
) -> Workload:
    """Per-unit figures of ``network(*args, **kwargs)`` (its tensors' shapes only; 2 or more rows) on fake tensors.

    Args:
        network: Any module, best built on the meta device; a copy runs, the module is not changed.
        args, kwargs: One batch's network inputs (e.g. ``input_ids`` and ``labels``).
        styles: The exact-name tensor-parallel plan the strategy resolves (``parallelize.plan.resolve_plan``).
        traced: Whether the network runs split into traced pipeline stages: its forward then runs as their trace
            does (`as_traced`).

    A loss after a `vocab_head` keeps its logits split by vocabulary, by the rule the strategies and the dry run
    follow (`tensor.sharded_logits.vocab_heads`: under plain and FSDP2 replicas alike).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
    rows = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0
    if rows < 2:
        raise ValueError(f"the planner's analysis needs a batch of at least 2 rows, got {rows}. HINT: pass 2 rows")
    meta = copy.deepcopy(network).to("meta")
    units = units_of(meta)
    names = {id(module): unit for unit, module in units}
    figures: dict[str, dict[str, Any]] = {unit: {"saved": [], "output": 0.0} for unit, _ in units}
    order: list[str] = []
    current: list[str] = []
    last_output: list[torch.Tensor | None] = [None]  # the output of the unit that ran last (a loss's input)

    def enter(module: nn.Module, _args: tuple) -> None:
        current.append(names[id(module)])
        if not order or order[-1] != current[-1]:
            order.append(current[-1])

    def leave(module: nn.Module, _args: tuple, output: Any) -> None:
        unit = current.pop()
        first = output if torch.is_tensor(output) else next((o for o in _leaves(output) if torch.is_tensor(o)), None)
        figures[unit]["output"] = float(first.numel()) if first is not None else 0.0
        last_output[:] = [first]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        owner = current[-1] if current else (order[-1] if order else units[0][0])
        figures[owner]["saved"].append((tensor, not current and bool(order)))
        return tensor

    with FakeTensorMode(allow_non_fake_inputs=True):
        meta.to_empty(device="cpu")
        fake = [_like(t) for t in args]
        fake_kwargs = {k: _like(v) for k, v in kwargs.items()}
        handles = [h for _, m in units for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        tracker = _ShardTracker(dict(meta.named_modules()), dict(styles))
        try:
            with tracker, FlopCounterMode(display=False) as flops, as_traced() if traced else nullcontext():
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    output = meta(*fake, **fake_kwargs)
        finally:
            for handle in handles:
                handle.remove()
        loss = next((t for t in _leaves(output) if torch.is_tensor(t) and t.dim() == 0 and t.grad_fn), None)
        if loss is not None and last_output[0] is not None and order:  # the network's own loss, after its last unit
            figures[order[-1]]["loss_backward"] = loss_backward_elements(loss, last_output[0])
        parameter_ids = {id(p) for p in meta.parameters()}
        split_loss = set(vocab_heads(styles)) & set(order)
        blocks = [_block(unit, dict(meta.named_modules())[unit], figures[unit], tracker, flops, parameter_ids, rows,
                         split_loss=unit in split_loss) for unit in order]  # fmt: skip
    total = sum(b.params for b in blocks)
    label = name or f"{type(network).__name__} ({human_count(total)} parameters)"
    return Workload(name=label, blocks=tuple(blocks), tp_modulus=tp_modulus(network, styles))


def _block(
    unit: str,
    module: nn.Module,
    figures: dict[str, Any],
    tracker: _ShardTracker,
    flops: FlopCounterMode,
    parameter_ids: set[int],
    rows: int,
    *,
    split_loss: bool,
) -> Block:
    inside = [t for t, outside in figures["saved"] if not outside]
    outside = [t for t, after in figures["saved"] if after]
    saved, tp_saved = tracker.saved_elements(inside, parameter_ids)
    loss, tp_loss = tracker.saved_elements(outside, parameter_ids)
    tp_loss = loss if split_loss else tp_loss
    # the loss's input: the logits, this unit's output, alive through the loss's forward beside what it saves
    held = figures["output"] / rows if outside else 0.0
    gradients = figures.get("loss_backward", 0.0) / rows if outside else 0.0
    counts = flops.get_flop_counts()
    forward = sum(sum(v.values()) for key, v in counts.items() if key.endswith(f".{unit}") or key == unit)
    params = sum(p.numel() for p in module.parameters())
    each = tuple(
        (p.numel(), _sharded_by(f"{unit}.{key}", tracker.styles, tracker)) for key, p in module.named_parameters()
    )
    sharded = sum(n for n, split in each if split)
    return Block(
        name=unit,
        kind=type(module).__name__,
        params=params,
        tp_params=sharded,
        flops=3.0 * forward / rows,
        tp_flops=3.0 * forward / rows * sharded / params if params else 0.0,  # matrix products scale with weights
        activations=(saved + loss) / rows,
        tp_activations=(tp_saved + tp_loss) / rows,
        outside_activations=loss / rows,
        tp_outside_activations=tp_loss / rows,
        loss_input=held,
        tp_loss_input=held if split_loss else 0.0,
        loss_backward=gradients,
        tp_loss_backward=held if split_loss else 0.0,  # the vocabulary-parallel loss's: one copy, made in place
        output=figures["output"] / rows,
        replica_unit=unit.partition(".")[0],  # the tensor strategy's FSDP2 wraps each child of the network
        parameters=each,
    )


def _sharded_by(parameter: str, styles: Mapping[str, str], tracker: _ShardTracker) -> bool:
    from lightning_parallel.tensor.styles import STYLE_TRAITS

    owner, _, key = parameter.rpartition(".")
    style = styles.get(owner)
    return style is not None and key in STYLE_TRAITS[style].sharded_parameters(tracker.modules[owner])


def _like(value: Any) -> Any:
    if not torch.is_tensor(value):
        return value
    return torch.zeros(value.shape, dtype=value.dtype, device="cpu")


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]
