"""Per-device memory and step time of one layout (data x pipeline x tensor, schedule, micro-batches) of a workload.

Pure arithmetic over ``Workload`` figures, a ``Hardware`` and the schedule's unit-cost bubble; it enumerates no
layouts (``search.py`` does) and measures nothing. The layout and the estimate records are ``layout.py``'s; memory and
time share one pass over each rank's blocks (``_Rank``); per-block checkpointing arithmetic is ``checkpointing.py``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_parallel.pipeline.balance import split_by_cost
from lightning_parallel.planner.checkpointing import MODES as CHECKPOINTING
from lightning_parallel.planner.checkpointing import checkpointed_kinds, kept_and_rematerialised, recompute_factor
from lightning_parallel.planner.hardware import Hardware, precision_bytes
from lightning_parallel.planner.layout import Estimate, Layout, check_layout
from lightning_parallel.planner.memory import UPDATES, RankBytes, rank_memory, stage_figures, update_elements
from lightning_parallel.planner.schedule_costs import schedule_cost
from lightning_parallel.planner.workload import Workload


@dataclass(frozen=True)
class _Rank:
    """One pipeline rank's aggregated figures at a given tensor-parallel size (per sample where noted)."""

    params: float  # local parameters (tensor shard), before any data-parallel sharding
    replica_units: tuple[tuple[int, float], ...]  # each FSDP2 unit: its first block's index here, local parameters
    fixed: float  # seconds per micro-batch that do not scale with its size, computing alone
    per_sample: float  # seconds per sample, computing alone
    comm_fixed: float  # network seconds per micro-batch of its tensor-parallel collectives
    collectives: int  # tensor-parallel collectives per micro-batch (each adds the hardware's collective overhead)
    comm_per_sample: float
    activations: float  # bytes saved per sample over all its stages
    rematerialised: float  # bytes per sample one checkpointed block rebuilds during its backward (the largest)
    blocks: int
    block_params: tuple[float, ...] = ()  # local parameters per block, in forward order
    block_activations: tuple[float, ...] = ()  # bytes kept per sample per block, in forward order
    update: float = 0.0  # state elements the optimizer step's temporaries hold (``memory.UPDATES``)
    loss: float = 0.0  # bytes per sample a loss after its blocks holds beside their activations while it runs
    block_largest: tuple[float, ...] = ()  # elements of each block's largest local parameter, in forward order
    loss_backward: float = 0.0  # bytes per sample a loss's backward holds before its input's gradient is made
    pipeline: tuple[Any, ...] = (0.0, 0.0, 0.0, (), ())  # ``memory.stage_figures``, bytes per sample


class CostModel:
    """Estimates layouts of one workload on one hardware; caches what layouts share (splits, per-rank sums).

    Args:
        workload: The model's figures.
        hardware: The devices and network.
        precision: A Lightning precision name (bytes per parameter, gradient, state, activation).
        optimizer_states: Optimizer state elements per parameter (Adam: 2, SGD with momentum: 1).
        activation_checkpointing: "none", "full" or "selective", per block as the strategies apply it
            (``planner/checkpointing.py``).
        stages: Block indices per stage as the pipeline cuts the network (a traced network's cut, balanced by
            FLOPs), for layouts with that many stages; others are balanced by parameters as ``make_partition``.
        update: How the optimizer's step makes temporaries (``memory.UPDATES``: "for-loop", "foreach", "fused").
    """

    def __init__(
        self,
        workload: Workload,
        hardware: Hardware,
        *,
        precision: str = "32-true",
        optimizer_states: int = 2,
        activation_checkpointing: str = "none",
        stages: Sequence[Sequence[int]] | None = None,
        update: str = "fused",
    ):
        if optimizer_states < 0:
            raise ValueError(f"optimizer_states={optimizer_states} must be >= 0. HINT: Adam keeps 2, SGD 0 or 1")
        if activation_checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing={activation_checkpointing!r} is unknown. HINT: one of "
                f"{', '.join(CHECKPOINTING)}"
            )
        if update not in UPDATES:
            raise ValueError(f"update={update!r} is unknown. HINT: one of {', '.join(UPDATES)}")
        self.activation_checkpointing, self.update = activation_checkpointing, update
        self.workload, self.hardware, self.precision = workload, hardware, precision
        self.optimizer_states = optimizer_states
        self.stages = tuple(tuple(stage) for stage in stages) if stages is not None else None
        self.param_bytes, self.grad_bytes, self.state_bytes, self.act_bytes = precision_bytes(precision)
        self.rate = hardware.flops_for(precision) * hardware.efficiency
        self._split = functools.lru_cache(maxsize=None)(self._split_uncached)
        self._ranks = functools.lru_cache(maxsize=None)(self._ranks_uncached)

    # ---- what layouts share ----------------------------------------------------------------------
    def _split_uncached(self, num_stages: int) -> tuple[tuple[int, ...], ...]:
        """Block indices per stage: the given cut, or balanced by parameters exactly as ``make_partition``."""
        if self.stages is not None and len(self.stages) == num_stages:
            return self.stages
        blocks = self.workload.blocks
        names = [str(i) for i in range(len(blocks))]
        costs = [float(max(b.params, 1)) for b in blocks]
        return tuple(tuple(int(n) for n in stage) for stage in split_by_cost(names, costs, num_stages))

    def _ranks_uncached(self, pp: int, stages: tuple[int, ...], tp: int) -> tuple[_Rank, ...]:
        split = self._split(len(stages))
        return tuple(self._rank(split, [s for s, r in enumerate(stages) if r == rank], tp) for rank in range(pp))

    def _rank(self, split: tuple[tuple[int, ...], ...], stages: list[int], tp: int) -> _Rank:
        hw, net = self.hardware, self.hardware.network
        fixed = per_sample = comm_fixed = comm_per_sample = activations = rebuilt = params = loss = loss_back = 0.0
        count = collectives = 0
        block_params: list[float] = []
        block_activations: list[float] = []
        largest: list[float] = []
        sizes: list[float] = []  # local elements of each parameter, in update order
        units: list[tuple[str, int, float]] = []  # FSDP2 units: (name, first block here, local parameters)
        checkpointed = checkpointed_kinds(self.workload.blocks)
        for index in (i for s in stages for i in split[s]):
            block = self.workload.blocks[index]
            block_input = self.workload.blocks[index - 1].output if index > 0 else 0.0
            mode = self.activation_checkpointing if block.kind in checkpointed else "none"
            recompute = recompute_factor(mode)
            local = block.params - block.tp_params + block.tp_params / tp
            params += local
            each = [n / tp if split else n for n, split in block.parameters]
            sizes.extend(each)
            largest.append(max(each, default=0.0))
            block_params.append(local)
            if units and block.replica_unit and units[-1][0] == block.replica_unit:
                units[-1] = (block.replica_unit, units[-1][1], units[-1][2] + local)
            else:
                units.append((block.replica_unit, count, local))
            count += 1
            shard = 1.0 - (block.tp_flops / block.flops if block.flops else 0.0) * (1.0 - 1.0 / tp)
            if block.seconds is not None:
                fixed += block.seconds[0] * recompute
                per_sample += block.seconds[1] * shard * recompute
            else:
                fixed += hw.block_overhead * recompute
                per_sample += block.flops * shard / self.rate * recompute
            kept, rebuilding = kept_and_rematerialised(block, tp, mode, block_input)
            loss += (block.loss_input - block.tp_loss_input + block.tp_loss_input / tp) * self.act_bytes
            split_loss = tp > 1 and block.tp_loss_backward  # the loss then runs on the shards (`tensor/vocab_loss.py`)
            loss_back += (block.tp_loss_backward / tp if split_loss else block.loss_backward) * self.act_bytes
            activations += kept * self.act_bytes
            block_activations.append(kept * self.act_bytes)
            rebuilt = max(rebuilt, rebuilding * self.act_bytes)
            for kind, elements in block.collectives if tp > 1 else ():
                fixed_s, per_byte = net.collective_terms(kind, tp, 1)
                comm_fixed += fixed_s
                collectives += 1
                comm_per_sample += per_byte * elements * self.act_bytes
        sums = (fixed, per_sample, comm_fixed, collectives, comm_per_sample, activations, rebuilt, count)
        replicas = tuple((start, size) for _, start, size in units)
        update = update_elements(self.update, sizes, params)
        blocks = (tuple(block_params), tuple(block_activations))
        kept_by, size = dict(zip((i for s in stages for i in split[s]), block_activations, strict=True)), self.act_bytes
        kept_by[len(self.workload.blocks) - 1] = kept_by.get(len(self.workload.blocks) - 1, 0.0) + loss  # its stage's
        piped = stage_figures([(b.output * size, kept_by.get(i, 0.0), b.weight_gradients * size)
                               for i, b in enumerate(self.workload.blocks)], split, stages)  # fmt: skip
        return _Rank(params, replicas, *sums, *blocks, update, loss, tuple(largest), loss_back, piped)

    # ---- one layout ------------------------------------------------------------------------------
    def estimate(self, layout: Layout, *, batch: int) -> Estimate:
        """Memory and step time of ``layout`` with ``batch`` samples per replica per step.

        Raises:
            ValueError: The layout cannot run this workload (sizes, tensor-parallel divisibility, micro-batches).
        """
        self.check(layout, batch=batch)
        stages = tuple(layout.stage_to_rank())
        ranks = self._ranks(layout.pp, stages, layout.tp)
        micro = batch // layout.microbatches
        if layout.pp > 1:
            cost = schedule_cost(
                layout.schedule or "",
                pp=layout.pp,
                microbatches=layout.microbatches,
                stages_per_rank=layout.stages_per_rank,
            )
            bubble, actions, exact = cost.bubble, cost.actions, cost.exact
            stretch = self._stretch(layout, cost.busy_ranks)
            in_flight = tuple(zip(cost.at_first_grad, cost.with_grads, cost.at_peak or ((),) * layout.pp, strict=True))
        else:  # one backward, then no forward beside the gradients
            bubble, in_flight, actions, exact, stretch = 0.0, ((1, 0, ()),), 0, True, 1.0
        time = self._time(layout, ranks, stages, micro, bubble, actions, stretch)
        per_rank = self._memories(layout, ranks, micro, in_flight)
        memory = max(per_rank, key=lambda m: m["total"])
        shard = layout.dp if layout.dp_shard else 1
        return Estimate(
            layout=layout,
            batch=batch,
            memory=memory,
            capacity=self.hardware.memory_bytes * self.hardware.usable_memory,
            time=time,
            bubble_fraction=bubble,
            parameters_per_rank=tuple(round(r.params / shard) for r in ranks),
            exact_schedule=exact,
            memory_per_rank=tuple(per_rank),
        )

    def check(self, layout: Layout, *, batch: int) -> None:
        """Raise ValueError (one line) when the layout cannot run this workload (``layout.check_layout``)."""
        check_layout(layout, batch=batch, name=self.workload.name, blocks=len(self.workload.blocks),
                     tp_modulus=self.workload.tp_modulus)  # fmt: skip

    def _time(
        self,
        layout: Layout,
        ranks: Sequence[_Rank],
        stages: Sequence[int],
        micro: int,
        bubble: float,
        actions: int,
        stretch: float,
    ) -> dict[str, float]:
        hw, net = self.hardware, self.hardware.network
        scale = hw.slowdown(layout.devices)  # while every device computes
        m = layout.microbatches
        crosses = layout.pp * layout.tp > net.devices_per_node
        work = []
        for rank, figures in enumerate(ranks):
            compute = (figures.fixed + figures.per_sample * micro) * scale
            tp_comm = figures.comm_fixed + figures.collectives * hw.collective_overhead * scale
            tp_comm += figures.comm_per_sample * micro
            owned = [s for s, r in enumerate(stages) if r == rank]
            p2p = sum(self._messages(s, len(stages), layout, micro, crosses) for s in owned)
            overhead = hw.action_overhead * scale * actions * len(owned)
            work.append((compute + overhead, tp_comm, p2p))
        slowest = max(work, key=sum)
        busy = m * sum(slowest)
        pipeline = (busy / (1.0 - bubble) if bubble < 1 else busy) * stretch
        backward = m * slowest[0] * 2 / 3
        dp_comm = max(0.0, self._dp_comm(layout, ranks, scale) - hw.dp_overlap * backward)
        shard = layout.dp if layout.dp_shard else 1
        optimizer = max(r.params for r in ranks) / shard * hw.optimizer_time * scale
        return {
            "compute": m * slowest[0],
            "tp_comm": m * slowest[1],
            "pp_comm": m * slowest[2],
            "bubble": max(0.0, pipeline - busy),
            "dp_comm": dp_comm,
            "optimizer": optimizer,
            "overhead": self._overhead(layout) * scale,
        }

    def _stretch(self, layout: Layout, busy_ranks: Sequence[float]) -> float:
        """How much shorter a pipeline step is than the schedule at all-busy speed, where devices share cores: while
        only some pipeline ranks compute (the warm-up, the cool-down), they compute faster."""
        hw, others = self.hardware, layout.dp * layout.tp
        everyone = hw.slowdown(layout.devices)
        return sum(share * hw.slowdown(busy * others) / everyone for busy, share in enumerate(busy_ranks)) or 1.0

    def _overhead(self, layout: Layout) -> float:
        hw = self.hardware
        sync = hw.sync_overhead if layout.devices > 1 else 0.0
        wrapper = hw.dp_overhead if layout.dp > 1 and layout.pp == layout.tp == 1 else 0.0
        return hw.step_overhead + sync + wrapper

    def _messages(self, stage: int, num_stages: int, layout: Layout, micro: int, crosses: bool) -> float:
        """Receive the activation from the stage before, and the gradient from the stage after."""
        split = self._split(num_stages)
        seconds = 0.0
        if stage > 0:
            before = self.workload.blocks[split[stage - 1][-1]].output
            seconds += self.hardware.network.send(before * micro * self.act_bytes, crosses_nodes=crosses)
        if stage < num_stages - 1:
            after = self.workload.blocks[split[stage][-1]].output
            seconds += self.hardware.network.send(after * micro * self.act_bytes, crosses_nodes=crosses)
        return seconds

    def _dp_comm(self, layout: Layout, ranks: Sequence[_Rank], scale: float) -> float:
        if layout.dp == 1:
            return 0.0
        net = self.hardware.network
        stride = layout.pp * layout.tp
        worst = max(ranks, key=lambda r: r.params)
        if not layout.dp_shard:
            return net.collective("all_reduce", worst.params * self.grad_bytes, layout.dp, stride)
        # FSDP: per block, gather the parameters for forward and again for backward, reduce-scatter the gradients
        fixed, per_byte = net.collective_terms("all_gather", layout.dp, stride)
        fixed += self.hardware.collective_overhead * scale
        traffic = worst.params * (2 * self.param_bytes + self.grad_bytes) * per_byte
        return 3 * worst.blocks * fixed + traffic

    def _memories(
        self, layout: Layout, ranks: Sequence[_Rank], micro: int, in_flight: Sequence[tuple[int, int, Any]]
    ) -> list[dict[str, float]]:
        """Per pipeline rank: ``memory.rank_memory`` with the schedule's in-flight counts (at its first backward,
        beside its gradients)."""
        sizes = (self.param_bytes, self.grad_bytes, self.state_bytes)
        memories = []
        for rank, figures in enumerate(ranks):
            first, after, at_peak = in_flight[min(rank, len(in_flight) - 1)]
            held = RankBytes(figures.block_params, figures.block_activations, figures.rematerialised,
                             [size for _, size in figures.replica_units],
                             [start for start, _ in figures.replica_units], figures.update, figures.loss,
                             figures.block_largest, figures.loss_backward, *figures.pipeline)  # fmt: skip
            memories.append(rank_memory(
                held, micro=micro, shard=layout.dp if layout.dp_shard else 1, stages_per_rank=layout.stages_per_rank,
                at_first_grad=first, with_grads=after, sizes=sizes, optimizer_states=self.optimizer_states,
                holds_output=layout.pp > 1, microbatches=layout.microbatches, at_peak=at_peak,
            ))  # fmt: skip
        return memories
