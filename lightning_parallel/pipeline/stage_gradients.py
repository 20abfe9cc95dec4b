"""Which values crossing traced pipeline stages need a gradient: those computed from a parameter (frozen or not: it may
be unfrozen later) or a floating network input. Decided once per split from the traced network's forward, on meta.

RoPE's cos / sin (from a buffer and position ids), a float mask made from token ids, positions from a buffer: none
depends on a parameter, so a stage takes them detached (`chain.to_chain_stage`) and nothing saves its operands for a
backward, or computes a gradient for it, whatever `requires_grad` the stage's receive buffer has (torch 2.11 and the
dry run make every floating one require grad; 2.13 does as stage 0's output had). No devices, no process groups here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx


class _Recorder(fx.Interpreter):
    """Runs torch's split graph, noting each top-level value that is (or holds) a tensor requiring a gradient."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.needing: set[str] = set()

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            self.needing.add(n.name)
        return value


def needing_gradient(split_module: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> frozenset[str]:
    """Names of the values of torch's split graph (``Pipe.split_gm``: its placeholders, stage calls and their items, as
    `chain.StageFlow` names them) that may require a gradient: computed from any floating parameter (a frozen one
    too: a user may unfreeze it after the split, and a value decided here as needing none would then silently cut
    its gradient) or from a floating network input (chained stages differentiate like the network for a caller
    whose inputs require one; a pipeline's batch does not). Runs the graph on meta tensors shaped like ``inputs``;
    autograd decides, so integer and boolean results never need one.
    """
    recorder = _Recorder(split_module)
    frozen = [p for p in split_module.parameters() if p.is_floating_point() and not p.requires_grad]
    try:
        for parameter in frozen:
            parameter.requires_grad_(True)
        with torch.enable_grad():
            recorder.run(*(torch.zeros_like(t, device="meta").requires_grad_(t.is_floating_point()) for t in inputs))
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)
    return frozenset(recorder.needing)


def no_gradient(value: object) -> object:
    """A chain stage's input that needs no gradient (`needing_gradient`), detached: its graph starts after it."""
    return value.detach() if isinstance(value, torch.Tensor) else value
