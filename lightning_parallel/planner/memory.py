"""Bytes per pipeline rank of one layout: what a rank holds all step and the most its gradients and activations hold
together at any moment of the schedule (``peak_of_step``). Arithmetic over per-block figures and the schedule's
in-flight counts (``schedule_costs.py``); it enumerates no layouts and prices no time (``estimate.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankBytes:
    """One pipeline rank's per-block figures, in its blocks' forward order (tensor-parallel shards, before any
    data-parallel sharding)."""

    params: Sequence[float]  # parameters per block
    activations: Sequence[float]  # bytes each block keeps per sample until its backward
    rematerialised: float  # bytes per sample one checkpointed block rebuilds during its backward (the largest)
    largest_block: float  # parameters of its largest block (what FSDP2 gathers at once)


def peak_of_step(grads: Sequence[float], micro_acts: Sequence[float], *, at_first_grad: int, with_grads: int) -> float:
    """The most bytes gradients and activations hold together over a rank's step (``grads``, ``micro_acts``: per
    block, in forward order; activations of one micro-batch of the rank's stages).

    Gradients are whole from the rank's first backward on (they accumulate over micro-batches), beside at most
    ``with_grads`` micro-batches' activations; during that first backward each block's gradient appears as its
    activations are freed: ``at_first_grad - 1`` other micro-batches, plus the worst point of the sweep.
    """
    whole_grads, one = sum(grads), sum(micro_acts)
    kept = list(itertools.accumulate(micro_acts))  # activations left when the backward reaches block i
    made = list(itertools.accumulate(reversed(grads)))[::-1]  # gradients made by then (blocks i and after)
    sweep = max((a + g for a, g in zip(kept, made, strict=True)), default=0.0)
    return max(with_grads * one + whole_grads, (at_first_grad - 1) * one + sweep)


def rank_memory(
    rank: RankBytes,
    *,
    micro: int,
    shard: int,
    stages_per_rank: int,
    at_first_grad: int,
    with_grads: int,
    sizes: tuple[int, int, int],
    optimizer_states: int,
) -> dict[str, float]:
    """Bytes of one pipeline rank: parameters, gradients and optimizer state (sharded over ``shard`` FSDP2
    replicas), activations (at the step's peak: what ``peak_of_step`` adds beyond the whole gradients, and one
    checkpointed block rebuilt), FSDP2's whole blocks beyond the shards ("gathered"), and their total.

    ``at_first_grad`` and ``with_grads`` count (stage, micro-batch) pairs; a pair holds 1 / ``stages_per_rank`` of
    the rank's activations. ``sizes``: bytes per parameter, gradient and optimizer-state element.
    """
    param_bytes, grad_bytes, state_bytes = sizes
    params = sum(rank.params) / shard
    grads = [p / shard * grad_bytes for p in rank.params]
    micro_acts = [a * micro / stages_per_rank for a in rank.activations]
    peak = peak_of_step(grads, micro_acts, at_first_grad=at_first_grad, with_grads=with_grads)
    # FSDP2 in backward: this block's parameters and the next one's (prefetched) gathered whole beside the shards,
    # this block's whole gradients and their copy into the reduce-scatter's flat input (foreach_reduce's chunk_cat)
    whole = rank.largest_block if shard > 1 else 0.0
    memory = {
        "params": params * param_bytes,
        "grads": params * grad_bytes,
        "optimizer": params * optimizer_states * state_bytes,
        "activations": peak - sum(grads) + rank.rematerialised * micro,
        "gathered": whole * 2 * (param_bytes + grad_bytes),
    }
    memory["total"] = sum(memory.values())
    return memory
