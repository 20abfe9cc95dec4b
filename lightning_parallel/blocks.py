"""What the set-up order does to each block a rank holds, after sharding and before replicas: activation
checkpointing and `torch.compile`. A block is a child of the network holding parameters: the unit a pipeline stage
is made of and FSDP2 wraps. Both act in place, so parameter names, state dicts and checkpoints stay those of the
eager, unwrapped network, and runs with and without them load each other's checkpoints.

Pure torch: no process groups, no Lightning. The strategies decide where in their set-up these run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

ACTIVATION_CHECKPOINTING = {
    "none": "every activation kept for backward",
    "full": "a block keeps only its inputs; its forward runs again in backward",
    "selective": "a block keeps the outputs of its matrix multiplications, attention and convolutions (torchtitan's "
    "op-level policy) and recomputes the cheap element-wise rest",
}


def _ops(*names: str) -> frozenset[Any]:
    """The aten overload packets that exist in this torch (attention kernels differ between versions)."""
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


SAVED_BY_SELECTIVE = _ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def blocks_of(network: nn.Module) -> list[nn.Module]:
    """The network's children that hold parameters, in order: on a pipeline rank, the blocks of its stages."""
    return [child for child in network.children() if next(child.parameters(), None) is not None]


def repeated_kinds(network: nn.Module) -> frozenset[type]:
    """The block classes activation checkpointing applies to: those that occur more than once among the whole
    network's blocks (a transformer's layers, a ResNet's residual blocks), as torchtitan and Lightning's FSDP policy
    pick the layer class; every block's class when none repeats. An embedding or LM head left out gains little and,
    under `selective`, would keep its logits."""
    counts: dict[type, int] = {}
    for block in blocks_of(network):
        counts[type(block)] = counts.get(type(block), 0) + 1
    chosen = frozenset(kind for kind, count in counts.items() if count > 1)
    return chosen or frozenset(counts)


def refuse_unrepeatable(network: nn.Module, activation_checkpointing: str) -> None:
    """Checkpointing runs a block's forward twice; a BatchNorm that tracks running statistics would update them
    twice per step, so such networks are refused in one line rather than trained on other statistics."""
    if activation_checkpointing == "none":
        return
    for name, module in network.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            raise ValueError(
                f"activation_checkpointing={activation_checkpointing!r} would run {name} "
                f"({type(module).__name__}) twice per step and update its running statistics twice. "
                "HINT: activation_checkpointing='none' for networks with BatchNorm"
            )


def checkpoint_activations(blocks: list[nn.Module], mode: str) -> None:
    """Wrap each block's forward in `torch.utils.checkpoint` (non-reentrant, RNG state preserved, so dropout
    draws the same mask when recomputed)."""
    if mode == "none":
        return
    options: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":  # only then: TorchDynamo cannot trace through an explicit default context_fn
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_heavy_ops)
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, **options)  # type: ignore[method-assign]


def _save_heavy_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def compile_blocks(blocks: list[nn.Module], options: Mapping[str, Any] | None) -> int:
    """`torch.compile(**options)` each block's forward (None: nothing); returns how many were compiled. Compilation
    happens at each block's first call, so the first training step carries its time."""
    if options is None:
        return 0
    for block in blocks:
        block.forward = torch.compile(_entry(block.forward), **options)  # type: ignore[method-assign]
    return len(blocks)


def _entry(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A frame of our own around `forward`. TorchDynamo does not start tracing in torch's own files, so
    `Module.compile()` on a torch layer (`nn.Linear`, an `nn.Sequential` of them) silently stays eager; from
    this frame it inlines them."""

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    return compiled_forward
