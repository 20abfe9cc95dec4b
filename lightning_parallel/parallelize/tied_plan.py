"""Set-up step "plan", for a parameter tied across pipeline stages (an embedding and the output head it is tied to):
every module holding it shards it alike (both by vocabulary rows: its gradient is then summed shard by shard), or
it is kept whole under every name, with the reason in summary.json; never refused. Touches no other plan entry;
the tie's collectives are `pipeline/tied.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import nn
from torch.distributed.tensor import Placement, Shard

from lightning_parallel.pipeline.tied import TiedGroup
from lightning_parallel.tensor.traced_stages import parameter_placements

# (source, exact-name plan, why each unplanned module stays whole): `plan.Plan`
Plan = tuple[str, dict[str, str], dict[str, str]]


def settle_tied(network: nn.Module, plan: Plan, tied: Sequence[TiedGroup]) -> tuple[Plan, list[TiedGroup]]:
    """The plan with each tied parameter sharded alike by every holder or by none, and the tied groups saying which
    dimension (`TiedGroup.shard_dim`). Holders that would shard it differently (a vocabulary-parallel embedding
    tied to a head the plan splits by features or leaves whole) leave the plan, kept whole with the reason why."""
    source, exact, replicated = plan[0], dict(plan[1]), dict(plan[2])
    settled = []
    for group in tied:
        holders = {name.rpartition(".")[0]: name for name in group.names}  # module -> the parameter's name there
        placements = {module: _placement(network, module, name, exact.get(module)) for module, name in holders.items()}
        kinds = set(placements.values())
        only = next(iter(kinds)) if len(kinds) == 1 else "differs"
        if only is None or type(only) is Shard:  # alike: whole everywhere, or the same rows or columns everywhere
            settled.append(replace(group, shard_dim=only.dim if isinstance(only, Shard) else None))
            continue
        ways = ", ".join(f"{m} ({exact.get(m, 'no plan entry')}: {p or 'whole'})" for m, p in placements.items())
        for module in holders:
            if exact.pop(module, None) is not None:
                replicated[module] = (
                    f"kept whole: {holders[module]} is tied across pipeline stages and its holders would place it "
                    f"differently ({ways}); a tie is summed shard by shard only when every holder shards it alike"
                )
        settled.append(replace(group, shard_dim=None))
    return (source, exact, replicated), settled


def _placement(network: nn.Module, module: str, name: str, style: str | None) -> Placement | None:
    """How `style` places the parameter `name` of `module`; None for whole (no plan entry, or Replicate)."""
    if style is None:
        return None
    placement = parameter_placements(network.get_submodule(module), style).get(name.rpartition(".")[2])
    return None if placement is None or placement.is_replicate() else placement
