"""A loss run after a network's last block, outside the network (a LightningModule's own loss on the logits an
``nn.Sequential`` returns), added to that block's figures as ``call_analysis.py`` counts a network's own loss: what it
saves, its input held while it runs, what its backward holds. Runs the loss once on fake tensors; analyses no block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from lightning_parallel.planner.loss_backward import loss_backward_elements
from lightning_parallel.planner.workload import Workload


def with_loss(
    workload: Workload,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    output: torch.Tensor,
    *,
    split: bool,
) -> Workload:
    """``workload`` with the loss ``loss_of(logits)`` counted on its last block, per sample of ``output`` (the
    network's output for a batch, any device: only its shape and dtype are used; 2 or more rows).

    ``split``: the last block is a `vocab_head` under tensor parallelism, so the loss runs on the logits' vocabulary
    shards (`tensor/vocab_loss.py`): what it saves and holds splits with them, and its backward makes its input's
    gradient once, in place. A loss that does not depend on the output through autograd adds nothing.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows = int(output.shape[0]) if output.dim() else 0
    if rows < 2:
        raise ValueError(f"the loss's analysis needs an output of at least 2 rows, got {rows}. HINT: pass 2 rows")
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with FakeTensorMode(allow_non_fake_inputs=True):
        logits = torch.empty(output.shape, dtype=output.dtype, device="cpu", requires_grad=output.is_floating_point())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_of(logits)
        if not torch.is_tensor(loss) or loss.grad_fn is None:
            return workload
        kept = {id(base): base.numel() for base in (t._base if t._base is not None else t for t in saved)}
        backward = loss_backward_elements(loss, logits)
    held, outside = logits.numel() / rows, sum(kept.values()) / rows
    last = workload.blocks[-1]
    block = replace(
        last,
        activations=last.activations + outside,
        tp_activations=last.tp_activations + (outside if split else 0.0),
        outside_activations=last.outside_activations + outside,
        tp_outside_activations=last.tp_outside_activations + (outside if split else 0.0),
        loss_input=held,
        tp_loss_input=held if split else 0.0,
        loss_backward=backward / rows,
        tp_loss_backward=held if split else 0.0,  # the vocabulary-parallel loss's: one copy, made in place
    )
    return replace(workload, blocks=(*workload.blocks[:-1], block))
