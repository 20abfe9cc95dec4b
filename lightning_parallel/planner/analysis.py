"""Analyse an ``nn.Sequential`` of named blocks on the meta device: per-block parameters, FLOPs, saved activations,
outputs and tensor-parallel traffic, each split by what the model's tensor-parallel plan shards (any other network:
``call_analysis.py``; which of the two a network gets: ``network.py``).

One meta forward + backward per block (FlopCounterMode, forward hooks), and its saved tensors from a forward on fake
CPU tensors (where attention runs a fused kernel, as on devices); nothing is materialised and nothing is timed
(``measure.py`` times).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.planner.split_backward import weight_gradient_elements
from lightning_parallel.planner.workload import Block, Workload, human_count
from lightning_parallel.seams import dispatch_mode
from lightning_parallel.tensor.plans import expand_plan, sharded_sizes
from lightning_parallel.tensor.styles import STYLE_TRAITS

_, tree_leaves, _ = dispatch_mode()  # torch's private pytree, through the seam


def sequential_workload(
    model: nn.Sequential, sample: torch.Tensor, *, plan: Mapping[str, str] | None = None, name: str | None = None
) -> Workload:
    """Analyse an ``nn.Sequential`` of named blocks with one forward + backward on the meta device.

    Args:
        model: An ``nn.Sequential`` of named blocks; moved to nothing, only its meta-device copy runs (build it on
            meta to save memory).
        sample: A batch of at least 2 samples (BatchNorm needs 2), any device; only its shape and dtype are used.
        plan: Tensor-parallel plan ``{pattern: style}``; None uses the model's ``tp_plan`` attribute, if any.
        name: Shown in the plan's header; defaults to the class name and parameter count.

    Returns:
        Per-sample figures (FLOPs, saved activations, outputs, collectives) from the meta run, parameters exact.
    """
    if len(model) < 1:
        raise ValueError("the planner got an empty nn.Sequential. HINT: give it the model's blocks")
    if sample.dim() < 1 or sample.shape[0] < 2:
        raise ValueError(f"sample batch has shape {tuple(sample.shape)}; need >= 2 samples. HINT: a batch of 2")
    own = getattr(model, "tp_plan", None) if plan is None else plan
    styles = expand_plan(model, own) if own else {}
    meta = model if all(t.is_meta for t in [*model.parameters(), *model.buffers()]) else copy.deepcopy(model).to("meta")
    x = torch.empty(sample.shape, dtype=sample.dtype, device="meta")
    blocks = []
    for index, (block_name, block) in enumerate(meta.named_children()):
        # the block's own plan entries, by name relative to the block ("" = the block itself)
        local = {key.removeprefix(block_name).removeprefix("."): style for key, style in styles.items()
                 if key == block_name or key.startswith(f"{block_name}.")}  # fmt: skip
        x, figures = _analyse_block(block, x, local, needs_input_grad=index > 0)
        blocks.append(Block(name=block_name, **figures))
    total = sum(b.params for b in blocks)
    label = name or f"{type(model).__name__} ({human_count(total)} parameters)"
    return Workload(name=label, blocks=tuple(blocks), tp_modulus=tp_modulus(model, styles))


def tp_modulus(model: nn.Module, styles: Mapping[str, str]) -> int:
    """The gcd of every size an expanded plan shards (features, heads, channels, vocabulary); 1 without a plan.

    Uses the divisibility rules of ``tensor.plans.check_plan``, so a size divides it exactly when that check passes.
    """
    modules = dict(model.named_modules())
    modulus = 0
    for name, style in styles.items():
        parent = modules.get(name.rpartition(".")[0]) if "." in name else None
        for _, size in sharded_sizes(style, modules[name], parent):
            modulus = math.gcd(modulus, size)
    return modulus or 1


def _analyse_block(
    block: nn.Module, x: torch.Tensor, styles: dict[str, str], *, needs_input_grad: bool
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One meta forward + backward of a block: its per-sample figures, and its output (the next block's input)."""
    batch = x.shape[0]
    tracker = _ShardTracker(dict(block.named_modules()), styles)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    if needs_input_grad and x.is_floating_point():
        x = x.detach().requires_grad_(True)
    # Two counters: torch's per-module attribution is right for forward ops only, so backward adds to the total.
    with tracker, FlopCounterMode(display=False) as forward:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = block(x)
    with FlopCounterMode(display=False) as backward:
        if out.requires_grad:
            out.backward(torch.empty_like(out))
    params = list(block.parameters())
    activations, tp_activations = _saved_as_devices_run(block, x, styles)
    forward_flops, sharded_flops = tracker.flops(forward.get_flop_counts(), type(block).__name__)
    flops = forward_flops + backward.get_total_flops()
    figures = {
        "kind": type(block).__name__,
        "params": sum(p.numel() for p in params),
        "tp_params": tracker.sharded_params(),
        "flops": flops / batch,
        "tp_flops": flops * sharded_flops / forward_flops / batch if forward_flops else 0.0,
        "activations": activations / batch,
        "tp_activations": tp_activations / batch,
        "output": out.numel() / batch,
        "weight_gradients": weight_gradient_elements(block, x) / batch,
        "collectives": tuple((kind, elements / batch) for kind, elements in tracker.collectives),
        # each parameter in the order an optimizer updates them: a later micro-batch's new gradient of the largest
        # lies beside the accumulated one, and a for-loop update's temporaries follow them (`memory.py`)
        "parameters": tuple((p.numel(), key in tracker.sharded_names()) for key, p in block.named_parameters()),
    }
    return out.detach(), figures


def _saved_as_devices_run(block: nn.Module, x: torch.Tensor, styles: dict[str, str]) -> tuple[float, float]:
    """(all, sharded) elements a block saves for backward, from a forward on fake CPU tensors: there attention runs
    a fused kernel, as on real devices (flash / memory-efficient: no sequence x sequence scores kept), where the
    meta device runs torch's math attention (which keeps them twice). FLOPs stay the meta run's (the fused CPU
    kernel has no FLOP formula)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = copy.deepcopy(block)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with FakeTensorMode(allow_non_fake_inputs=True):  # the block's meta tensors become fake CPU ones
        fake.to_empty(device="cpu")
        inputs = torch.empty(x.shape, dtype=x.dtype, device="cpu").requires_grad_(x.requires_grad)
        tracker = _ShardTracker(dict(fake.named_modules()), styles)
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fake(inputs)
        return tracker.saved_elements(saved, {id(p) for p in fake.parameters()})


class _ShardTracker:
    """Forward hooks that record which tensors of a block are tensor-parallel shards, and its collectives.

    A shard stays one through the functional code between modules (an attention's head reshapes, RoPE, SDPA): any
    torch op with a shard among its inputs returns shards, except inside a planned module (a row-parallel output is
    whole after its all-reduce) and in the tracked root's own forward (a loss on logits the strategy gathers)."""

    def __init__(self, modules: dict[str, nn.Module], styles: dict[str, str]) -> None:
        self.modules, self.styles = modules, styles
        self.sharded: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive so ids stay unique)
        self.collectives: list[tuple[str, float]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._depth = {"inner": 0, "planned": 0}  # running non-root modules, running planned modules
        self._mode = _Propagate(self)

    def propagating(self) -> bool:
        return self._depth["inner"] > 0 and self._depth["planned"] == 0

    def _count(self, key: str, step: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self._depth[key] += step

        return hook

    def __enter__(self) -> _ShardTracker:
        for name, module in self.modules.items():
            style = self.styles.get(name)
            for key, counted in (("inner", name != ""), ("planned", style is not None)):
                if counted:
                    self._handles.append(module.register_forward_pre_hook(self._count(key, 1)))
                    self._handles.append(module.register_forward_hook(self._count(key, -1)))
            leaf_without_params = not any(True for _ in module.children()) and not any(
                True for _ in module.parameters()
            )
            if style is not None or leaf_without_params:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(style)))
                self._handles.append(module.register_forward_hook(self._hook(style, propagate=leaf_without_params)))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    def _mark(self, tensor: object) -> None:
        # a Linear on (B, T, C) returns a view of a 2-D result, and saved tensors are views of that result
        if isinstance(tensor, torch.Tensor):
            self.sharded[id(tensor)] = tensor
            if tensor._base is not None:
                self.sharded[id(tensor._base)] = tensor._base

    def _pre_hook(self, style: str | None) -> Callable[..., None]:
        sharded_input = style is not None and STYLE_TRAITS[style].sharded_input

        def hook(module: nn.Module, args: tuple) -> None:
            if sharded_input and args:
                self._mark(args[0])

        return hook

    def _hook(self, style: str | None, *, propagate: bool) -> Callable[..., None]:
        traits = STYLE_TRAITS[style] if style is not None else None

        def hook(module: nn.Module, args: tuple, output: object) -> None:
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            sharded_output = traits is not None and traits.sharded_output
            if sharded_output or (propagate and first is not None and id(first) in self.sharded):
                self._mark(output)
            for kind, what in traits.collectives if traits is not None else ():
                tensor = first if what == "input" else output
                if isinstance(tensor, torch.Tensor) and (what == "output" or tensor.requires_grad):
                    self.collectives.append((kind, float(tensor.numel())))

        return hook

    def sharded_names(self) -> set[str]:
        """The names (relative to the tracked root) of the parameters the plan splits."""
        return {f"{name}.{key}" if name else key for name, style in self.styles.items()
                for key in STYLE_TRAITS[style].sharded_parameters(self.modules[name])}  # fmt: skip

    def sharded_params(self) -> int:
        total = 0
        for name, style in self.styles.items():
            module = self.modules[name]
            total += sum(getattr(module, key).numel() for key in STYLE_TRAITS[style].sharded_parameters(module))
        return total

    def saved_elements(self, saved: list[torch.Tensor], parameter_ids: set[int]) -> tuple[float, float]:
        """(all, sharded) elements saved for backward, each underlying tensor once, parameters excluded."""
        seen: dict[int, tuple[int, bool]] = {}
        for tensor in saved:
            base = tensor._base if tensor._base is not None else tensor
            if id(base) in parameter_ids or id(tensor) in parameter_ids:
                continue
            sharded = id(base) in self.sharded or id(tensor) in self.sharded
            elements, was_sharded = seen.get(id(base), (0, False))
            seen[id(base)] = (max(elements, base.numel()), was_sharded or sharded)
        return float(sum(e for e, _ in seen.values())), float(sum(e for e, s in seen.values() if s))

    def flops(self, counts: Mapping[str, Mapping[object, int]], root: str) -> tuple[float, float]:
        """(all, sharded) forward FLOPs: planned sharded modules, plus the own work of modules made only of them."""

        def total(name: str) -> float:
            key = root if not name else f"{root}.{name}"
            return float(sum(counts.get(key, {}).values()))

        # modules whose style communicates are the ones whose compute is split
        sharding = {name for name, style in self.styles.items() if STYLE_TRAITS[style].collectives}
        sharded = sum(total(name) for name in sharding)
        for name, module in self.modules.items():
            children = {f"{name}.{c}" if name else c: m for c, m in module.named_children()}
            with_params = [c for c, m in children.items() if any(True for _ in m.parameters())]
            if children and name not in sharding and with_params and all(c in sharding for c in with_params):
                sharded += total(name) - sum(total(c) for c in children)
        return float(sum(counts.get("Global", {}).values())), sharded


class _Propagate(TorchFunctionMode):
    """Marks every tensor an op returns as a shard when one of its tensor inputs is one (while the tracker says so)."""

    def __init__(self, tracker: _ShardTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN204 - torch's signature
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        if tracker.propagating() and any(
            isinstance(t, torch.Tensor) and id(t) in tracker.sharded for t in tree_leaves((args, kwargs))
        ):
            for tensor in tree_leaves(out):
                tracker._mark(tensor)
        return out
