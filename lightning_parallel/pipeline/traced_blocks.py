"""The split units ("blocks") a traced network offers and what each costs in FLOPs (pruning to some of them is
`prune.prune_children`, reached from here too). Reads torch.fx graphs and modules only: no tracing (`traced.py`), no
rebinding (`rebind.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.pipeline.prune import prune_children

__all__ = ["find_blocks", "flop_costs", "outside_blocks", "prune_children"]


def find_blocks(traced: nn.Module) -> list[str]:
    """The submodules a traced module's graph calls exactly once, in call order; one whose own calls include a
    stack of layers (numbered items, ``h.0``, ``layer.3``), at any depth, is replaced by its own blocks. A model
    that wraps its whole stack in one child (``model.transformer``) thus splits between layers, while a layer's
    own parts (attention, MLP) stay together."""
    calls = [str(node.target).split("@")[0] for node in traced.graph.nodes if node.op == "call_module"]  # type: ignore[union-attr]
    found: list[str] = []
    for name in dict.fromkeys(call for call in calls if calls.count(call) == 1):
        child = traced.get_submodule(name)
        inner = find_blocks(child) if isinstance(getattr(child, "graph", None), torch.fx.Graph) else []
        if any(part.isdigit() for block in inner for part in block.split(".")):
            found += [f"{name}.{block}" for block in inner]
        else:
            found.append(name)
    return found


def outside_blocks(network: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The outermost submodules that are no block, inside none and hold none (modules called twice, or not at all)."""
    found: list[str] = []
    for name, _ in network.named_modules():
        related = [*blocks, *found]
        if name and not any(name == b or name.startswith(b + ".") or b.startswith(name + ".") for b in related):
            found.append(name)
    return found


def flop_costs(stages: Sequence[nn.Module], inputs: tuple[torch.Tensor, ...]) -> list[float]:
    """Forward + backward FLOPs of each chained stage, run on the meta device (nothing is materialised)."""
    values = tuple(torch.empty_like(t, device="meta") for t in inputs)
    costs = []
    for index, stage in enumerate(stages):
        values = tuple(v.detach().requires_grad_(index > 0 and v.is_floating_point()) for v in values)
        with FlopCounterMode(display=False) as counter:
            out = stage(*values)
            grads = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
        costs.append(float(counter.get_total_flops()))
        values = out if isinstance(out, tuple) else (out,)
    for param in stages[0].parameters() if stages else []:
        param.grad = None
    return costs
