"""The private parts of torch this project relies on, each reached through one function here (Lightning's are in
lightning_seams.py, gloo_host's in process_group_seams.py; both raise `changed`'s error).

Each function knows the part's form in every supported version, checks that it is there, and otherwise fails with
one line naming the part, the installed version, the versions tested and the supported range, instead of a silent
wrong result or an AttributeError deep inside a run. A new torch version starts here (`make test-torch TORCH=...`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

# The versions the whole suite passed on (docs/limitations.md, "Versions"), and the ranges pyproject.toml declares.
TESTED = {"torch": ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"), "lightning": ("2.6.6",)}
SUPPORTED = {"torch": ">=2.11,<2.16", "lightning": ">=2.6,<2.7"}


class SeamChanged(RuntimeError):
    """A private part of torch or Lightning that lightning_parallel relies on is missing or changed shape."""


def changed(library: str, part: str, why: str) -> SeamChanged:
    """The one-line error for a seam that no longer holds."""
    try:
        installed = version(library)
    except PackageNotFoundError:  # pragma: no cover - both are dependencies
        installed = "not installed"
    return SeamChanged(
        f"{library} {installed} changed {part}, which lightning_parallel relies on to {why} (tested with "
        f"{library} {', '.join(TESTED[library])}). HINT: pip install '{library}{SUPPORTED[library]}', or adapt "
        f"lightning_parallel/seams.py"
    )


def private_method(owner: object, name: str, *, library: str, why: str, parameters: int | None = None) -> Callable:
    """`owner.<name>`, checked to be callable and, if given, to take `parameters` arguments (bound `self` excluded)."""
    method = getattr(owner, name, None)
    if not callable(method):
        raise changed(library, f"{type(owner).__name__}.{name}", why)
    if parameters is not None and len(inspect.signature(method).parameters) != parameters:
        raise changed(library, f"the signature of {type(owner).__name__}.{name}", why)
    return method


def stager_spent(stager: object) -> bool:
    """Whether torch's `DefaultStager` closed its copier after staging: torch 2.11 does so after every stage (its
    copy table cleared, so a second stage fails with `KeyError: <class 'type'>`); 2.13 keeps it for the next save."""
    table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
    if not isinstance(table, dict):
        raise changed("torch", "DefaultStager._state_dict_stager._deepcopy_dispatch", "reuse a checkpoint stager")
    return not table


def initialise_fsdp_root(module: torch.nn.Module) -> None:
    """FSDP2's lazy initialisation of `module` as the root over the FSDP2 modules inside it (torch runs it at the
    root's first forward; a pipeline stage calls the blocks, never the root), so they share one state."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    private_method(
        state, "_lazy_init", library="torch", why="share one FSDP2 root among a stage's blocks", parameters=0
    )()


def dispatch_mode() -> tuple[Any, Callable[[Any], list[Any]], Callable[[Any], bool]]:
    """torch's `TorchDispatchMode` (the base of a mode that sees every op), `tree_leaves` and
    `is_traceable_wrapper_subclass` (a DTensor's shard holds its storage), for the dry run's live-byte count."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
        from torch.utils._pytree import tree_leaves
    except ImportError as error:
        raise changed("torch", "torch.utils._python_dispatch.TorchDispatchMode", "count a dry run's bytes") from error
    return TorchDispatchMode, tree_leaves, is_traceable_wrapper_subclass


def shape_inference(schedule: object) -> tuple[str, Callable[..., Any]]:
    """The name and method of torch.distributed.pipelining's first-step shape inference, which runs an extra forward
    that the runtime must keep from touching BatchNorm statistics and user code: `_initialize_pp_stages` from torch
    2.12 on; in torch 2.11 `_initialize_stage` (single-stage schedules) or `_initialize_stages` (multi-stage)."""
    for name in ("_initialize_pp_stages", "_initialize_stage", "_initialize_stages"):
        method = getattr(schedule, name, None)
        if callable(method):
            return name, method
    raise changed(
        "torch", f"{type(schedule).__name__}._initialize_pp_stages", "keep shape inference away from module buffers"
    )


def conv_forward(conv: torch.nn.Conv2d) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """`Conv2d._conv_forward(input, weight, bias)`: the convolution with the module's padding mode and stride but
    with other weights (a rank's shard), so channel-parallel convolutions need not copy torch's padding logic."""
    return private_method(conv, "_conv_forward", library="torch", why="run a convolution on shards", parameters=3)


def found_inf_flags(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The found-inf flags `GradScaler.unscale_` recorded for `optimizer` (one per device), which every pipeline
    stage must agree on before `GradScaler.step` reads them."""
    why = "make every pipeline stage skip the same fp16 steps"
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        raise changed("torch", "GradScaler._per_optimizer_states", why)
    flags = states.get(id(optimizer), {}).get("found_inf_per_device")
    if not isinstance(flags, dict) or not all(isinstance(f, torch.Tensor) for f in flags.values()):
        raise changed("torch", "GradScaler._per_optimizer_states[...]['found_inf_per_device']", why)
    return list(flags.values())


def action_order(schedule: object) -> dict[int, list[Any]]:
    """An action-list schedule's per-rank actions including communication (`pipeline_order_with_comms`), which
    evaluation edits to drop backward actions torch would otherwise walk without a loss."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not isinstance(order, dict):
        raise changed("torch", f"{type(schedule).__name__}.pipeline_order_with_comms", "evaluate forward-only")
    return order


def skip_self_warmup(schedule: object, stages: list[Any], rank: int) -> None:
    """Keep torch 2.11's first-step link warm-up from sending to this rank itself. Its schedules (those without
    `_initialize_pp_stages`) send a tensor to each neighbouring stage (`PipelineStage._get_init_p2p_neighbors_ops`),
    also where a V-shaped schedule (zbv, dualpipev) puts two adjacent stages on one rank, and gloo has no link to
    itself ("Pair is not connected"); such a send and its receive are both on this rank, so both are dropped. From
    torch 2.12 on the warm-up is a vote among other ranks only: nothing to do."""
    if hasattr(schedule, "_initialize_pp_stages"):
        return
    for stage in stages:
        ops = private_method(
            stage, "_get_init_p2p_neighbors_ops", library="torch", why="warm up V-shaped schedules", parameters=0
        )

        def others(ops: Callable[[], list[Any]] = ops) -> list[Any]:
            return [op for op in ops() if op.peer != rank]

        stage._get_init_p2p_neighbors_ops = others


def torch_at_least(first: tuple[int, int]) -> bool:
    """Whether the installed torch is `first` (major, minor) or newer; a local build's "+cpu" ignored."""
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= first


def forward_actions() -> frozenset[Any]:
    """The kinds of action a forward-only order keeps from an action-list schedule's: forward computations, their
    sends and receives, FSDP's unshard / reshard, and from torch 2.15 on the waits that retire each forward send
    (`WAIT_SEND_F`), which torch 2.15 checks every send has ("Pipeline sends have no matching wait")."""
    from torch.distributed.pipelining import schedules

    kinds = ("FORWARD", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")
    for kind in kinds:
        if not hasattr(schedules, kind):
            raise changed("torch", f"torch.distributed.pipelining.schedules.{kind}", "evaluate forward-only")
    return frozenset(getattr(schedules, kind) for kind in (*kinds, "WAIT_SEND_F") if hasattr(schedules, kind))


def stage_backward_calls(stage: object) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`PipelineStage.backward_one_chunk(..., full_backward=)` and `backward_weight_one_chunk`, the calls
    split-backward schedules make for their I and W passes, which the stage timer wraps to time them."""
    why = "time split-backward passes"
    backward = private_method(stage, "backward_one_chunk", library="torch", why=why)
    if "full_backward" not in inspect.signature(backward).parameters:
        raise changed("torch", "the signature of PipelineStage.backward_one_chunk", why)
    return backward, private_method(stage, "backward_weight_one_chunk", library="torch", why=why)


def fused_steps_on_dtensor() -> None:
    """Let `SGD(fused=True)` and `Adagrad(fused=True)` step DTensor parameters. DTensor shards fused Adam and AdamW
    element-wise over their lists of parameters, gradients and states, but registers no rule for fused SGD or Adagrad
    ("Operator aten._fused_sgd_.default does not have a sharding strategy registered"), whose lists have the same
    shape; they get fused Adam's rule, in whichever of the sharding propagator's tables this torch keeps it. Does
    nothing where torch has its own rule."""
    from torch.distributed.tensor import DTensor

    why = "run SGD(fused=True) and Adagrad(fused=True) on tensor-parallel parameters"
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    tables = [t for t in vars(propagator).values() if isinstance(t, dict)] if propagator is not None else []
    aten = torch.ops.aten
    for adam, other in (
        (aten._fused_adam_.default, aten._fused_sgd_.default),
        (aten._fused_adam_.tensor_lr, aten._fused_sgd_.tensor_lr),
        (aten._fused_adam_.default, aten._fused_adagrad_.default),
    ):
        holding = [t for t in tables if adam in t]
        if not holding:
            raise changed("torch", f"DTensor's sharding rule for {adam}", why)
        if not any(other in t for t in holding):
            for table in holding:
                table[other] = table[adam]


@contextlib.contextmanager
def as_traced() -> Iterator[None]:
    """A forward run as the pipeline's trace (torch.export) ran it, so an analysis sees what traced stages hold:
    `torch.compiler.is_compiling()` and `is_exporting()` are True, set by torch's own `_compiling_state_context`
    (private). Models branch on them: transformers then builds its causal mask (B, 1, T, T) instead of asking
    attention for `is_causal`, so it repeats grouped key / value heads, and each attention keeps a float copy of the
    mask (16 MiB a sequence of 2,048 tokens, per layer, whole on every tensor rank)."""
    try:
        from torch._export.utils import _compiling_state_context
    except ImportError as error:
        why = "analyse a network as its traced pipeline stages run"
        raise changed("torch", "torch._export.utils._compiling_state_context", why) from error
    with _compiling_state_context():
        yield


@contextlib.contextmanager
def transformer_masks_as_given() -> Iterator[None]:
    """While torch traces a network: torch's `nn.TransformerEncoder` / `nn.TransformerDecoder` take an attention mask
    as given instead of comparing its values with a causal mask (`_detect_is_causal_mask`, a branch on data the tracer
    cannot follow, which only picks a kernel for the same result), and the fast paths of their layers and of
    `nn.MultiheadAttention` (eval / no-grad kernels, nested tensors) are off, so the trace holds the ops every mode
    runs. An `is_causal` the caller passes is kept."""
    from torch.nn.modules import transformer

    detect = getattr(transformer, "_detect_is_causal_mask", None)
    if not callable(detect) or list(inspect.signature(detect).parameters) != ["mask", "is_causal", "size"]:
        raise changed("torch", "torch.nn.modules.transformer._detect_is_causal_mask", "trace nn.Transformer layers")
    fastpath = torch.backends.mha.get_fastpath_enabled()
    transformer._detect_is_causal_mask = _causal_only_if_told
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _causal_only_if_told(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
    return is_causal is True  # the mask itself still applies: the same attention, without the data-dependent check


# What needs a newer torch than the range's lower bound: feature -> (the first torch it passed on, what older ones do).
# Measured with `make test-torch` on 2.11.0 and 2.12.1 (failing) and 2.13.0 / 2.14.1 / 2.15.0 (passing).
NEEDS_TORCH: dict[str, tuple[tuple[int, int], str]] = {
    "integer tensors between pipeline stages": (
        (2, 13),
        "2.11's PipelineStage makes every received buffer require grad (an error for integers), 2.12's expects a "
        "gradient back for it",
    ),
    "tensor parallelism inside traced pipeline stages": (
        (2, 13),
        "2.11 hangs in a collective, 2.12 cannot swap a DTensor parameter in Module.to",
    ),
    "a fused projection split by heads (qkv_colwise, packed_colwise)": (
        (2, 13),
        "2.11's DTensor cannot redistribute its interleaved shard (_StridedShard) in the backward; 2.12 not measured",
    ),
}


def refuse_older_torch(feature: str, hint: str) -> None:
    """Raise one line when the installed torch is older than the first one `feature` passed on (`NEEDS_TORCH`)."""
    first, why = NEEDS_TORCH[feature]
    if not torch_at_least(first):
        raise ValueError(
            f"{feature} needs torch >= {first[0]}.{first[1]}, installed {torch.__version__} ({why}). HINT: pip install "
            f"'torch>={first[0]}.{first[1]}', or {hint}"
        )
