"""LightningModules built on torch's `nn.Transformer` family, written the way their users write them: Lightning's own
demo `LightningTransformer` (its `Transformer` wraps `nn.Transformer`; here with a tiny, dropout-free config) and a
causal language model on `nn.TransformerEncoder` with a causal mask and a padding mask. Nothing here knows about our
strategies."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, SAMPLES = 32, 8, 64


def demo() -> LightningTransformer:
    """Lightning's demo module as it ships (its training_step, configure_optimizers, forward), its network smaller
    and without dropout: a parity test compares two runs' arithmetic, and dropout masks differ between them."""
    module = LightningTransformer(vocab_size=VOCAB)
    module.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)
    module.prepare_data = lambda: None  # type: ignore[method-assign]  # it downloads WikiText-2: our loaders instead
    return module


class EncoderNet(nn.Module):
    """A causal language model on `nn.TransformerEncoder` (its defaults: nested tensors enabled, mask checks on),
    attending under a causal mask and a key padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=3)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.size(1), device=ids.device)
        return self.head(self.encoder(self.embedding(ids), mask=causal, src_key_padding_mask=padding))


class EncoderLM(pl.LightningModule):
    """The network in `self.model`, the loss in training_step."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.model = EncoderNet()
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, padding, target = batch
        logits = self.model(ids, padding)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


MODULES: dict[str, Any] = {"demo": demo, "encoder": EncoderLM}


def loader(name: str, *, batch_size: int = 8) -> DataLoader:
    data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(0))
    if name == "demo":
        return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch_size)
    padding = torch.zeros(SAMPLES, SEQ, dtype=torch.bool)
    padding[::3, -2:] = True  # every third row ends in two padded keys, which no query attends to
    return DataLoader(TensorDataset(data[:, :-1], padding, data[:, 1:]), batch_size=batch_size)


def build(name: str) -> pl.LightningModule:
    torch.manual_seed(0)
    return MODULES[name]()
