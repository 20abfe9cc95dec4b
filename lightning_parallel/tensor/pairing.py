"""The automatic tensor plan: pair layers along the `torch.fx`-traced data flow, column-parallel then row-parallel,
where the activation between them only passes through ops that act per feature or per channel.

It shards nothing and knows no mesh: the plan it returns is checked and applied like a hand-written one (`plans.py`).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from lightning_parallel.tensor.styles import STYLE_TRAITS
from lightning_parallel.tensor.torch_layers import feed_forward_plan

# Ops that act on each element alone, so a feature- or channel-sharded activation passes through them unchanged.
_ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Hardswish,
    nn.Hardtanh, nn.Softplus, nn.Dropout, nn.Identity,
)  # fmt: skip
_ELEMENTWISE_FUNCTIONS = {F.relu, F.relu6, F.gelu, F.silu, F.leaky_relu, F.elu, F.mish, F.hardswish, F.hardtanh,
                          F.softplus, F.dropout, torch.relu, torch.tanh, torch.sigmoid}  # fmt: skip
_ELEMENTWISE_METHODS = {"relu", "tanh", "sigmoid"}
# Ops on (B, C, H, W) that keep each channel to itself: a channel-sharded feature map passes through them.
_CHANNELWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.LPPool2d, nn.Dropout2d,
)  # fmt: skip
_CHANNELWISE_FUNCTIONS = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.dropout2d}


@dataclass(frozen=True)
class AutoPlan:
    """A plan found by `auto_plan`: the plan itself and, for each module left whole, the reason."""

    plan: dict[str, str]
    replicated: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Pair:
    column: str
    row: str
    styles: dict[str, str]  # every module the pair shards -> its style, norms between the two included
    sharded: int  # parameters the pair splits: what the choice between overlapping pairs maximises


def auto_plan(model: nn.Module, *, tensor_parallel_size: int) -> AutoPlan:
    """Pair layers column-parallel -> row-parallel where only per-feature or per-channel ops lie between them.

    Pairs: Linear -> Linear (BatchNorm1d between them sharded by feature); Conv2d -> Conv2d (BatchNorm2d, pooling
    between them sharded by channel); Conv2d -> flatten -> Linear, whose input columns are laid out channel-major,
    so a rank's output channels are one contiguous block of them ("rowwise_from_channels"). The data flow comes
    from a `torch.fx` trace, not from attribute order, so parallel branches (q, k, v) are never paired. Where pairs
    overlap along a chain (conv1 -> conv2 -> fc1 -> fc2), the choice that shards the most parameters wins. Every
    other module with parameters stays replicated, with the reason recorded.

    Raises:
        ValueError: The model cannot be traced, or no pair can be sharded; the message names each module and why.
    """
    tp = tensor_parallel_size
    layers, layers_whole = feed_forward_plan(model, tensor_parallel_size=tp)  # torch's transformer layers (fx leaves)
    try:
        graph = fx.symbolic_trace(model).graph
    except Exception as error:  # fx raises many types (TraceError, TypeError, ...) for untraceable code
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if layers:  # the layers' pairs need no trace; the rest of the model stays whole
            rest = f"torch.fx cannot trace {type(model).__name__} ({reason}): only torch's transformer layers planned"
            return AutoPlan(plan=layers, replicated={**layers_whole, "": rest})
        raise ValueError(
            f"automatic tensor plan: torch.fx cannot trace {type(model).__name__} ({reason}). "
            "HINT: give the model a `tp_plan` dict or pass plan={'<module pattern>': 'colwise', ...}"
        ) from error
    modules = dict(model.named_modules())
    calls = Counter(str(node.target) for node in graph.nodes if node.op == "call_module")
    pairs: dict[str, _Pair] = {}
    why: dict[str, str] = {}
    for node in graph.nodes:
        if isinstance(_called(node, modules), nn.Linear | nn.Conv2d):
            found = _pair_from(node, modules, calls, tp)
            if isinstance(found, _Pair):
                pairs[found.column] = found
            else:
                why.setdefault(str(node.target), found)
    order = {name: index for index, name in enumerate(modules)}
    why.update(layers_whole)
    plan = dict(sorted({**_best_pairs(pairs, why), **layers}.items(), key=lambda item: order[item[0]]))
    replicated = {name: reason for name, reason in why.items() if name not in plan}
    for name, module in modules.items():
        if name not in plan and name not in replicated and any(True for _ in module.parameters(recurse=False)):
            replicated[name] = _unpaired_reason(module)
    if not plan:
        reasons = (
            "; ".join(f"{name or 'the network itself'}: {why}" for name, why in replicated.items())
            or "it has no Linear layers"
        )
        raise ValueError(
            f"automatic tensor plan found nothing to shard in {type(model).__name__} at tensor_parallel_size {tp} "
            f"({reasons}). HINT: pass plan={{'<module pattern>': '<style>'}} with styles from "
            "lightning_parallel.tensor.STYLES"
        )
    return AutoPlan(plan=plan, replicated=replicated)


def _pair_from(node: fx.Node, modules: dict[str, nn.Module], calls: Counter[str], tp: int) -> _Pair | str:
    """The pair that `node`'s layer starts as its column-parallel half, or why there is none."""
    name, first = str(node.target), modules[str(node.target)]
    conv = isinstance(first, nn.Conv2d)
    if isinstance(first, nn.Conv2d) and first.groups != 1:
        return _grouped_reason(first)
    width, what = (
        (first.out_channels, "out_channels") if isinstance(first, nn.Conv2d) else (_out_features(first), "hidden size")
    )
    walked = _walk(node, modules, conv=conv)
    if isinstance(walked, str):
        layer = "Conv2d or flattening Linear" if conv else "Linear"
        return f"no single {layer} consumes its output through {'channel' if conv else 'element'}-wise ops ({walked})"
    partner, row_style, norms = walked
    row = str(partner.target)
    for member in (name, row, *norms):
        if calls[member] > 1:
            return f"{member} is called {calls[member]} times; a sharded layer must be called once"
    if width % tp != 0:
        return f"{what} {width} not divisible by {tp}"
    for norm in norms:
        if modules[norm].num_features != width:
            return f"{norm} normalises {modules[norm].num_features} features, not the {width} of {name}"
    styles = {name: "conv_colwise" if conv else "colwise", **dict.fromkeys(norms, "batchnorm_sharded"), row: row_style}
    split = [
        modules[member].get_parameter(key)
        for member, style in styles.items()
        for key in STYLE_TRAITS[style].sharded_parameters(modules[member])
    ]
    return _Pair(column=name, row=row, styles=styles, sharded=sum(p.numel() for p in split))


def _walk(node: fx.Node, modules: dict[str, nn.Module], *, conv: bool) -> tuple[fx.Node, str, list[str]] | str:
    """Follow `node`'s output through single-use per-feature (per-channel) ops to the layer that alone consumes it:
    (that layer's node, its row-parallel style, the norms passed on the way), or where the walk stopped."""
    norm_type = nn.BatchNorm2d if conv else nn.BatchNorm1d
    norms: list[str] = []
    flattened = False
    current = node
    while True:
        users = [user for user in current.users if not _reads_batch_size(user)]
        if len(users) != 1:
            return f"its output has {len(users)} consumers" if users else "its output is unused"
        user = users[0]
        if user.op == "output":
            return "its output is the model's output"
        if user.args[:1] != (current,) or any(_is_data(a) for a in [*user.args[1:], *user.kwargs.values()]):
            return f"{_label(user)} takes other tensors too"
        called = _called(user, modules)
        if isinstance(called, nn.Conv2d):
            if not conv or flattened:
                return f"{user.target} is a Conv2d after a {'flatten' if flattened else 'Linear'}"
            if called.groups != 1:
                return f"{user.target}: {_grouped_reason(called)}"
            return user, "conv_rowwise", norms
        if isinstance(called, nn.Linear):
            if conv and not flattened:
                return f"{user.target} is a Linear on an unflattened feature map"
            return user, "rowwise_from_channels" if conv else "rowwise", norms
        if type(called) is norm_type and not flattened:
            norms.append(str(user.target))
        elif conv and not flattened and _is_flatten(user, modules):
            flattened = True  # (B, C / tp, H, W) -> (B, C / tp * H * W): one contiguous block of the C * H * W
        elif not (_is_elementwise(user, called) or (conv and not flattened and _is_channelwise(user, called))):
            return f"stops at {_label(user)}"
        current = user


def _best_pairs(pairs: dict[str, _Pair], why: dict[str, str]) -> dict[str, str]:
    """Pairs that share no layer, the most parameters sharded; records why each layer left out of a chain is."""
    rows = {pair.row for pair in pairs.values()}
    plan: dict[str, str] = {}
    for start in (name for name in pairs if name not in rows):
        chain = [pairs[start]]  # each layer starts at most one pair and ends at most one: chains, not trees
        while chain[-1].row in pairs:
            chain.append(pairs[chain[-1].row])
        # Best total over the first i pairs, taking pair i-1 or not (neighbours share a layer).
        best = [0, chain[0].sharded]
        for index in range(1, len(chain)):
            best.append(max(best[-1], best[-2] + chain[index].sharded))
        index = len(chain)
        while index > 0:
            if best[index] == best[index - 1]:
                index -= 1
                continue
            plan.update(chain[index - 1].styles)
            index -= 2
        for pair in chain:
            for layer in (pair.column, pair.row):
                if layer not in plan:
                    why[layer] = f"pairing {pair.column} -> {pair.row} loses to neighbouring pairs that shard more"
    return plan


def _unpaired_reason(module: nn.Module) -> str:
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return _grouped_reason(module)
    return f"{type(module).__name__} is not part of a column -> row pair"


def _grouped_reason(conv: nn.Conv2d) -> str:
    return f"Conv2d with groups={conv.groups}: the channel-parallel styles split only groups=1 convolutions"


def _out_features(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else 0


def _called(node: fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    return modules[str(node.target)] if node.op == "call_module" else None


def _is_data(value: object) -> bool:
    """Whether an argument carries a tensor from the graph; the batch size (dim 0 is never sharded) does not."""
    return isinstance(value, fx.Node) and not _is_batch_size(value)


def _is_batch_size(node: fx.Node) -> bool:
    """`x.size(0)`, `x.size()[0]` or `x.shape[0]` of any tensor."""
    if node.op == "call_method" and node.target == "size":
        return node.args[1:] == (0,) or node.kwargs == {"dim": 0}
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        source = node.args[0]
        return isinstance(source, fx.Node) and (
            (source.op == "call_method" and source.target == "size" and len(source.args) == 1)
            or (source.op == "call_function" and source.target is getattr and source.args[1] == "shape")
        )
    return False


def _reads_batch_size(user: fx.Node) -> bool:
    """A metadata read of the batch size, not a consumer of the data: `x.size(0)`, or `x.shape` / `x.size()` used
    only to index dim 0."""
    if _is_batch_size(user):
        return True
    shape = (user.op == "call_method" and user.target == "size" and len(user.args) == 1 and not user.kwargs) or (
        user.op == "call_function" and user.target is getattr and user.args[1] == "shape"
    )
    return shape and all(_is_batch_size(reader) for reader in user.users)


def _is_flatten(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Flattening everything after the batch dimension, channel-major: the only flatten a channel shard survives."""
    called = _called(node, modules)
    if isinstance(called, nn.Flatten):
        return bool(called.start_dim == 1 and called.end_dim == -1)
    if (node.op == "call_function" and node.target is torch.flatten) or (
        node.op == "call_method" and node.target == "flatten"
    ):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return bool(start == 1 and end == -1)
    if node.op == "call_method" and node.target in ("view", "reshape"):
        shape = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], tuple | list) else node.args[1:]
        return bool(len(shape) == 2 and isinstance(shape[0], fx.Node) and _is_batch_size(shape[0]) and shape[1] == -1)
    return False


def _is_elementwise(node: fx.Node, called: nn.Module | None) -> bool:
    return (
        isinstance(called, _ELEMENTWISE_MODULES)
        or (node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS)
        or (node.op == "call_method" and node.target in _ELEMENTWISE_METHODS)
    )


def _is_channelwise(node: fx.Node, called: nn.Module | None) -> bool:
    return isinstance(called, _CHANNELWISE_MODULES) or (
        node.op == "call_function" and node.target in _CHANNELWISE_FUNCTIONS
    )


def _label(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    return f"{node.op} {getattr(node.target, '__name__', node.target)}"
