"""Prune a network in place to some of its blocks, each other block replaced by ``nn.Identity()`` on its parent, so the
kept parameters keep their full-network names (the keys of optimizers and checkpoints); and one stage's blocks as an
``nn.Sequential`` of the same objects. No planning (`partition.py`), no tracing (`traced.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from torch import nn

from lightning_parallel.pipeline.partition import block_names

__all__ = ["prune_children", "prune_to_blocks", "stage_module"]


def prune_children(network: nn.Module, keep: Iterable[str], blocks: Sequence[str]) -> None:
    """Replace every block in ``blocks`` (qualified names) but not in ``keep`` by ``nn.Identity()`` on its parent, in
    place. Containers are never rebuilt, so kept parameters keep their full-network names and the dropped blocks'
    parameters disappear from ``named_parameters()``. Modules that are not blocks are left alone.
    """
    kept = set(keep)
    unknown = sorted(kept - set(blocks))
    if unknown:
        raise ValueError(f"cannot keep unknown blocks {unknown}. HINT: valid block names are {list(blocks)}.")
    for name in blocks:
        if name not in kept:
            parent, _, leaf = name.rpartition(".")
            network.get_submodule(parent).add_module(leaf, nn.Identity())


def prune_to_blocks(model: nn.Sequential, keep: Iterable[str]) -> None:
    """``prune_children`` for an ``nn.Sequential`` of named blocks (its direct children)."""
    prune_children(model, keep, block_names(model))


def stage_module(model: nn.Sequential, blocks: Sequence[str]) -> nn.Sequential:
    """A new ``nn.Sequential`` holding the same block objects (shared parameters, no copies) for one stage.

    Args:
        model: The full (or pruned) model.
        blocks: A contiguous run of block names in model order, e.g. one entry of ``Partition.stages``.

    Returns:
        The stage, ready to hand to ``torch.distributed.pipelining.PipelineStage``.
    """
    names = block_names(model)
    wanted = list(blocks)
    first = names.index(wanted[0]) if wanted and wanted[0] in names else -1
    if first < 0 or names[first : first + len(wanted)] != wanted:
        raise ValueError(
            f"stage blocks {wanted} are not a non-empty, contiguous run of the model's blocks in order. "
            f"HINT: take them from Partition.stages; valid names are {names}."
        )
    children = dict(model.named_children())
    return nn.Sequential(OrderedDict((name, children[name]) for name in wanted))
