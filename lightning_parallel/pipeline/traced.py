"""Split any ``nn.Module`` (custom ``forward`` included) into pipeline stages with torch's tracing frontend,
``torch.distributed.pipelining.pipeline``, traced per micro-batch shape, modes and device, on a meta-device copy.

No process groups, schedules or Lightning here. ``chain.py`` turns torch's split into neighbour-only stages,
``traced_blocks.py`` finds the blocks and their costs, ``rebind.py`` binds traced stages to a rank's real, pruned
network, ``traced_constants.py`` gives them the tensors a forward creates from Python values, ``trace_errors.py``
words what the tracer cannot follow as one line naming the user's source line.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.utils import _pytree as pytree

from lightning_parallel.pipeline.balance import split_explicit
from lightning_parallel.pipeline.call import NetworkCall
from lightning_parallel.pipeline.chain import rebuild_output, retarget_device, stage_flows, to_chain_stage
from lightning_parallel.pipeline.rebind import canonical_names, meta_copy, rebind, shared_copy, tensor_aliases
from lightning_parallel.pipeline.stage_gradients import needing_gradient
from lightning_parallel.pipeline.trace_errors import check_boundary, explain_failure
from lightning_parallel.pipeline.traced_blocks import find_blocks, flop_costs, outside_blocks, prune_children
from lightning_parallel.pipeline.traced_constants import constant_values, fill_constants, traced_constants
from lightning_parallel.pipeline.traced_sharing import offer, signature, template_for
from lightning_parallel.seams import refuse_older_torch, transformer_masks_as_given

__all__ = ["TracedNetwork", "check_traceable", "prune_children"]  # prune_children: also reached from here


class TracedNetwork:
    """A network's split units ("blocks"), their FLOP costs, and traced stages bound to the real network.

    Build it before pruning: it keeps a meta-device copy of the whole network (no real storage is copied)
    and traces that copy once per (split, micro-batch shape, train/eval modes, device), because a trace
    bakes in the batch size (``x.view(x.size(0), -1)``), the training mode (BatchNorm, dropout,
    ``if self.training``) and devices of created tensors.

    Args:
        network: The full network, real or on the meta device.
        example_inputs: One example batch (a tensor or a tuple of tensors), any device.
        call: How those tensors are passed (positional, keywords, constant flags; ``call.py``); every tensor
            positional when None. Each tensor is a separate input of the trace even when the caller passed one
            tensor twice (``input_ids=ids, labels=ids``): torch's export would merge them into one input and
            leave the other unused.

    Attributes:
        blocks: Qualified names of the modules the network's ``forward`` calls exactly once, in call order
            (top-level children, or ``layers.0`` for items of a ``ModuleList``): the possible split points. A
            child whose own forward runs a stack of layers is opened up (``traced_blocks.find_blocks``): a Hugging Face
            ``GPT2LMHeadModel`` gives ``transformer.wte``, ..., ``transformer.h.0``, ..., ``lm_head``.
        costs: Forward + backward FLOPs per block for the example batch, including the functional ops
            that follow the block up to the next one (what a stage starting at that block computes).
    """

    signature: tuple  # what its traces depend on (`traced_sharing.signature`)
    _copies: bool  # stage modules are copies of the cached traces (`sharing_traces`), not the traces themselves

    def __init__(
        self,
        network: nn.Module,
        example_inputs: torch.Tensor | Sequence[torch.Tensor],
        call: NetworkCall | None = None,
    ) -> None:
        inputs = _as_inputs(example_inputs)
        call = call if call is not None else NetworkCall(len(inputs))
        template = template_for(network, inputs, call)  # `sharing_traces()`: one trace for like networks
        if template is not None:
            self.__dict__.update(template.__dict__)  # its traces, blocks and costs; stages copied per use
            self._copies = True
            return
        self._name = type(network).__name__
        self._meta = meta_copy(network)
        self.signature = signature(self._meta, inputs, call)
        self._copies = False
        self.call = call
        self._out_spec: pytree.TreeSpec | None = None
        self._scalars: frozenset[int] = frozenset()  # indices of 0-d outputs (a loss)
        self._aliases = tensor_aliases(self._meta)
        self._cache: dict[tuple, list[nn.Module]] = {}
        modes = _modes(network)
        whole = self._trace(inputs, [], modes).get_stage_module(0)

        def real_trace() -> nn.Module:  # one more trace, of the real network, only if its constants need values
            return self._trace(inputs, [], modes, source=network).get_stage_module(0)

        self._constants = constant_values(network, traced_constants(whole), self._name, real_trace)
        self.blocks = find_blocks(whole)
        if not self.blocks:
            calls = [node.target for node in whole.graph.nodes if node.op == "call_module"]
            raise ValueError(
                f"pipeline tracing: {self._name}.forward calls no submodule exactly once (calls: {calls}). "
                "HINT: give the network child modules (blocks) that its forward calls in order."
            )
        finest = self._chain(inputs, [[name] for name in self.blocks], modes)
        self.costs = flop_costs(finest, inputs)
        self._uses = [canonical_names(stage, self._meta) for stage in finest]
        offer(self)

    def stage_modules(
        self,
        stages: Sequence[Sequence[str]],
        owned: Iterable[int],
        microbatch_inputs: torch.Tensor | Sequence[torch.Tensor],
        network: nn.Module,
    ) -> dict[int, nn.Module]:
        """Modules computing the given stages of ``network`` for one micro-batch shape.

        Stage 0 takes the network's input tensors (in ``call`` order); stage i > 0 takes exactly what stage i-1 returns
        (values a later stage needs are passed along); the last stage returns the network's output. The
        parameters and buffers are the very objects of ``network`` (possibly pruned and materialised after
        this object was built), under their original names, so optimizers, checkpoints and BatchNorm
        running statistics act on the real network. The network's current train/eval modes are traced in.

        Args:
            stages: Block names per stage, contiguous and in ``blocks`` order.
            owned: Indices of the stages to build (a rank's stages).
            microbatch_inputs: One micro-batch of the network's inputs; only shapes, dtypes, device are used.
            network: The real network, holding at least the owned stages' blocks.
        """
        split = split_explicit(self.blocks, stages)
        inputs = _as_inputs(microbatch_inputs)
        chain = self._chain(inputs, split, _modes(network), inputs[0].device)
        built = {}
        for index in sorted(set(owned)):
            if not 0 <= index < len(chain):
                raise ValueError(
                    f"stage index {index} is out of range for {len(chain)} stages. HINT: use 0..{len(chain) - 1}."
                )
            stage = copy.deepcopy(chain[index]) if self._copies else chain[index]
            rebind(stage, network, f"stage {index} ({split[index][0]}..{split[index][-1]})", self._aliases)
            built[index] = stage
        return built

    def output(self, value: object) -> object:
        """The network's own output (tuple, dict, ``ModelOutput``, ...) from what the last stage returns."""
        return rebuild_output(value, self._out_spec, self._scalars)

    def tied_parameters(self) -> dict[str, list[str]]:
        """Parameters that more than one block's computation reads: canonical name -> those blocks.

        An embedding shared with the output head, a module called twice, a network-level parameter used in
        two places: if such blocks land on different ranks, each rank holds the same parameter and computes
        part of its gradient, which the caller must sum across those ranks (nothing here duplicates it).
        """
        users: dict[str, list[str]] = {}
        for block, names in zip(self.blocks, self._uses, strict=True):
            for name in names:
                users.setdefault(name, []).append(block)
        return {name: blocks for name, blocks in users.items() if len(blocks) > 1}

    def prune(self, network: nn.Module, keep: Iterable[str]) -> None:
        """Prune ``network`` in place to the blocks in ``keep`` (``prune_children``) and to the other modules with
        parameters that those blocks' stages read: an embedding called twice before the first block (not a block)
        stays only on the rank that computes with it, so no rank trains or saves a copy it never updates."""
        kept = set(keep)
        prune_children(network, kept, self.blocks)
        reads = [set(uses) for uses in self._uses]
        read_here = set().union(*(uses for block, uses in zip(self.blocks, reads, strict=True) if block in kept))
        read_anywhere = set().union(*reads)
        canonical = {id(p): name for name, p in self._meta.named_parameters()}
        unread = []
        for name in outside_blocks(self._meta, self.blocks):
            names = {canonical[id(p)] for p in self._meta.get_submodule(name).parameters()}
            if names and names <= read_anywhere and not names & read_here:  # never-read modules stay everywhere
                unread.append(name)
        prune_children(network, [], unread)

    def _chain(
        self, inputs: tuple[torch.Tensor, ...], split: list[list[str]], modes: dict[str, bool], device=None
    ) -> list[nn.Module]:
        """Traced chain stages on the meta copy, cached per (split, shapes, modes, device)."""
        shapes = tuple((tuple(t.shape), t.dtype) for t in inputs)
        # the modes as the trace applies them (a pruned block, an Identity, takes the network's): ranks pruned to
        # different blocks share a trace
        applied = tuple(modes.get(name, modes[""]) for name, _ in self._meta.named_modules())
        key = (tuple(map(tuple, split)), shapes, applied, str(device))
        if key not in self._cache:
            pipe = self._trace(inputs, [stage[0] for stage in split[1:]], modes)
            flows, outputs = stage_flows(pipe.split_gm.graph)
            self._refuse_passed_integers(pipe.split_gm.graph, inputs, flows)
            for index in range(len(flows)):
                after = split[index + 1][0] if index + 1 < len(flows) else None
                check_boundary(pipe.get_stage_module(index), self._name, after)
            needing = needing_gradient(pipe.split_gm, inputs)  # stages that run, before they are rewritten in place
            chain = []
            for index, flow in enumerate(flows):
                module = pipe.get_stage_module(index)
                last = index == len(flows) - 1
                final = outputs if last else None
                to_chain_stage(
                    module, flow, outputs=final, out_spec=self._out_spec, scalars=self._scalars,
                    detached=set(flow.live_in) - needing,
                )  # fmt: skip
                if device is not None and device.type != "meta":
                    retarget_device(module, device)
                    fill_constants(module, self._constants, device, f"{self._name} stage {index}")
                chain.append(module)
            self._cache[key] = chain
        return self._cache[key]

    def _refuse_passed_integers(self, graph: torch.fx.Graph, inputs: tuple[torch.Tensor, ...], flows: list) -> None:
        """An integer input a later stage reads (labels for a loss inside the model) is sent between stages, which
        torch's PipelineStage does from 2.13 on (`seams.NEEDS_TORCH`): one line before launch on older torch."""
        placeholders = [node.name for node in graph.nodes if node.op == "placeholder"]
        integers = {name for name, t in zip(placeholders, inputs, strict=True) if not t.is_floating_point()}
        if any(integers & set(flow.live_out) for flow in flows[:-1]):
            refuse_older_torch(
                "integer tensors between pipeline stages",
                f"compute the loss in training_step from {self._name}'s output, so its integer inputs stay in stage 0",
            )

    def _trace(
        self,
        inputs: tuple[torch.Tensor, ...],
        split_points: list[str],
        modes: dict[str, bool],
        source: nn.Module | None = None,
    ):
        """torch's trace of the meta copy (or of `source`, storage shared) in the given modes; a failure becomes one
        ValueError line."""
        # torch wraps the forward of every split-point module in place, so each trace gets a fresh copy
        traced = copy.deepcopy(self._meta) if source is None else shared_copy(source)
        for name, module in traced.named_modules():
            module.training = modes.get(name, modes[""])
        outputs: list[object] = []
        traced.register_forward_hook(lambda module, args, output: outputs.append(output))
        # distinct tensors, even for one tensor passed twice: export would merge those into one input
        device = torch.device("meta") if source is None else next(iter(source.parameters())).device
        args, kwargs = self.call.bind(tuple(torch.zeros_like(t, device=device) for t in inputs))
        if self.call.constants:  # flags are baked in, not inputs: a stage sends tensors only
            traced.forward = functools.partial(traced.forward, **dict(self.call.constants))
        spec = {name: SplitPoint.BEGINNING for name in split_points} or None
        try:
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), transformer_masks_as_given():
                warnings.simplefilter("ignore")
                pipe = pipeline(traced, args, mb_kwargs=kwargs or None, split_spec=spec)
        except Exception as error:
            raise ValueError(explain_failure(self._name, error)) from error
        placeholders = [node.name for node in pipe.split_gm.graph.nodes if node.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise RuntimeError(
                f"pipeline tracing: {self._name}'s trace takes {len(placeholders)} inputs {placeholders} for "
                f"{len(inputs)} tensors of {self.call.describe()}. HINT: report this with the network's forward"
            )
        leaves, self._out_spec = pytree.tree_flatten(outputs[-1])
        self._scalars = frozenset(
            i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and not leaf.dim()
        )
        odd = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)]
        if odd:
            raise ValueError(
                f"pipeline tracing: {self._name}.forward returns non-tensor values ({', '.join(odd)}) that a "
                "pipeline stage cannot send. HINT: return only tensors (a tensor, tuple or dict of tensors)."
            )
        return pipe


def check_traceable(
    network: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor], call: NetworkCall | None = None
) -> TracedNetwork:
    """Trace ``network`` split at every block, before any process starts; raise one ValueError line if it fails.

    Splitting at every block exposes every value that could cross a stage boundary, so any coarser split
    of the same blocks traces too. Returns the traced network (blocks and costs) for reuse.
    """
    return TracedNetwork(network, example_inputs, call)


def _as_inputs(example: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    inputs = (example,) if isinstance(example, torch.Tensor) else tuple(example)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ValueError(
            f"example inputs must be a tensor or a non-empty tuple of tensors, got "
            f"{[type(t).__name__ for t in inputs]}. "
            "HINT: pass the network's positional inputs for one micro-batch, e.g. (images,)."
        )
    return inputs


def _modes(network: nn.Module) -> dict[str, bool]:
    """Training flag per module name ("" is the network): what the trace must bake in."""
    return {name: module.training for name, module in network.named_modules() if not isinstance(module, nn.Identity)}
