"""What a block is: a child of the network holding parameters, the unit a pipeline stage is made of, and the one
the set-up order checkpoints (`parallelize/checkpointing.py`), compiles (`parallelize/compilation.py`) and FSDP2
wraps; and which block kinds repeat. Pure torch: it changes no block.
"""

from __future__ import annotations

from torch import nn


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
