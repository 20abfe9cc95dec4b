"""The gradients a split backward keeps at a block's weights from its input-gradient action (I) to its weight-gradient
action (W) in the zero-bubble schedules, found by running torch's own ``stage_backward_input`` on the analysis's meta
tensors. Runs no weight-gradient step and knows nothing of schedules (``schedule_costs.py``) or stages.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input


def weight_gradient_elements(block: nn.Module, x: torch.Tensor) -> float:
    """Elements of the gradients ``stage_backward_input`` keeps for the weight-gradient step of ``block`` run on
    ``x`` (its parameter groups' gradients at the ops the weights meet the input's path: each linear's and norm's
    output gradient); 0 when the block has no parameters or its output needs no gradient."""
    params = [p for p in block.parameters() if p.requires_grad]
    x = x.detach().requires_grad_(x.is_floating_point())
    out = block(x)
    if not params or not torch.is_tensor(out) or not out.requires_grad or not x.requires_grad:
        return 0.0
    _, groups = stage_backward_input([out], [torch.empty_like(out)], [x], iter(params))
    kept = {id(g): g for group in groups for grads in group.get("grads") or () for g in grads if g is not None}
    return float(sum(g.numel() for g in kept.values()))
