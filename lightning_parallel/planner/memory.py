"""Bytes per pipeline rank of one layout: what a rank holds all step and the most its gradients and activations hold
together at any moment of the schedule (``peak_of_step``). Arithmetic over per-block figures and the schedule's
in-flight counts (``schedule_costs.py``); it enumerates no layouts and prices no time (``estimate.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_parallel.planner.schedule_costs import Moment

# How an optimizer's step makes temporaries of state elements (torch's Adam / AdamW): "for-loop" one parameter at a time
# (its second moment's sqrt and their quotient, beside the previous parameter's quotient, still bound: the most of
# p_prev + 2 p over the update order; CPU's default), "foreach" the whole group at once (the sqrt of every second
# moment: all parameters; CUDA's default), "fused" none.
UPDATES = ("for-loop", "foreach", "fused")


def update_elements(update: str, sizes: Sequence[float], params: float) -> float:
    """State elements the optimizer step's temporaries hold at most (``UPDATES``), from the local sizes of a rank's
    parameters in update order and their sum ``params``."""
    if update == "foreach":
        return params
    if update == "for-loop":
        return max((2 * n + (sizes[i - 1] if i else 0.0) for i, n in enumerate(sizes)), default=0.0)
    return 0.0


@dataclass(frozen=True)
class RankBytes:
    """One pipeline rank's per-block figures, in its blocks' forward order (tensor-parallel shards, before any
    data-parallel sharding)."""

    params: Sequence[float]  # parameters per block
    activations: Sequence[float]  # bytes each block keeps per sample until its backward
    rematerialised: float  # bytes per sample one checkpointed block rebuilds during its backward (the largest)
    replica_units: Sequence[float]  # parameters of each FSDP2 unit (gathered at once), in forward order
    unit_starts: Sequence[int]  # the index of each unit's first block
    update: float = 0.0  # state elements of the optimizer step's temporaries (tensor shards)
    loss: float = 0.0  # bytes per sample a loss after its blocks holds beside their activations while it runs
    largest: Sequence[float] = ()  # elements of each block's largest parameter (tensor shard), in forward order
    loss_backward: float = 0.0  # bytes per sample the loss's backward holds as the last block's backward starts
    # a pipeline rank's (``stage_figures``, ``pipeline_held``): its stages' receive buffers (inputs, output
    # gradients) for one micro-batch, one sent stage output and one sent input gradient, per stage its activations
    # and what a pair between its split backward's I and W keeps at its weights (``Block.weight_gradients``); bytes
    # per sample
    received: float = 0.0
    sent_output: float = 0.0
    sent_gradient: float = 0.0
    stage_activations: Sequence[float] = ()
    stage_weight_gradients: Sequence[float] = ()


def stage_figures(
    blocks: Sequence[tuple[float, float, float]], split: Sequence[Sequence[int]], stages: Sequence[int]
) -> tuple[float, float, float, tuple[float, ...], tuple[float, ...]]:
    """``RankBytes``' pipeline figures (bytes per sample) of a rank holding ``stages`` of ``split`` (block indices per
    stage), from each block's (output, activations kept, weight gradients) in bytes per sample: its receive buffers
    for one micro-batch, one sent output and one sent input gradient (means over its stages), and per stage its
    activations and what its split backward keeps for W (none on the first stage, whose I does nothing)."""
    outputs, activations, weight_gradients = ([figures[k] for figures in blocks] for k in range(3))
    last = len(split) - 1
    inputs = [outputs[split[s][0] - 1] for s in stages if s > 0 and split[s]]
    sends = [outputs[split[s][-1]] for s in stages if s < last and split[s]]
    mean = lambda values: sum(values) / len(values) if values else 0.0  # noqa: E731
    acts = tuple(sum(activations[i] for i in split[s]) for s in sorted(stages))
    weights = tuple(sum(weight_gradients[i] for i in split[s]) if s > 0 else 0.0 for s in sorted(stages))
    return sum(inputs) + sum(sends), mean(sends), mean(inputs), acts, weights


def pipeline_held(rank: RankBytes, *, micro: int, microbatches: int, at_peak: Sequence[Moment]) -> float:
    """Bytes a pipeline rank holds besides what ``peak_of_step`` counts, from torch's ``PipelineStage`` and schedules:
    one receive buffer per stage input and output gradient per micro-batch, made once and kept; and at the worst
    moment it holds the most pairs (``ScheduleCost.at_peak``) the pairs' activations beyond as many average ones (its
    stages' pairs are not alike), its pairs awaiting their weight-gradient action, and the tensors it sent so far
    (the multi-stage schedules wait on their sends only as the step ends)."""
    buffers = rank.received * micro * microbatches
    mean = sum(rank.stage_activations) / max(1, len(rank.stage_activations))

    def beyond(moment: Moment) -> float:
        held, awaiting, outputs, gradients = moment
        pairs = sum(n * (a - mean) for n, a in zip(held, rank.stage_activations, strict=True))
        weights = sum(n * w for n, w in zip(awaiting, rank.stage_weight_gradients, strict=True))
        return pairs + weights + outputs * rank.sent_output + gradients * rank.sent_gradient

    return buffers + max((beyond(moment) * micro for moment in at_peak), default=0.0)


def peak_of_step(
    grads: Sequence[float],
    micro_acts: Sequence[float],
    *,
    at_first_grad: int,
    with_grads: int,
    transients: Sequence[float] = (),
    loss: float = 0.0,
    accumulating: Sequence[float] = (),
    loss_backward: float = 0.0,
) -> float:
    """The most bytes gradients and activations hold together over a rank's step (``grads``, ``micro_acts``,
    ``transients``: per block, in forward order; activations of one micro-batch of the rank's stages; what a block's
    backward holds only while it runs, e.g. FSDP2's gathered unit; ``loss``: what a loss after the blocks holds
    beside a micro-batch's activations while its forward runs, e.g. its input logits; ``accumulating``: per block,
    the most a later micro-batch's gradient of one of its parameters holds beside the one accumulated so far).

    Gradients are whole from the rank's first backward on (they accumulate over micro-batches), beside at most
    ``with_grads`` micro-batches' activations; during that first backward each block's gradient appears as its
    activations are freed: ``at_first_grad - 1`` other micro-batches, plus the worst point of the sweep. A loss's
    forward ends a micro-batch's forward: ``at_first_grad`` of them held before any gradient, ``with_grads`` after.
    Autograd accumulates a parameter's gradient in place (``AccumulateGrad``: ``grad += new``), but the new one is
    made whole first: on backwards after the first, each block's largest parameter gradient is held twice. A
    block's ``transients`` (FSDP2's gathered unit) are over when its parameters' gradients come. ``loss_backward``: what
    a loss after the blocks holds in its backward, beside all of a micro-batch's activations, before any of the
    blocks' gradients.
    """
    whole_grads, one = sum(grads), sum(micro_acts)
    kept = list(itertools.accumulate(micro_acts))  # activations left when the backward reaches block i
    made = list(itertools.accumulate(reversed(grads)))[::-1]  # gradients made by then (blocks i and after)
    extra = list(transients) or [0.0] * len(kept)
    sweep = max((a + g + t for a, g, t in zip(kept, made, extra, strict=True)), default=0.0)
    back = one + loss_backward if loss_backward else 0.0  # the loss's backward: every activation still held
    first = max((at_first_grad - 1) * one + max(sweep, back), at_first_grad * one + loss)
    if with_grads == 0:
        return first
    twice = list(accumulating) or [0.0] * len(kept)
    steady = max((a + max(t, n) for a, t, n in zip(kept, extra, twice, strict=True)), default=0.0)  # a later one
    return max(first, whole_grads + max(with_grads * one + loss, (with_grads - 1) * one + max(steady, back)))


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
    holds_output: bool = False,
    microbatches: int = 1,
    at_peak: Sequence[Moment] = (),
) -> dict[str, float]:
    """Bytes of one pipeline rank: parameters, gradients and optimizer state (sharded over ``shard`` FSDP2
    replicas), activations (at the step's peak: what ``peak_of_step`` adds beyond the whole gradients, and one
    checkpointed block rebuilt), FSDP2's whole blocks beyond the shards ("gathered"), and their total.

    ``at_first_grad`` and ``with_grads`` count (stage, micro-batch) pairs; a pair holds 1 / ``stages_per_rank`` of
    the rank's activations. ``sizes``: bytes per parameter, gradient and optimizer-state element. Where the optimizer
    step's temporaries (``rank.update``) outweigh the backward's peak, the step peaks there and "activations" are
    those temporaries (every activation freed by then, nothing gathered). ``holds_output``: a pipeline stage, whose
    output (the loss's input logits, on the last) torch's ``PipelineStage`` keeps from its forward through its
    backward (``fwd_cache``): the loss's input is then one more of the last block's activations, and it holds
    ``pipeline_held`` besides (``microbatches``, ``at_peak``: the schedule's).
    """
    param_bytes, grad_bytes, state_bytes = sizes
    params = sum(rank.params) / shard
    grads = [p / shard * grad_bytes for p in rank.params]
    micro_acts = [a * micro / stages_per_rank for a in rank.activations]
    loss = rank.loss * micro
    if holds_output and micro_acts:
        micro_acts[-1] += loss / stages_per_rank
        loss = 0.0
    # a later micro-batch's new gradient beside the accumulated one; FSDP2 reduce-scatters each (its transients); a
    # split backward (pairs awaiting W at the peak) makes none in its I sweep: its W actions come as activations go
    splits_backward = any(any(awaiting) for _, awaiting, _, _ in at_peak)
    accumulating = [n * grad_bytes for n in rank.largest] if shard == 1 and not splits_backward else []
    # FSDP2 (torch's _fsdp_param_group.py), beside the unit after it's reduce-scatter input (kept until this unit's
    # post_backward): at its backward's start (last block) the all-gather output and its copy-out (2p), at its end
    # (first block) its parameters, the unit before it's all-gather output (prefetched) and its whole gradients
    transients = [0.0] * len(grads)
    if shard > 1:
        units = list(rank.replica_units)
        ends = [*rank.unit_starts[1:], len(grads)]
        for i, (start, end, p) in enumerate(zip(rank.unit_starts, ends, units, strict=True)):
            before, after = (units[i - 1] if i else 0.0), (units[i + 1] if i + 1 < len(units) else 0.0)
            kept_input = after * grad_bytes
            at_start = (p + max(p, before)) * param_bytes + kept_input
            at_end = (p + before) * param_bytes + p * grad_bytes + kept_input
            transients[end - 1] = max(transients[end - 1], at_start)
            transients[start] = max(transients[start], at_end)
    peak = peak_of_step(grads, micro_acts, at_first_grad=at_first_grad, with_grads=with_grads, transients=transients,
                        loss=loss, accumulating=accumulating, loss_backward=rank.loss_backward * micro)  # fmt: skip
    gathered = max(transients, default=0.0)
    activations = peak - sum(grads) - gathered + rank.rematerialised * micro
    temporaries = rank.update / shard * state_bytes
    if optimizer_states and temporaries > activations + gathered:
        activations, gathered = temporaries, 0.0
    if holds_output:
        activations += pipeline_held(rank, micro=micro, microbatches=microbatches, at_peak=at_peak)
    memory = {
        "params": params * param_bytes,
        "grads": params * grad_bytes,
        "optimizer": params * optimizer_states * state_bytes,
        "activations": activations,
        "gathered": gathered,
    }
    memory["total"] = sum(memory.values())
    return memory
