"""Tensor-parallel plans as data: a table `module-name pattern -> style name`, expanded against a model, checked
before launch (every pattern matches, every sharded size divides), found automatically for plain Linear stacks, and
applied with torch's `parallelize_module`. It chooses no mesh and no size (the strategy does), and finds no plan
(`pairing.py` does).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils.hooks import RemovableHandle

from lightning_parallel.tensor.styles import STYLE_TRAITS, Conv1D
from lightning_parallel.tensor.torch_layers import refuse_sharded_attention
from lightning_parallel.tensor.transposed_linear import TRANSPOSED_STYLES

# attribute names an attention module keeps its per-head size under (its projections' parent)
HEAD_SIZES = ("head_dim", "attention_head_size", "head_size")
# style name -> what it does (the one-line descriptions of `styles.STYLE_TRAITS`)
STYLES: dict[str, str] = {name: traits.description for name, traits in STYLE_TRAITS.items()}


def make_style(name: str, *, sequence_parallel: bool) -> ParallelStyle | None:
    """The torch `ParallelStyle` for a style name, or None where the name means "leave as is"."""
    if name not in STYLE_TRAITS:
        raise ValueError(f"unknown tensor-parallel style {name!r}. HINT: use one of {', '.join(STYLES)}")
    return STYLE_TRAITS[name].make(sequence_parallel)


def expand_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Resolve wildcard patterns (`fnmatch` per dotted atom: `block_*.attn.q`) to exact module names.

    Raises:
        ValueError: An unknown style, a pattern that matches no module, or two styles for one module.
    """
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"tensor plan: {pattern!r} maps to unknown style {style!r}. HINT: use one of {', '.join(STYLES)}"
            )
        matched = [name for name in names if matches(pattern, name)]
        if not matched:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3) or names[:3]
            raise ValueError(
                f"tensor plan: pattern {pattern!r} matches no module of {type(model).__name__}. "
                f"HINT: module names look like {', '.join(close)}"
            )
        for name in matched:
            if resolved.get(name, style) != style:
                raise ValueError(
                    f"tensor plan: {name} is matched as {resolved[name]!r} and as {style!r} (pattern {pattern!r}). "
                    "HINT: make the patterns match disjoint modules"
                )
            resolved[name] = style
    order = {name: index for index, name in enumerate(names)}
    return dict(sorted(resolved.items(), key=lambda item: order[item[0]]))


def matches(pattern: str, name: str) -> bool:
    """Whether a plan pattern (`fnmatch` per dotted atom) names module `name`."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatchcase(part, atom) for atom, part in zip(atoms, parts, strict=True))


def check_plan(
    model: nn.Module, plan: Mapping[str, str], *, tensor_parallel_size: int, sequence_parallel: bool
) -> None:
    """Check an expanded plan against the model before anything is sharded: module types and divisibility.

    Raises:
        ValueError: One line naming the module, the size and the tensor-parallel size, with a fix.
    """
    tp = tensor_parallel_size
    modules = dict(model.named_modules())
    refuse_sharded_attention(model, plan)
    for name, style in plan.items():
        module = modules[name]
        accepts = STYLE_TRAITS[style].accepts
        if accepts is not None and not isinstance(module, accepts):
            raise ValueError(
                f"tensor plan: {name} is a {type(module).__name__}, but style {style!r} applies to "
                f"{' / '.join(t.__name__ for t in accepts)}. HINT: map {name} to another style or to 'replicate'"
            )
        if isinstance(module, Conv1D) and style in TRANSPOSED_STYLES and sequence_parallel:
            raise ValueError(
                f"tensor plan: {name} is a Conv1D (a transposed Linear), which takes {style!r} only without "
                f"sequence parallelism. HINT: set sequence_parallel=False, or map {name} to 'replicate'"
            )
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            raise ValueError(
                f"tensor plan: {name} is a Conv2d with groups={module.groups}; channel-parallel styles need "
                f"groups=1. HINT: map {name} to 'replicate'"
            )
        sharding = STYLE_TRAITS[style].sharding(module)
        if sharding is not None and getattr(module, sharding.size) % sharding.pieces:
            raise ValueError(
                f"tensor plan: {name} ({type(module).__name__}, {style}) has {sharding.size_name} "
                f"{getattr(module, sharding.size)}, not {sharding.pieces} equal blocks. HINT: map {name} to "
                "'colwise_gather' or 'replicate'"
            )
        for what, size in sharded_sizes(style, module, _parent(modules, name)):
            if size % tp != 0:
                fits = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
                raise ValueError(
                    f"tensor plan: {name} ({type(module).__name__}, {style}) has {what} {size}, not divisible by "
                    f"tensor_parallel_size {tp}. HINT: use tensor_parallel_size in {fits}, or map {name} to 'replicate'"
                )
    _check_ties(model, plan)
    if sequence_parallel and not any(STYLE_TRAITS[style].sequence_only for style in plan.values()):
        raise ValueError(
            f"sequence_parallel=True, but the plan for {type(model).__name__} has no 'sequence_parallel' entries. "
            "HINT: set sequence_parallel=False, or map the norms between blocks to 'sequence_parallel'"
        )


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The qualified names of each parameter the model holds under more than one name (a tied embedding and head)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """After sharding, make each group's names one parameter again: each planned module got its own copy."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner, _, key = name.rpartition(".")
            setattr(model.get_submodule(owner), key, param)


def _check_ties(model: nn.Module, plan: Mapping[str, str]) -> None:
    """A tied parameter is split the same way under each of its names, or stays whole under all of them."""
    for group in tied_groups(model):
        splits: dict[str, int | None] = {}
        for name in group:
            owner, _, key = name.rpartition(".")
            style = plan.get(owner)
            traits = STYLE_TRAITS[style] if style is not None else None
            splits[name] = traits.sharded_parameters(model.get_submodule(owner)).get(key) if traits else None
        if len(set(splits.values())) > 1:
            found = ", ".join(f"{n} {'whole' if d is None else f'split on dim {d}'}" for n, d in splits.items())
            raise ValueError(
                f"tensor plan: {' and '.join(group)} are one tied parameter, but the plan splits it differently "
                f"({found}). HINT: map their modules alike (an embedding 'vocab_parallel' with its head "
                "'colwise_gather'), or both to 'replicate'"
            )


def _parent(modules: dict[str, nn.Module], name: str) -> nn.Module | None:
    return modules.get(name.rpartition(".")[0]) if "." in name else None


def sharded_sizes(style: str, module: nn.Module, parent: nn.Module | None) -> list[tuple[str, int]]:
    """(what, size) pairs that the tensor-parallel size must divide for this style."""
    traits = STYLE_TRAITS[style]
    sharding = traits.sharding(module)
    if sharding is None:
        return traits.sizes(module) if traits.sizes is not None else []
    size = getattr(module, sharding.size)
    block = size // sharding.pieces  # a packed projection (q | k | v) is split block by block
    what = sharding.size_name if sharding.pieces == 1 else f"{sharding.size_name} {size} = {sharding.pieces} x"
    sizes = [(what, block)]
    head_dim = next((v for key in HEAD_SIZES if isinstance(v := getattr(parent, key, None), int)), None)
    if isinstance(module, nn.Linear | Conv1D) and head_dim and block % head_dim == 0:  # whole heads per rank
        sizes.append(("attention heads", block // head_dim))
    return sizes


def apply_plan(model: nn.Module, plan: Mapping[str, str], mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard `model` in place over the 1-D tensor-parallel `mesh` as an expanded, checked plan says.

    Ranks must already hold identical weights (the strategy broadcasts them), so shards are cut locally.
    """
    styles: dict[str, ParallelStyle | None] = {}
    for name, style in plan.items():
        if isinstance(model.get_submodule(name), Conv1D) and style in TRANSPOSED_STYLES:
            styles[name] = TRANSPOSED_STYLES[style]()  # without sequence parallelism (`check_plan`)
        else:
            styles[name] = make_style(style, sequence_parallel=sequence_parallel)
    active = {name: style for name, style in styles.items() if style is not None}
    if active:
        parallelize_module(model, mesh, active, src_data_rank=None)


def sharding_first(plan: Mapping[str, str]) -> list[str]:
    """The planned module names, those whose style splits parameters first: set-up materialises one planned module
    at a time, and a style that splits none ("local_heads" on an attention module) would otherwise give storage to
    the whole module before its projections are sharded."""
    return sorted(plan, key=lambda name: not STYLE_TRAITS[plan[name]].shardings)


def keep_gradients_sharded(model: nn.Module) -> list[RemovableHandle]:
    """Give a DTensor parameter's gradient the parameter's own placements as it is accumulated.

    An embedding under torch's own `RowwiseParallel` (not our "vocab_parallel", `vocab_embedding.py`) gets its
    gradient back replicated, vocabulary x width on every rank (torch 2.13); Replicate -> Shard is a local slice, so
    that hook never communicates inside backward. Inside traced pipeline stages
    (`traced_stages.py`) a Replicate parameter's gradient may come back Partial: it is all-reduced here. Register
    after the last `Module.to()`: it swaps DTensor parameters' contents (`swap_tensors`) and their hooks go with them.
    """
    return [param.register_post_accumulate_grad_hook(_place_gradient) for param in model.parameters()
            if isinstance(param, DTensor)]  # fmt: skip


def _place_gradient(param: torch.Tensor) -> None:
    grad = param.grad
    # the hook is registered on DTensor parameters only
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)
