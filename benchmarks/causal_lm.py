"""The LightningModule the transformers benchmarks train: a causal LM on its own loss from `labels`, as users do."""

from __future__ import annotations

import lightning.pytorch as pl
import torch


class CausalLM(pl.LightningModule):
    """`network(input_ids=..., labels=...).loss`, AdamW."""

    def __init__(self, network: torch.nn.Module) -> None:
        super().__init__()
        self.network = network

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.network(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)
