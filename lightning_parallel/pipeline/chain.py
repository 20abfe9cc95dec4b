"""Rewrite torch's traced pipeline split (a graph of stage submodules) as a chain: stage i reads only stage
i-1's outputs and passes on every value a later stage still needs.

``torch.distributed.pipelining.pipeline`` lets a stage read any earlier stage's values (a skip connection that
jumps a stage) and emit network outputs from any stage; ``PipelineStage`` and every schedule layout here assume
neighbours only. Pure graph surgery: no tracing, no parameters, no devices.
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from lightning_parallel.pipeline.stage_gradients import no_gradient


@dataclass(frozen=True)
class StageFlow:
    """The values one traced stage exchanges, named by nodes of torch's top-level split graph.

    Args:
        args: What the traced stage module takes, in its placeholder order.
        results: The values it produces: name -> index into its output tuple (None: a single output).
        live_in: What the chain stage takes: every value computed earlier and used here or later.
        live_out: What the chain stage returns (not for the last stage, which returns the network's outputs).
    """

    args: tuple[str, ...]
    results: dict[str, int | None]
    live_in: tuple[str, ...]
    live_out: tuple[str, ...]


def stage_flows(split_graph: fx.Graph) -> tuple[list[StageFlow], list[str]]:
    """Each stage's inputs and outputs in chain form, and the names of the network's flat outputs.

    Args:
        split_graph: ``Pipe.split_gm.graph``: placeholders, ``submod_*`` calls, ``getitem`` on them, one output.
    """
    defined: list[str] = []  # every value in definition order (network inputs first)
    producer: dict[str, int] = {}  # value -> index of the stage computing it (network inputs: -1)
    stages: dict[int, fx.Node] = {}
    results: dict[int, dict[str, int | None]] = {}
    for node in split_graph.nodes:
        if node.op == "placeholder":
            producer[node.name] = -1
        elif node.op == "call_module":
            index = stage_index(node)
            stages[index], results[index] = node, {}
            if not node.users or any(user.target is not operator.getitem for user in node.users):
                results[index][node.name] = None
                producer[node.name] = index
        elif node.op == "call_function" and node.target is operator.getitem:
            index = stage_index(node.args[0])  # type: ignore[arg-type]
            results[index][node.name] = node.args[1]  # type: ignore[assignment]
            producer[node.name] = index
        elif node.op != "output":
            raise RuntimeError(f"unexpected node {node.format_node()} in torch's split graph. HINT: report this.")
        if node.name in producer:
            defined.append(node.name)
    if sorted(stages) != list(range(len(stages))):
        raise RuntimeError(f"torch's split graph calls stages {sorted(stages)}. HINT: report this.")
    outputs = _node_names(split_graph.output_node().args[0])
    uses = [_node_names((stages[index].args, stages[index].kwargs)) for index in range(len(stages))]
    flows = []
    for index in range(len(stages)):
        later = {name for used in uses[index + 1 :] for name in used} | set(outputs)
        # stage 0 takes every network input, used or not: the schedule hands it the whole micro-batch
        live_in = [n for n in defined if producer[n] < index and (index == 0 or n in later or n in uses[index])]
        live_out = [n for n in defined if producer[n] <= index and n in later]
        flows.append(StageFlow(tuple(uses[index]), results[index], tuple(live_in), tuple(live_out)))
    return flows, outputs


def stage_index(node: fx.Node) -> int:
    """The stage a ``submod_pp_<i>`` call of torch's split graph computes. The graph may call stages out of order (a
    stage nothing reads yet comes first: GPT-NeoX's rotary embedding before the dropout after its token embedding),
    and ``Pipe.get_stage_module(i)`` is by this number, so the chain follows it, not the call order."""
    index = node.meta.get("stage_idx")
    return int(index) if index is not None else int(str(node.target).rsplit("_", 1)[1])


def _node_names(arg: fx.node.Argument) -> list[str]:
    found: list[str] = []
    fx.node.map_arg(arg, lambda node: found.append(node.name))
    return found


def to_chain_stage(
    module: fx.GraphModule,
    flow: StageFlow,
    *,
    outputs: list[str] | None,
    out_spec: pytree.TreeSpec | None,
    scalars: frozenset[int] = frozenset(),
    detached: Collection[str] = (),
) -> fx.GraphModule:
    """Rewrite one traced stage, in place, to take ``flow.live_in`` and return ``flow.live_out``.

    Values only passed through come back as the input tensors (autograd routes their gradient through unchanged).
    The inputs named in ``detached`` (no gradient needed: `stage_gradients.needing_gradient`) are detached first: the
    stage saves nothing for their backward, computes no gradient for them and hands them on without one. Every other
    input's gradient and every value handed to the next stage is made contiguous (`contiguous_gradient`,
    `contiguous`): stages exchange them through gloo / NCCL, which take contiguous tensors only. With ``outputs``
    (the last stage) it returns the network's output tensors instead: the tensor when ``out_spec`` is a single
    tensor, else their flat tuple, which ``rebuild_output`` turns back into the network's own structure. The outputs
    at the ``scalars`` indices (a loss) leave as shape (1,): a forward-only schedule concatenates each output over
    micro-batches, which a 0-d tensor does not allow.
    """
    graph = module.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    if len(placeholders) != len(flow.args):
        raise RuntimeError(
            f"traced stage has {len(placeholders)} inputs but the split graph passes {len(flow.args)}. "
            "HINT: report this with the network's forward."
        )
    value_node: dict[str, fx.Node] = {}
    for node, name in zip(placeholders, flow.args, strict=True):
        if name in value_node:  # one value passed twice: keep one input
            node.replace_all_uses_with(value_node[name])
            graph.erase_node(node)
        else:
            value_node[name] = node
    body = next(node for node in graph.nodes if node.op != "placeholder")
    for name in flow.live_in:
        if name not in value_node:
            with graph.inserting_before(body):
                value_node[name] = graph.placeholder(f"carry_{name}")
        body.prepend(value_node[name])  # placeholders in live_in order
    for name in flow.live_in:
        if name in detached:  # handed on detached too: the next stage gives it no gradient either
            value_node[name] = _wrap_uses(graph, value_node[name], no_gradient, before=body)
        else:
            _wrap_uses(graph, value_node[name], contiguous_gradient, before=body)
    output = graph.output_node()
    produced = output.args[0]
    for name, index in flow.results.items():
        value_node[name] = _result(produced, index)
    if outputs is None:
        with graph.inserting_before(output):
            returned = tuple(graph.call_function(contiguous, (value_node[name],)) for name in flow.live_out)
        output.args = (returned[0] if len(returned) == 1 else returned,)
    else:
        leaves = tuple(value_node[name] for name in outputs)
        with graph.inserting_before(output):
            leaves = tuple(
                graph.call_function(torch.unsqueeze, (v, 0)) if i in scalars else v for i, v in enumerate(leaves)
            )
        output.args = (leaves[0] if out_spec is not None and out_spec.is_leaf() else leaves,)
    graph._codegen = fx.graph.CodeGen()  # plain positional signature, no pytree in/out specs
    graph.lint()
    module.recompile()
    return module


def _wrap_uses(graph: fx.Graph, node: fx.Node, function: object, *, before: fx.Node) -> fx.Node:
    """Route every use of `node` through `function(node)`, inserted before `before`; returns that call."""
    with graph.inserting_before(before):
        wrapped = graph.call_function(function, (node,))  # type: ignore[arg-type]
    node.replace_all_uses_with(wrapped, delete_user_cb=lambda user: user is not wrapped)
    return wrapped


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous. `PipelineStage` receives a stage input's gradient
    into a buffer with the strides that gradient had at shape inference, and gloo refuses a non-contiguous one ("input
    tensor has to be contiguous": `nn.MultiheadAttention` with batch_first transposes its input, and the gradient
    comes back transposed)."""

    @staticmethod
    def forward(ctx: object, value: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return value.view_as(value)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def contiguous_gradient(value: object) -> object:
    """A chain stage's input, unchanged, whose gradient leaves the stage contiguous (see `_ContiguousGradient`)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return _ContiguousGradient.apply(value)
    return value


def contiguous(value: object) -> object:
    """A value a chain stage hands to the next one, contiguous: its receive buffer gets the strides it has."""
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def rebuild_output(output: object, out_spec: pytree.TreeSpec | None, scalars: frozenset[int] = frozenset()) -> object:
    """The network's own output (a tuple, dict, ``ModelOutput`` or any registered pytree) from what its last chain
    stage returns: one tensor, or the flat tuple of the output's tensors. The ``scalars`` (shape (1,) for one
    micro-batch, (micro-batches,) once a forward-only schedule merged them) become their mean: the batch's value for
    a per-micro-batch mean such as a model's loss, since micro-batches are equal in size.

    Outside the stage because ``PipelineStage`` takes only a tensor or a tuple of tensors from a stage, and fx would
    write a dict-like output as a plain dict anyway, losing a ``ModelOutput``'s type and attributes (``out.loss``).
    """
    if out_spec is None:
        return output
    leaves = list(output) if isinstance(output, (tuple, list)) and not out_spec.is_leaf() else [output]
    leaves = [leaf.mean() if i in scalars else leaf for i, leaf in enumerate(leaves)]  # type: ignore[attr-defined]
    return leaves[0] if out_spec.is_leaf() else pytree.tree_unflatten(leaves, out_spec)


def _result(produced: fx.node.Argument, index: int | None) -> fx.Node:
    """One value a traced stage returns: its whole output (``index`` None) or one item of its output tuple."""
    value = produced if index is None else produced[index] if isinstance(produced, (tuple, list)) else None
    if not isinstance(value, fx.Node):
        raise RuntimeError(f"traced stage output {produced} has no node at {index}. HINT: report this.")
    return value


def retarget_device(module: torch.nn.Module, device: torch.device) -> None:
    """Replace the ``meta`` device baked into traced ops (``torch.arange(n, device=x.device)``) by ``device``."""

    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        hits: list[torch.device] = []

        def swap(arg: fx.node.Argument, hits: list[torch.device] = hits) -> fx.node.Argument:
            if isinstance(arg, torch.device) and arg.type == "meta":
                hits.append(arg)
                return device
            return arg

        for node in graph.nodes:
            args, kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(node.kwargs, swap)
            if hits:
                node.args, node.kwargs = args, kwargs
        finalize = getattr(sub, "finalize", None)
        if hits and isinstance(sub, fx.GraphModule):
            sub.recompile()
        elif hits and callable(finalize):
            finalize()  # InterpreterModule: rebuild its codegen fallback too
