"""Set-up step "compile": `torch.compile` each block a rank holds, after activation checkpointing (so recomputation
is compiled too) and before replicas. It acts in place, on the block's `forward`, so parameter names, state dicts and
checkpoints stay the eager network's, and compiled and eager runs load each other's checkpoints. Pure torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


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
