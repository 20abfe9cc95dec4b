"""Logits split by vocabulary on tensor-parallel ranks simulated in one process (torch's LocalTensorMode over the fake
process group), and one small padded example of them: what test_vocab_loss.py and test_traced_vocab_loss.py share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from conftest import fake_world

B, T, V, IGNORED = 3, 5, 10, -100


@contextmanager
def simulated(ranks: int) -> Iterator[Any]:
    """`ranks` tensor-parallel ranks in this process; yields their 1-D mesh."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(ranks), LocalTensorMode(ranks):
        yield init_device_mesh("cpu", (ranks,))


def per_rank(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Each simulated rank's value of a plain (replicated) tensor."""
    held = getattr(tensor, "_local_tensors", None)
    return [t.detach().clone() for t in held.values()] if held is not None else [tensor.detach().clone()]


def example() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=generator) * 3
    labels = torch.randint(0, V, (B, T), generator=generator)
    labels[0, -2:] = IGNORED  # padding
    labels[2, 0] = IGNORED
    return logits, labels
