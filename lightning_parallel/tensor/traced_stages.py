"""Tensor parallelism inside traced pipeline stages: a plan's layers hold DTensor shards and each traced stage
(a torch.fx graph of aten ops) runs on DTensors with global shapes, so the shapes its trace baked in stay valid.

Why DTensor propagation rather than torch's `parallelize_module` styles: a traced stage never calls the real
modules' forwards (the graph inlines `aten.linear`, `aten.conv2d`, ...), so the styles' input/output hooks would
never fire; and the trace bakes in global shapes (`view(B, T, heads, head_dim)`, `split(C)`, `flatten` to C * H * W),
which local shards would break. So the parameters a plan names become DTensors with the placements the style table
gives (`styles.STYLE_TRAITS`: colwise = Shard(0) of a Linear's weight and bias, rowwise = Shard(1) of its weight,
qkv_colwise an interleaved `_StridedShard`, conv_colwise / conv_rowwise / batchnorm_sharded by channel, ...; other
parameters of a planned module Replicate; "local_heads" does nothing here, since the graphs keep global shapes),
and `run_on_mesh` rewrites each stage's graphs in place: the stage's inputs, every tensor its graphs read or create
(plain parameters, buffers, `arange` masks) become Replicate DTensors on the "tp" mesh, and its outputs leave as
plain, whole tensors. DTensor's sharding propagation then computes every op with global shapes, as one process
would, and inserts the collectives (all-reduce of a rowwise layer's partial sums, all-gather where a view or split
crosses a sharded dimension). Parity is exact up to summation order; ops DTensor cannot shard correctly are
replaced: Conv2d and BatchNorm with channel-sharded parameters run on local shards (DTensor shards convolutions
spatially only), scaled-dot-product attention on each rank's heads when q, k and v arrive split by heads, else
whole on every rank (`traced_attention.py`; torch 2.13 has no DTensor rule for its CPU backward),
dropout reduces partial sums before it draws; a planned linear (`aten.linear`) or transformers `Conv1D` (`aten.addmm`)
takes and leaves no partial sums, a row-parallel one its input split (so weight gradients are shards,
`traced_linear.py`); a `vocab_head` takes its input whole, a cross-entropy on its logits runs on their vocabulary
shards in a step's `ShardedLogits` session (`vocab_loss.py`), and in a session the stage holding it returns them
split by vocabulary (`sharded_logits.handed_on`), for the loss after it; a vocabulary-sharded embedding looks up each
rank's own rows (`vocab_embedding.lookup_own_rows`).

Cost, honestly: every op goes through DTensor's eager dispatch (slower per op than plain tensors, like tp=1
DTensors on GPU), a layer whose output is split or viewed across its sharded dimension is all-gathered there (a
packed q|k|v projection's split into its blocks is not: `traced_attention.split_packed`), and gradients of
Replicate parameters that come back Partial are all-reduced in backward. Compute is saved only between a column- and
a row-parallel layer (attention included). No Lightning, no process groups beyond the mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from lightning_parallel.tensor.sharded_logits import current_session, handed_on
from lightning_parallel.tensor.styles import STYLE_TRAITS
from lightning_parallel.tensor.traced_attention import attention, split_packed
from lightning_parallel.tensor.traced_linear import head_linear, planned_addmm, planned_linear, sharded, summed
from lightning_parallel.tensor.vocab_embedding import lookup_own_rows
from lightning_parallel.tensor.vocab_loss import cross_entropy_on_shards, sharded_class_dim

if TYPE_CHECKING:
    from lightning_parallel.pipeline.runtime import StageFactory  # a type only: tensor/ imports no pipeline code

aten = torch.ops.aten
_DONE = "_lightning_parallel_tp_mesh"  # set on a traced stage once its graphs run on a mesh


def parameter_placements(module: nn.Module, style: str) -> dict[str, Placement]:
    """Placement of each of `module`'s own parameters and buffers under `style` ({} when it shards nothing)."""
    traits = STYLE_TRAITS[style]
    sharding = traits.sharding(module)
    if sharding is None:
        return {}
    placements: dict[str, Placement] = {}
    for name, _ in module.named_parameters(recurse=False):
        dim = sharding.parameters.get(name)
        placements[name] = sharding.placement(dim) if dim is not None else Replicate()
    if isinstance(module, _BatchNorm):  # running statistics are per channel, like weight and bias
        for name in ("running_mean", "running_var"):
            if module._buffers.get(name) is not None:
                placements[name] = Shard(0)
    return placements


def distribute_planned(module: nn.Module, style: str, mesh: DeviceMesh) -> None:
    """Replace `module`'s own parameters (and per-channel buffers) by DTensors placed as `style` says, in place.

    Ranks must already hold identical values: each cuts its own shard (no communication)."""
    for name, placement in parameter_placements(module, style).items():
        if name in module._parameters:
            param = module._parameters[name]
            assert param is not None  # listed by named_parameters
            value = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))
        else:
            buffer = module._buffers[name]
            assert buffer is not None  # listed by parameter_placements
            module._buffers[name] = distribute_tensor(buffer, mesh, [placement], src_data_rank=None)


def run_on_mesh(stage: nn.Module, mesh: DeviceMesh, heads: Collection[str] = ()) -> nn.Module:
    """Rewrite a traced stage's graphs in place (once) so it computes on DTensors over `mesh` and returns plain,
    whole tensors; it still takes and returns exactly what it did, so `PipelineStage` sends plain tensors. The
    modules named in `heads` (`vocab_head`s) return their logits split by vocabulary (`traced_linear.head_linear`),
    and a stage holding one returns them so inside a `ShardedLogits` session (sharded logits,
    `sharded_logits.handed_on`; its other outputs whole): the runtime passes their local shard through
    `PipelineStage` (`StageLogits`)."""
    if getattr(stage, _DONE, None) is mesh:
        return stage
    holds_head = any(name in heads for name, _ in stage.named_modules())
    for name, module in stage.named_modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        _rewrite(graph, mesh, root=name == "", head=name in heads, hands_on=holds_head)
        if isinstance(module, fx.GraphModule):
            module.recompile()
        elif callable(getattr(module, "finalize", None)):
            module.finalize()  # InterpreterModule: rebuild its codegen fallback too
    setattr(stage, _DONE, mesh)
    return stage


def stages_on_mesh(
    modules: dict[int, nn.Module], factory: StageFactory | None, mesh: DeviceMesh, heads: Collection[str] = ()
) -> tuple[dict[int, nn.Module], StageFactory | None]:
    """Traced stage modules (and those a factory traces later, per micro-batch shape) computing on DTensors over
    the "tp" `mesh`: they take and return plain tensors, as the schedule expects (`heads`: as `run_on_mesh`)."""
    on_mesh = {index: run_on_mesh(module, mesh, heads) for index, module in modules.items()}
    return on_mesh, (partial(_traced_on_mesh, factory, mesh, heads) if factory is not None else None)


def _traced_on_mesh(
    factory: StageFactory, mesh: DeviceMesh, heads: Collection[str], micro: tuple[torch.Tensor, ...]
) -> dict[int, nn.Module]:
    return {index: run_on_mesh(module, mesh, heads) for index, module in factory(micro).items()}


def _rewrite(graph: fx.Graph, mesh: DeviceMesh, *, root: bool, head: bool = False, hands_on: bool = False) -> None:
    replicate = _OnMesh(_replicate, mesh)
    whole = handed_on if hands_on else _OnMesh(_whole, mesh)  # a head's stage: its logits leave split in a session
    for node in list(graph.nodes):
        if node.op == "call_function" and head and node.target is aten.linear.default:
            node.target = head_linear
        elif node.op == "call_function" and node.target is aten.linear.default:
            node.target = planned_linear
        elif node.op == "call_function" and node.target in _REPLACED:
            node.target = _REPLACED[node.target]
        # What enters the graph from outside DTensor: the stage's inputs, tensors read by attribute (plain
        # parameters, buffers, constants) and tensors created from nothing (arange, ones): Replicate DTensors.
        source = (node.op == "placeholder" and root) or node.op == "get_attr"
        if source or (node.op == "call_function" and not node.all_input_nodes):
            with graph.inserting_after(node):
                wrapped = graph.call_function(replicate, (node,))
            node.replace_all_uses_with(wrapped, delete_user_cb=lambda user, wrapped=wrapped: user is not wrapped)
    if root:
        output = graph.output_node()

        def gathered(value: fx.Node) -> fx.Node:
            with graph.inserting_before(output):
                return graph.call_function(whole, (value,))

        output.args = fx.node.map_arg(output.args, gathered)
    graph.lint()


class _OnMesh:
    """A graph target bound to the mesh; fx code generation needs a `__name__` (a `partial` has none)."""

    def __init__(self, function: Callable[..., Any], mesh: DeviceMesh) -> None:
        self.function, self.mesh = function, mesh
        self.__name__ = function.__name__.lstrip("_")
        self.__module__ = __name__

    def __call__(self, value: Any) -> Any:
        return self.function(value, self.mesh)


def _replicate(value: Any, mesh: DeviceMesh) -> Any:
    """A plain tensor as a Replicate DTensor (differentiable: a plain parameter gets its whole gradient)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    return value


def _whole(value: Any, mesh: DeviceMesh) -> Any:
    """A DTensor as the plain, whole tensor (all-gathered or all-reduced as its placement needs)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _mesh_of(*values: Any) -> DeviceMesh | None:
    return next((v.device_mesh for v in pytree.tree_leaves(values) if isinstance(v, DTensor)), None)


def _local(tensor: Any) -> Any:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _conv2d(x: Any, weight: Any, bias: Any = None, *rest: Any) -> Any:
    """`aten.conv2d` with channel-sharded weights on local shards (as `conv.py`'s styles); otherwise DTensor's."""
    if not sharded(weight):
        return aten.conv2d.default(x, weight, bias, *rest)
    mesh = weight.device_mesh
    if weight.placements[0] == Shard(0):  # conv_colwise: whole input, this rank's output channels
        # identity forward; backward, each rank's input gradient covers only its output channels: Partial
        local_x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])  # (B, C_in, H, W)
        out = aten.conv2d.default(local_x, weight.to_local(), _local(bias), *rest)  # (B, C_out / tp, H', W')
        return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)
    local_x = x.redistribute(mesh, [Shard(1)]).to_local()  # conv_rowwise: (B, C_in / tp, H, W)
    partial_sum = aten.conv2d.default(local_x, weight.to_local(), None, *rest)  # (B, C_out, H', W'), this rank's part
    out = DTensor.from_local(partial_sum, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
    return out if bias is None else out + bias.view(1, -1, 1, 1)


def _batch_norm(x: Any, weight: Any, bias: Any, mean: Any, var: Any, *rest: Any) -> Any:
    """`aten.batch_norm` with channel-sharded parameters and statistics on local shards (statistics are per
    channel: no communication; running statistics update in place on this rank's shard)."""
    if not (sharded(weight) or sharded(mean)):
        mesh = _mesh_of(x, weight, mean)
        if mesh is None:
            return aten.batch_norm.default(x, weight, bias, mean, var, *rest)
        # whole on every rank, computed locally: the same result as DTensor's replicated rule, which torch 2.11 lacks
        whole_x = x.redistribute(mesh, [Replicate()]).to_local() if isinstance(x, DTensor) else x
        out = aten.batch_norm.default(whole_x, _local(weight), _local(bias), _local(mean), _local(var), *rest)
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False)
    mesh = _mesh_of(weight, mean)
    assert mesh is not None
    local_x = x.redistribute(mesh, [Shard(1)]).to_local()  # (B, C / tp, ...)
    out = aten.batch_norm.default(local_x, _local(weight), _local(bias), _local(mean), _local(var), *rest)
    return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)


def _embedding(weight: Any, indices: Any, padding_idx: int = -1, *rest: Any) -> Any:
    """`aten.embedding` on a vocabulary-sharded table (vocab_parallel): the style's own lookup of each rank's rows
    (`vocab_embedding.lookup_own_rows`: the gradient stays the rank's rows), the partial lookups summed at once.
    DTensor's own rule leaves a masked partial that an op after it (a dtype cast) cannot sum, and whose backward it
    cannot build."""
    if not (sharded(weight) and weight.placements[0] == Shard(0)) or any(rest):  # rest: scale_grad_by_freq, sparse
        return aten.embedding.default(weight, indices, padding_idx, *rest)
    out = lookup_own_rows(weight, indices, padding_idx if padding_idx >= 0 else None)
    return out.redistribute(weight.device_mesh, [Replicate()])


def _cross_entropy(
    input: Any, target: Any, weight: Any = None, reduction: int = 1, ignore_index: int = -100, smoothing: float = 0.0
) -> Any:
    """`aten.cross_entropy_loss` (transformers' loss from `labels`, a traced `F.cross_entropy`): on logits split by
    vocabulary (a `vocab_head`'s) inside a `ShardedLogits` session, the vocabulary-parallel loss (`vocab_loss.py`,
    counted by the session); anything else as DTensor computes it, on the logits gathered."""
    session = current_session()
    plain = weight is None and not smoothing and isinstance(target, DTensor) and not target.is_floating_point()
    if session is None or not plain or sharded_class_dim(input) is None:
        return aten.cross_entropy_loss.default(input, target, weight, reduction, ignore_index, smoothing)
    session.counts.parallel += 1
    how = ("none", "mean", "sum")[reduction]
    loss = cross_entropy_on_shards(input, target.full_tensor(), ignore_index=ignore_index, reduction=how)
    return DTensor.from_local(loss, input.device_mesh, [Replicate()], run_check=False)  # the same on every rank


def _reduced_first(op: Callable[..., Any]) -> Callable[..., Any]:
    """`op` (dropout) on its input with partial sums reduced first, by the one reduction a planned layer's input gets
    too (`traced_linear.summed`, its gradient summed): DTensor has no rule that draws a mask over partial sums
    (`aten.bernoulli_` on a Partial), and dropping parts of a sum is not dropping the sum. Replicate and Shard inputs
    go to DTensor's rule as they are (on the CPU each rank draws from its own generator, seeded alike:
    tensor-parallel peers draw the same masks)."""

    def reduced_first(x: Any, *rest: Any) -> Any:
        return op(summed(x), *rest)

    reduced_first.__name__ = f"reduced_first_{op.__name__.replace('.', '_')}"  # fx code generation needs a name
    return reduced_first


def _assert_local_metadata(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """torch.export's dtype/device check, on the local tensor (DTensor has no rule for it)."""
    return aten._assert_tensor_metadata.default(_local(tensor), *args, **kwargs)


_REPLACED: dict[Any, Callable[..., Any]] = {
    aten.conv2d.default: _conv2d,
    aten.batch_norm.default: _batch_norm,
    aten.scaled_dot_product_attention.default: attention,
    aten.split.Tensor: split_packed,
    aten.embedding.default: _embedding,
    aten.addmm.default: planned_addmm,
    aten._assert_tensor_metadata.default: _assert_local_metadata,
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.dropout.default: _reduced_first(aten.dropout.default),
    aten.native_dropout.default: _reduced_first(aten.native_dropout.default),
}
