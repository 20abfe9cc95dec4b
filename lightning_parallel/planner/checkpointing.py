"""What activation checkpointing (`parallelize/checkpointing.ACTIVATION_CHECKPOINTING`) does to one block's memory
and time in the planner's model: the activations it keeps for every micro-batch in flight, the ones it rematerialises
for one block at a time during backward, and the forward it runs again.

Per-sample element counts of one block at a tensor-parallel size; the cost model multiplies by bytes and samples.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_parallel.planner.workload import Block

MODES = ("none", "full", "selective")


def local(whole: float, sharded: float, tp: int) -> float:
    """Elements on one tensor-parallel rank: the unsharded part whole, the sharded part split."""
    return whole - sharded + sharded / tp


def kept_and_rematerialised(block: Block, tp: int, mode: str, block_input: float) -> tuple[float, float]:
    """(elements kept per sample until the block's backward, elements rebuilt per sample while it runs).

    `none` keeps every activation. `full` keeps the block's input (a checkpoint's only saved tensor) and rebuilds
    everything else. `selective` also keeps the outputs of its matrix multiplications and attention (the block's
    `selective_activations`; a block without that figure is treated as under `none`). Activations a loss saves
    outside the network (`outside_activations`) are kept under every mode.
    """
    everything = local(block.activations, block.tp_activations, tp)
    outside = local(block.outside_activations, block.tp_outside_activations, tp)
    if mode == "none" or (mode == "selective" and block.selective_activations is None):
        return everything, 0.0
    if mode == "full":
        kept = block_input + outside
    elif mode == "selective":
        kept = block_input + outside + local(block.selective_activations or 0.0, block.tp_selective_activations, tp)
    else:
        raise ValueError(f"activation_checkpointing={mode!r} is unknown. HINT: one of {', '.join(MODES)}")
    return kept, max(0.0, everything - kept)


def checkpointed_kinds(blocks: Sequence[Block]) -> frozenset[str]:
    """The block kinds the strategies checkpoint (`blocks.repeated_kinds`): those that repeat, else all."""
    kinds = [block.kind for block in blocks]
    repeated = frozenset(kind for kind in kinds if kinds.count(kind) > 1)
    return repeated or frozenset(kinds)


def recompute_factor(mode: str) -> float:
    """Compute time relative to no checkpointing: `full` runs each forward again (a third of forward + backward);
    `selective` recomputes element-wise operations only, which the planner's FLOP count leaves out."""
    return 4.0 / 3.0 if mode == "full" else 1.0
