"""Next-token language modelling: cross-entropy over every position and torchmetrics perplexity."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.text import Perplexity

from lightning_parallel.tasks.base import Task


class LanguageModelTask(Task):
    """Trains a decoder on `(x, y)` token batches, y being x shifted by one; logs loss and `val/ppl`."""

    def make_metrics(self) -> dict[str, Metric]:
        return {"ppl": Perplexity()}

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # (B, T, V) logits against (B, T) targets -> one mean over all B*T positions
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def metric_inputs(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Perplexity wants float logits (B, T, V); under bf16 autocast they may arrive in half precision.
        return output.float(), target
