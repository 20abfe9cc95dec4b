"""The GPT workload tensor_overhead.py and overhead_3d.py time, identical in every run: the network (from one saved
state), its Megatron split written in torch's own styles, the batches, the loss and the smallest LightningModule
around them. It times and launches nothing.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_parallel.models import GPT

WIDTH, DEPTH, HEADS, VOCAB, CONTEXT, BATCH, LR, DISTINCT_BATCHES = 256, 4, 8, 256, 64, 8, 1e-3, 4
# the results file's config["model"]
MODEL = {"name": "GPT", "width": WIDTH, "depth": DEPTH, "heads": HEADS, "vocab_size": VOCAB, "context_length": CONTEXT,
         "batch": BATCH, "loss": "cross_entropy", "optimizer": "SGD", "lr": LR}  # fmt: skip


def build_network(state: dict[str, torch.Tensor] | None = None) -> GPT:
    network = GPT(vocab_size=VOCAB, context_length=CONTEXT, depth=DEPTH, width=WIDTH, heads=HEADS)
    if state is not None:
        network.load_state_dict(state)
    return network


def megatron_plan() -> dict[str, ParallelStyle]:
    """GPT.tp_plan (without sequence parallelism) written directly in torch's styles."""
    plan: dict[str, ParallelStyle] = {"embed.token": RowwiseParallel(input_layouts=Replicate())}  # vocab-parallel
    for i in range(DEPTH):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            plan[f"block_{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.down"):
            plan[f"block_{i}.{name}"] = RowwiseParallel()
    plan["head.lm_head"] = ColwiseParallel(output_layouts=Replicate())  # gathered logits
    return plan


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=generator) for _ in range(DISTINCT_BATCHES)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # (B, T, V) against (B, T)


def parameter_bytes(module: nn.Module) -> int:
    local = (p.to_local() if isinstance(p, DTensor) else p for p in module.parameters())
    return sum(t.numel() * t.element_size() for t in local)


class MinimalTask(pl.LightningModule):
    """The network at `model`, cross-entropy, SGD: what the hand-written loop does, nothing more."""

    def __init__(self, network: GPT) -> None:
        super().__init__()
        self.model = network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return lm_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)
