"""Set-up step "activation checkpointing": each block of the kinds that repeat (`blocks.repeated_kinds`) keeps less
for backward and recomputes the rest (`none` / `full` / `selective`), after sharding and before compile and replicas.
It acts in place, on the block's `forward`, so parameter names, state dicts and checkpoints stay the eager network's.
What it cannot repeat exactly (BatchNorm statistics) is refused before launch. Pure torch: no process groups.
"""

from __future__ import annotations

import functools
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
