"""An LM head's logits left split by vocabulary (style `vocab_head`) while a step runs in `ShardedLogits`: its
`F.cross_entropy` runs on the shards (`vocab_loss.py`), views keep them split, anything else sees them gathered; and
how they cross a pipeline's last stage (`StageLogits`). It picks no module and runs no step."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lightning_parallel.tensor.vocab_loss import cross_entropy_on_shards, sharded_class_dim

__all__ = [
    "Counts", "ShardedLogits", "StageLogits", "VocabHead", "current_session", "describe_loss", "gather_logits",
    "handed_on", "is_sharded_logits", "logits_session", "sharded_again", "vocab_heads",
]  # fmt: skip

_MARK = "_lp_vocab_sharded"  # set on the DTensors a session hands out: the head's output and its views
_SESSION: contextvars.ContextVar[ShardedLogits | None] = contextvars.ContextVar("sharded_logits", default=None)
_CE_ARGUMENTS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
# methods and functions after which the logits are still the same numbers, laid out otherwise
_KEEPS_SHARDS: set[Callable[..., Any]] = {
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
    torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes, torch.Tensor.movedim, torch.movedim,
    torch.Tensor.permute, torch.permute, torch.Tensor.contiguous, torch.Tensor.__getitem__, torch.Tensor.float,
    torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.clone, torch.Tensor.unsqueeze, torch.Tensor.squeeze,
    torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.unflatten, torch.Tensor.detach,
}  # fmt: skip
# methods that act on the tensor itself, never on a gathered copy: a backward hook (FSDP2's post-forward registers
# its pre-backward hook, which gathers a module's resharded parameters again, on its output; on a gathered copy,
# off the loss's path, it never fired and backward read the freed storage: "setStorage ... storage of size 0")
_ON_ITSELF: set[Callable[..., Any]] = {
    torch.Tensor.register_hook, torch.Tensor.retain_grad, torch.Tensor.requires_grad_,
}  # fmt: skip
# methods that read metadata only (a property such as .shape is a `__get__`, handled alike)
_METADATA: set[Callable[..., Any]] = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.__len__, torch.Tensor.stride, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.get_device, torch.Tensor.__hash__,
}  # fmt: skip


def is_sharded_logits(value: object) -> bool:
    """Whether `value` is logits a session handed out sharded (the head's output, or a view of it)."""
    return isinstance(value, DTensor) and getattr(value, _MARK, False)


def gather_logits(value: Any) -> Any:
    """`value` with every sharded logits tensor in it (nested in tuples, lists, dicts) gathered whole, plain."""
    return pytree.tree_map(lambda t: t.full_tensor() if is_sharded_logits(t) else t, value)


def sharded_again(leaves: list[torch.Tensor], layout: dict[int, tuple[Any, int]], mesh: DeviceMesh) -> list[Any]:
    """Evaluation: `leaves` (a last stage's output, the whole batch's rows) with each one `layout` names, a local
    shard of logits as `StageLogits.layout` describes it, sharded logits again on this rank's own tensor mesh."""

    def rebuilt(index: int, leaf: torch.Tensor) -> Any:
        if index not in layout:
            return leaf
        placements, size = layout[index]
        dim = placements[0].dim % leaf.dim()
        shape = torch.Size((*leaf.shape[:dim], size, *leaf.shape[dim + 1 :]))
        stride = torch.empty(shape, device="meta").stride()
        return _mark(DTensor.from_local(leaf, mesh, placements, run_check=False, shape=shape, stride=stride))

    return [rebuilt(index, leaf) for index, leaf in enumerate(leaves)]


def handed_on(value: Any) -> Any:
    """A traced stage's logits as they leave it: inside a session, still split by vocabulary, sharded logits (for the
    loss that follows, a `vocab_head`'s output as `VocabHead` hands it out); otherwise plain and whole."""
    if not isinstance(value, DTensor):
        return value
    if _SESSION.get() is not None and isinstance(value.placements[0], Shard):
        return _mark(value)
    return value.full_tensor()


def _holds_logits(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether sharded logits are among the arguments, or one list or tuple deep (a fast check: every torch call of
    the step comes through here)."""
    for value in (*args, *kwargs.values()):
        if is_sharded_logits(value):
            return True
        if isinstance(value, (list, tuple)) and any(is_sharded_logits(v) for v in value):
            return True
    return False


def _mark(tensor: DTensor) -> DTensor:
    setattr(tensor, _MARK, True)
    return tensor


@dataclass
class Counts:
    """What sessions did with the logits: losses computed vocabulary-parallel, and gathers for anything else."""

    parallel: int = 0
    gathered: int = 0


def vocab_heads(plan: Mapping[str, str] | None) -> list[str]:
    """The rule every strategy (and the dry run) follows: the `vocab_head`s of an applied tensor plan, whose logits a
    step's cross-entropy reads sharded (in traced pipeline stages `traced_stages` routes the aten op here)."""
    return [name for name, style in (plan or {}).items() if style == "vocab_head"]


def current_session() -> ShardedLogits | None:
    """The `ShardedLogits` session a step runs in, if any (traced stages count their losses in it)."""
    return _SESSION.get()


def logits_session(heads: list[str], counts: Counts | None = None) -> AbstractContextManager[Any]:
    """Around a step: a `ShardedLogits` session where `heads` were planned, else nothing."""
    return ShardedLogits(counts) if heads else nullcontext()


def describe_loss(counts: Counts, heads: list[str]) -> dict[str, Any]:
    """For summary.json: whether the steps' cross-entropy ran vocabulary-parallel (the logits never gathered for it),
    the `vocab_head`s, and how often anything else gathered their logits (an argmax, a metric, a loss it cannot
    take)."""
    return {
        "vocab_parallel_loss": counts.parallel > 0,
        "vocab_heads": heads,
        "vocab_parallel_losses": counts.parallel,
        "logits_gathered": counts.gathered,
    }


class ShardedLogits(TorchFunctionMode):
    """While active, `vocab_head` modules leave their output sharded, and the functions called on it are routed as
    the module docstring says. Enter it before any other torch-function mode of the step (`token_mean.TokenMean`
    rewrites a mean into a sum and calls `F.cross_entropy` again, which then lands here).

    Args:
        counts: Tallies shared by the sessions of one run (what `describe()` reports).
    """

    def __init__(self, counts: Counts | None = None) -> None:
        super().__init__()
        self.counts = counts if counts is not None else Counts()
        self._token: contextvars.Token[ShardedLogits | None] | None = None

    def __enter__(self) -> ShardedLogits:
        self._token = _SESSION.set(self)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._token is not None:
            _SESSION.reset(self._token)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA or func in _ON_ITSELF or not _holds_logits(args, kwargs):
            return func(*args, **kwargs)
        if getattr(func, "__name__", None) == "__get__":  # .shape, .dtype, .device, ...: metadata, or a view (.T)
            return self._keep_or_gather(func(*args, **kwargs))
        if func is F.cross_entropy:
            loss = self._cross_entropy(args, kwargs)
            if loss is not None:
                return loss
        elif func in _KEEPS_SHARDS:
            try:
                return self._keep_or_gather(func(*args, **kwargs))
            except RuntimeError:  # e.g. an index by a plain tensor, which DTensor does not mix: gather instead
                pass
        self.counts.gathered += 1
        return func(*gather_logits(args), **gather_logits(kwargs))

    def _keep_or_gather(self, result: Any) -> Any:
        """A DTensor still split along the vocabulary stays sharded logits; one DTensor redistributed is gathered."""

        def one(value: Any) -> Any:
            if not isinstance(value, DTensor):
                return value
            if isinstance(value.placements[0], Shard):
                return _mark(value)
            self.counts.gathered += 1
            return value.full_tensor()

        return pytree.tree_map(one, result)

    def _cross_entropy(self, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The vocabulary-parallel loss, or None where it does not apply (class weights, label smoothing, targets
        that are probabilities or DTensors, a legacy size_average / reduce, logits split along another dimension)."""
        bound = dict(zip(_CE_ARGUMENTS, args, strict=False)) | kwargs
        input, target = bound["input"], bound["target"]
        plain = bound.get("weight") is None and not bound.get("label_smoothing", 0.0)
        legacy = bound.get("size_average") is not None or bound.get("reduce") is not None
        reduction = bound.get("reduction", "mean")
        if not plain or legacy or reduction not in ("mean", "sum", "none") or sharded_class_dim(input) is None:
            return None
        if not isinstance(target, torch.Tensor) or isinstance(target, DTensor) or target.is_floating_point():
            return None
        self.counts.parallel += 1
        return cross_entropy_on_shards(
            input, target, ignore_index=int(bound.get("ignore_index", -100)), reduction=reduction
        )


class VocabHead(ColwiseParallel):
    """Column-parallel LM head (a Linear to the vocabulary): inside a `ShardedLogits` session its output stays
    sharded by vocabulary (a DTensor, Shard(-1)); outside one it is gathered, as `colwise_gather` gives it.

    Args:
        sequence_parallel: The input arrives split along the sequence (dim 1) and is gathered first.
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__(input_layouts=Shard(1) if sequence_parallel else Replicate(), use_local_output=False)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh
    ) -> torch.Tensor:
        # outputs: (..., V) sharded on the last dimension
        if _SESSION.get() is not None:
            return _mark(outputs)
        return outputs.redistribute(placements=[Replicate()]).to_local()


class StageLogits:
    """Sharded logits across a pipeline's last stage: `PipelineStage` takes plain tensors, so the stage returns the
    local shard of each sharded logits tensor it returns, alone or in a tuple (`hook`, a forward hook on the stage
    module, `watch` hooks them) and the schedule's loss gets them back sharded (`restore`). Anything else a stage
    returns passes as it is."""

    def __init__(self) -> None:
        self._specs: dict[int, tuple[Any, ...]] = {}  # position among the output's leaves -> how to rebuild it
        self._hooked: set[int] = set()
        self._handed: dict[int, tuple[Any, ...]] = {}  # the last specs that named a shard (another stage may follow)

    def watch(
        self, modules: dict[int, nn.Module], factory: Callable[[Any], dict[int, nn.Module]] | None = None
    ) -> tuple[dict[int, nn.Module], Callable[[Any], dict[int, nn.Module]] | None]:
        """`modules` and the modules `factory` builds later (traced stages, per micro-batch shape), hooked once each."""
        for module in modules.values():
            if id(module) not in self._hooked:
                self._hooked.add(id(module))
                module.register_forward_hook(self.hook)
        return modules, (None if factory is None else lambda micro: self.watch(factory(micro))[0])

    def hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        leaves, spec = pytree.tree_flatten(output)
        self._specs = {
            index: (leaf.device_mesh, leaf.placements, leaf.shape, leaf.stride())
            for index, leaf in enumerate(leaves)
            if is_sharded_logits(leaf)
        }
        if not self._specs:
            return None
        self._handed = self._specs
        return pytree.tree_unflatten([leaf.to_local() if is_sharded_logits(leaf) else leaf for leaf in leaves], spec)

    def layout(self) -> dict[int, tuple[Any, int]]:
        """What the last stage handed on as shards, {leaf index: (placements, vocabulary size)}: all another
        pipeline rank needs to rebuild them from its tensor rank's shard (`sharded_again`)."""
        return {
            index: (placements, shape[placements[0].dim % len(shape)])
            for index, (_, placements, shape, _) in self._handed.items()
        }

    def restore(self, value: Any) -> Any:
        """The last stage's output, sharded logits again where the stage handed out their local shard."""
        if not self._specs:
            return value
        leaves, spec = pytree.tree_flatten(value)

        def rebuilt(index: int, leaf: Any) -> Any:
            if index not in self._specs or not isinstance(leaf, torch.Tensor) or isinstance(leaf, DTensor):
                return leaf
            mesh, placements, shape, stride = self._specs[index]
            return _mark(DTensor.from_local(leaf, mesh, placements, run_check=False, shape=shape, stride=stride))

        return pytree.tree_unflatten([rebuilt(index, leaf) for index, leaf in enumerate(leaves)], spec)
